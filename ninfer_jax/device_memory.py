"""How much of each GPU jax's allocator may take: the entry points claim most of it before jax starts, so the KV
pool (`kv_capacity` auto) sizes from the whole device, not jax's default three quarters.

On the H200 the default left the 35B-A3B at 256 lanes a KV pool of 128k tokens (2.5 GiB beside 67 GB of weights
and 31.5 GiB of state slots), and 1k-in/1k-out requests at 256 clients ran out of pages
(`docs/benchmarks/serving_benchmark.md`). The library itself never sets it: it is a process-wide setting.
"""

from __future__ import annotations

import os

ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# What stays outside jax's pool: the CUDA context, cuBLAS and cuDNN workspaces (about 7 GiB of an H200).
CLAIM = 0.95


def claim_device_memory(fraction: float = CLAIM) -> float:
    """Lets jax's allocator take `fraction` of each GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION is set
    already (the user's value wins); returns the fraction in force. Call before jax starts its backend."""
    return float(os.environ.setdefault(ENV, str(fraction)))


__all__ = ["CLAIM", "ENV", "claim_device_memory"]
