"""Builds an engine from its options: sizes the device pools, starts the runner, the prefix cache and its Host
tier, loads the prefix cache file and compiles every step, logging each as one line."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import ops
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import Params, QuantizedWeight
from ninfer_jax.model.state import PAGE, page_bytes, prefill_activation_bytes, slot_bytes
from ninfer_jax.prefix_cache import CacheGeometry, PrefixIndex
from ninfer_jax.runtime.device.cache_file import FORMAT, LoadReport, PrefixCacheFile, source_identity
from ninfer_jax.runtime.device.host_buffer import HostSlabBuffer
from ninfer_jax.runtime.device.host_tier import HostTier
from ninfer_jax.runtime.device.runner import ModelRunner
from ninfer_jax.runtime.device.sharding import ParallelLayout
from ninfer_jax.runtime.options import (AUTO_LANE_KV_TOKENS, CPU_CONCURRENCY, MAX_CONCURRENCY, EngineOptions,
                                        OptionsError, snapshot_slots)
from ninfer_jax.runtime.prefix.manager import PrefixCacheManager
from ninfer_jax.runtime.scheduler import Scheduler, pages_for
from pallas_kernels.paged_attention import PrefillConfig

log = logging.getLogger("ninfer_jax.engine")


def is_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (where the cuDNN prefill attention was measured faster)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    return device.platform == "gpu" and capability.split(".")[0] == "9"


def resolve_options(options: EngineOptions, config: ModelConfig, share: DeviceShare | None = None) -> EngineOptions:
    """The options with every derived value filled in for this model on this process's first device (after the
    weights are loaded: max_concurrency auto counts the memory they leave, and `share`'s pending bytes)."""
    backend = jax.default_backend()

    def resolve(lanes: int | None) -> EngineOptions:
        return options.resolve(config.max_position_embeddings, backend, moe=config.is_moe,
                               hopper=is_hopper(jax.devices()[0]), auto_lanes=lanes,
                               available_memory=available_memory_bytes(), quantized=config.quantization is not None,
                               cpu_cores=usable_cpu_cores(), devices=jax.device_count())

    if options.enable_expert_parallel and not config.is_moe:
        raise OptionsError("enable_expert_parallel needs a model with routed experts; this one is dense")
    if options.max_concurrency != "auto" or backend != "gpu":
        return resolve(None)
    return resolve(auto_lanes(config, resolve(1), snapshot_slots_given=options.device_snapshot_slots is not None,
                              share=share or DeviceShare()))


def usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS tells it; a container's limit often)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """The host memory available for new allocations without swapping (MemAvailable); None where not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_budget(options: EngineOptions, fixed_bytes: int, activation_bytes: int) -> int | None:
    """The bytes the pools may take beyond `fixed_bytes`: the device memory free now, less a reserve for the
    longest prefill pass's activations and the compiler's scratch, times memory_fraction. None on a backend that
    reports no memory."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    free = limit - stats.get("bytes_in_use", 0) - fixed_bytes
    reserve = max(2 << 30, int(0.05 * limit), activation_bytes)  # activations, compiler scratch
    return int((free - reserve) * options.memory_fraction)


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """What one device of the engine's mesh holds: the fractions of a KV page and of a state slot (1 / N where
    the attention's or the GDN's heads split over N devices), and weight bytes not yet on it (host-loaded params,
    which the runner places after the pools are sized). One device: all of each, nothing pending."""

    page: float = 1.0
    slot: float = 1.0
    pending_bytes: int = 0

    def bytes(self, pages: int, page: int, slots: int, slot: int) -> int:
        """One device's bytes of `pages` pages and `slots` slots of the given full sizes."""
        return int(pages * page * self.page + slots * slot * self.slot)


def device_share(config: ModelConfig, params: Params, options: EngineOptions) -> DeviceShare:
    """The DeviceShare of an engine on `options`' mesh (`parallel_layout`) for these params."""
    layout = parallel_layout(options)
    if layout is None:
        return DeviceShare()
    page, slot = layout.pool_shares(params, config)
    on_host = all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    return DeviceShare(page, slot, layout.device_bytes(params, config) if on_host else 0)


