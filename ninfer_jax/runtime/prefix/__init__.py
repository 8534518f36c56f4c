"""The scheduler's side of the hybrid prefix cache: it asks the index (`ninfer_jax/prefix_cache/`) what to do and
has the device side (`runtime/device/`) do the copies. The scheduler reaches it through `PrefixCacheManager`."""