def auto_lanes(config: ModelConfig, options: EngineOptions, *, snapshot_slots_given: bool,
               share: DeviceShare = DeviceShare()) -> int:
    """max_concurrency auto: the most lanes C, at most MAX_CONCURRENCY, whose C + D state slots and a KV pool of
    AUTO_LANE_KV_TOKENS per lane (max_model_len if shorter; kv_capacity's pool when given) fit `device_budget`
    (one device's share of them, on a mesh). `options` is resolved with any lane count; D is its
    device_snapshot_slots when given, else the default rule."""
    dtype = kv_dtype(options)
    per_slot = slot_bytes(config, dtype)
    per_page = max(1, page_bytes(config, dtype, options.kv_dtype, options.speculative == "mtp"))
    budget = device_budget(options, share.pending_bytes,
                           prefill_activation_bytes(config, options.idle_prefill_chunk, dtype))
    if budget is None:
        return CPU_CONCURRENCY
    host = options.host_cache_mib > 0 and not options.no_prefix_reuse
    per_lane = min(options.max_model_len, AUTO_LANE_KV_TOKENS)
    for lanes in range(MAX_CONCURRENCY, 1, -1):
        snapshots = options.device_snapshot_slots if snapshot_slots_given \
            else snapshot_slots(lanes, host, options.no_prefix_reuse)
        pages = pages_for(max(lanes * per_lane, options.max_model_len) if options.kv_capacity == "auto"
                          else options.kv_capacity)
        if share.bytes(pages, per_page, lanes + snapshots, per_slot) <= budget and pages >= lanes:
            return lanes
    return 1




@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """The device pools: KV pages and state slots (C active + D snapshot), and their bytes."""

    num_pages: int
    num_slots: int
    page_bytes: int  # one page of every attention layer, K and V
    slot_bytes: int  # one state slot of every GDN layer (a snapshot image)

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


def kv_dtype(options: EngineOptions):
    return jnp.bfloat16 if options.dtype == "bfloat16" else jnp.float32


def auto_kv_tokens(options: EngineOptions, bytes_per_page: int, fixed_bytes: int, activation_bytes: int) -> int:
    """KV capacity for kv_capacity="auto": the device memory left after weights, state and the longest prefill
    pass's activations, or (on a backend that reports no memory) enough for every lane to reach max_model_len."""
    usable = device_budget(options, fixed_bytes, activation_bytes)
    if usable is None:
        return options.max_concurrency * options.max_model_len
    return max(PAGE, usable // max(1, bytes_per_page) * PAGE)


def size_pools(config: ModelConfig, options: EngineOptions, share: DeviceShare = DeviceShare()) -> PoolSizes:
    """Pages for kv_capacity tokens ("auto": what the device holds, counting one device's share of each page and
    slot on a mesh) and C + D state slots. Raises ValueError when the pool cannot give every lane a page."""
    dtype = kv_dtype(options)
    num_slots = options.max_concurrency + options.device_snapshot_slots
    per_slot = slot_bytes(config, dtype)
    per_page = max(1, page_bytes(config, dtype, options.kv_dtype, options.speculative == "mtp"))
    tokens = options.kv_capacity
    if tokens == "auto":
        longest_pass = prefill_activation_bytes(config, options.idle_prefill_chunk, dtype)  # >= prefill_chunk
        tokens = auto_kv_tokens(options, share.bytes(1, per_page, 0, 0),
                                share.pending_bytes + share.bytes(0, 0, num_slots, per_slot), longest_pass)
    num_pages = pages_for(tokens)
    if num_pages < options.max_concurrency:
        raise ValueError(f"kv_capacity {tokens} tokens gives {num_pages} pages, fewer than "
                         f"max_concurrency {options.max_concurrency}")
    return PoolSizes(num_pages, num_slots, per_page, per_slot)


def parallel_layout(options: EngineOptions) -> ParallelLayout | None:
    """The mesh of a tensor-parallel engine; None on one device."""
    if options.tensor_parallel_size == 1:
        return None
    return ParallelLayout.over(options.tensor_parallel_size, options.enable_expert_parallel)


def parallel_init(options: EngineOptions):
    """`load_dummy`'s init: random weights made shard by shard on a tensor-parallel engine's mesh; else None."""
    layout = parallel_layout(options)
    return None if layout is None else layout.init_params


# The dense FP8 weights blocked for the Pallas kernels (`ops.kernel_layout`), in a model without routed experts: on
# an H100 (2026-12-07) the 27B's FP8 rounds take 0.93x the time at one lane and 0.97x at 64, every kernel's bits
# unchanged; the 35B-A3B's rounds gained nothing at 1 or 64 lanes and its GDN in-projection's kernel runs 0.73x at 8
# rows, so MoE models keep [N, K] (`scripts/ab_kernel_flags.py --variants 'base;layout=blocked'`,
# docs/kernels_notes.md).
BLOCK_FP8_WEIGHTS = True


def kernel_params(params: Params, options: EngineOptions, cfg: ModelConfig) -> Params:
    """params as the engine's kernels stream them fastest: with BLOCK_FP8_WEIGHTS, on the Pallas kernels, one device
    and a model without routed experts, the dense block-FP8 weights blocked (`ops.kernel_layout`; the arrays given
    are consumed). An engine takes either layout."""
    if (not BLOCK_FP8_WEIGHTS or options.kernels != "pallas" or options.tensor_parallel_size > 1
            or cfg.is_moe):
        return params
    start = time.perf_counter()
    params = ops.kernel_layout(params)
    count = sum(isinstance(w, QuantizedWeight) and w.blocked
                for w in jax.tree.leaves(params, is_leaf=lambda n: isinstance(n, QuantizedWeight)))
    if count:
        log.info("fp8 weights | %d blocked for the kernels | %.1f s", count, time.perf_counter() - start)
    return params


def kernel_config(options: EngineOptions) -> KernelConfig:
    """The kernel switch: with Pallas, the fused decode and prefill kernels are on (docs/benchmarks/kernels.md)."""
    fused = options.kernels == "pallas"
    return KernelConfig(options.kernels, options.interpret, PrefillConfig(impl=options.prefill_attention),
                        fuse_gdn_decode=fused, fuse_add_norm=fused, fuse_moe_route=fused, fuse_attn_qkv=fused,
                        fuse_gdn_conv=fused, fuse_gdn_out=fused, fuse_attn_out=fused, fuse_gdn_fp8_rows=fused,
                        fuse_attn_fp8_rows=fused, fuse_partial_sums=fused,
                        fp8_activations=options.fp8_activations == "dynamic")


class HostTierStart:
    """The Host tier being opened: its buffer allocated here (a budget the machine cannot hold fails the start
    before any compile) and, on a GPU, page-locked on a thread beside the warm-up, which `result()` waits for.
    Without a Host tier in the cache, `result()` is None."""

    def __init__(self, runner: ModelRunner, index: PrefixIndex):
        self.runner, self.slabs = runner, index.slabs
        self.buffer: HostSlabBuffer | None = None
        self._error: BaseException | None = None
        if not self.slabs.enabled:
            return
        runner.enable_host_transfers(self.slabs.slab_bytes, self.slabs.image_slabs)
        self.buffer = HostSlabBuffer(self.slabs, lock_now=False)
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._lock, name="ninfer-host-lock", daemon=True)
        self._thread.start()

    def _lock(self) -> None:
        try:
            self.buffer.lock()
        except BaseException as e:  # raised on the building thread by result()
            self._error = e
        self._seconds = time.perf_counter() - self._started

    def result(self) -> HostTier | None:
        """The Host tier, once page-locked. Raises HostTierError if locking failed."""
        if self.buffer is None:
            return None
        self._thread.join()
        if self._error is not None:
            raise self._error
        slabs = self.slabs
        log.info("host tier | %.0f MiB | %d slabs of %d KiB in %d chunk(s) | image %d slabs | %s",
                 self.buffer.nbytes / 2**20, slabs.num_slabs, slabs.slab_bytes >> 10, slabs.num_chunks,
                 slabs.image_slabs, f"page-locked in {self._seconds:.1f} s" if self.buffer.pinned
                 else "pageable (no GPU)")
        return HostTier(self.runner, self.buffer)

    def close(self) -> None:
        """Releases the buffer (a start that failed before `result()` handed it to the Host tier)."""
        if self.buffer is not None:
            self._thread.join()
            self.buffer.close()


@dataclasses.dataclass
class EngineParts:
    """What `build` starts: the device side, the cache, the scheduler over them, and the cache file."""

    runner: ModelRunner
    cache_manager: PrefixCacheManager
    scheduler: Scheduler
    cache_file: PrefixCacheFile | None
    cache_load: LoadReport | None  # the prefix cache file's load (§5.5), if one was read


def build(config: ModelConfig, params: Params, options: EngineOptions, *, stop_ids: frozenset[int],
          warmup: bool = True, weights_identity: dict | None = None, progress=None, vision=None,
          share: DeviceShare | None = None) -> EngineParts:
    """Starts every part of an engine on resolved `options`. Without `warmup` the model steps compile on first
    use; the small cache copies compile here. A failed start releases the Host tier's memory. progress(stage,
    done, total) hears of "restoring" and "compiling". vision: None, or (VisionConfig, VisionParams, (fewest, most)
    patches of one image). share: the params' `device_share` where the caller has it (None: computed here)."""
    o = options
    if o.prefix_cache_file is not None and weights_identity is None:
        raise OptionsError("prefix_cache_file needs the weights' identity to know a saved cache is theirs: "
                           "start the engine with Engine.from_pretrained (or pass weights_identity)")
    if o.speculative == "mtp" and params.mtp is None:
        raise OptionsError("speculative 'mtp' drafts with the checkpoint's MTP layer, and this checkpoint has none "
                           "(no mtp.* tensors); use 'ngram'")
    sizes = size_pools(config, o, share or device_share(config, params, o))
    runner = ModelRunner(config, params, kernel_config(o), num_pages=sizes.num_pages, num_slots=sizes.num_slots,
                         max_model_len=o.max_model_len, prefill_chunk=o.prefill_chunk, max_lanes=o.max_concurrency,
                         max_taps=o.max_new_taps, kv_dtype=kv_dtype(o), conv_dtype=kv_dtype(o),
                         batch_invariant=o.batch_invariant, idle_prefill_chunk=o.idle_prefill_chunk,
                         kv_profile=o.kv_dtype, speculative_tokens=o.num_speculative_tokens or 0,
                         stop_ids=stop_ids, mtp=o.speculative == "mtp", mixed_tokens=o.mixed_prefill_tokens,
                         layout=parallel_layout(o), prompt_logprobs=o.prompt_logprobs)
    if vision is not None:
        vcfg, vparams, patches = vision
        runner.enable_vision(vparams, vcfg, o.vision_cache_tokens, patches)
        log.info("vision tower | depth %d | hidden %d | encoder buckets %s patches | %d media rows (%.1f MiB)",
                 vcfg.depth, vcfg.hidden_size, runner.patch_buckets, o.vision_cache_tokens,
                 runner.media.nbytes / 2**20)
    log.info("engine options | %s", o.summary())
    if runner.layout is not None:
        experts = (" | experts split across them" if o.enable_expert_parallel
                   else " | each expert's columns split" if config.is_moe else "")
        log.info("tensor parallel | %d devices (mixers and FFNs per device under shard_map, reference kernels)%s",
                 runner.layout.size, experts)
    log.info("device pools | %d KV pages (%d tokens, %.1f MiB) | %d state slots (%d active + %d snapshot, %.1f MiB)",
             sizes.num_pages, sizes.num_pages * PAGE, sizes.num_pages * sizes.page_bytes / 2**20, sizes.num_slots,
             o.max_concurrency, o.device_snapshot_slots, sizes.state_bytes / 2**20)
    index = PrefixIndex(CacheGeometry(sizes.num_pages, sizes.page_bytes, sizes.slot_bytes), o.prefix_cache_options())
    host_start = HostTierStart(runner, index)  # allocated before any compile, page-locked beside the warm-up
    cache = cache_file = cache_load = None
    try:
        seconds = runner.warmup(progress, o.compile_threads, first=o.background_compile == "on") if warmup \
            else runner.warmup_copies()
        host = host_start.result()
        cache = PrefixCacheManager(index, host, runner, lanes=o.max_concurrency, enabled=not o.no_prefix_reuse,
                                   policy=o.cache_policy, prefill_chunk=o.prefill_chunk, max_taps=o.max_new_taps,
                                   coalesce=o.concurrent_prefill, backend_lag=int(o.speculative == "mtp"))
        log.info("prefix cache | %s | policy %s | device snapshot slots %d | max new taps %d | ladder %d | gap %d%s",
                 "on" if cache.enabled else "off (no_prefix_reuse)", o.cache_policy, o.device_snapshot_slots,
                 o.max_new_taps, o.tap_ladder_tokens, o.tap_min_gap_tokens,
                 " | host tier off (host_cache_mib 0): Device only" if cache.enabled and host is None else "")
        if o.prefix_cache_file is not None and host is not None:
            cache_file = PrefixCacheFile(o.prefix_cache_file, {
                "format": FORMAT, "weights": weights_identity, "config": dataclasses.asdict(config),
                "dtype": o.dtype, "kv_dtype": o.kv_dtype, "kernels": o.kernels,
                "prefill_attention": o.prefill_attention,
                "prefill_chunk": o.prefill_chunk, "idle_prefill_chunk": o.idle_prefill_chunk,
                "mtp_pages": o.speculative == "mtp",
                "source": source_identity()})
            if progress is not None:
                progress("restoring", 0, 1)
            cache_load = cache.load(cache_file)
            if progress is not None:
                progress("restoring", 1, 1)
    except BaseException:
        # The Host tier's memory (and its page-locking) goes with the failed start.
        if cache is not None:
            cache.close()
        else:
            host_start.close()
        raise
    log.info("compiled | %d programs | %.1f s", runner.compile_count(), seconds)
    scheduler = Scheduler(runner, o, cache, stop_ids)
    return EngineParts(runner, cache, scheduler, cache_file, cache_load)
