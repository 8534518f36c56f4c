"""EngineOptions.resolve: the kernels follow the device unless named, the prefill chunk follows the model unless
named, the prefix cache's values follow the spec's rules, and conflicting or invalid options are refused."""

from __future__ import annotations

import itertools
import re

import pytest

from ninfer_jax.prefix_cache import PrefixCacheOptions
from ninfer_jax.runtime.options import EngineOptions, OptionsError


def test_auto_kernels_are_pallas_on_a_gpu_and_the_references_elsewhere():
    assert EngineOptions().resolve(4096, "gpu").kernels == "pallas"
    assert EngineOptions().resolve(4096, "cpu").kernels == "reference"
    assert EngineOptions(kernels="reference").resolve(4096, "gpu").kernels == "reference"
    assert EngineOptions(kernels="pallas", interpret=True).resolve(4096, "cpu").kernels == "pallas"


def test_cudnn_prefill_attention_is_accepted_on_a_gpu_with_the_pallas_kernels():
    resolved = EngineOptions(prefill_attention="cudnn").resolve(4096, "gpu")
    assert (resolved.kernels, resolved.prefill_attention) == ("pallas", "cudnn")


def test_auto_prefill_attention_is_cudnn_only_where_cudnn_can_run():
    assert EngineOptions().resolve(4096, "gpu").prefill_attention == "cudnn"
    assert EngineOptions().resolve(4096, "cpu").prefill_attention == "pallas"
    assert EngineOptions(kernels="reference").resolve(4096, "gpu").prefill_attention == "pallas"
    assert EngineOptions(dtype="float32").resolve(4096, "gpu").prefill_attention == "pallas"
    assert EngineOptions(kernels="pallas", interpret=True).resolve(4096, "cpu").prefill_attention == "pallas"
    assert EngineOptions(prefill_attention="pallas").resolve(4096, "gpu").prefill_attention == "pallas"
    # measured faster on a Hopper only: other GPUs keep the Pallas kernel unless told
    assert EngineOptions().resolve(4096, "gpu", hopper=True).prefill_attention == "cudnn"
    assert EngineOptions().resolve(4096, "gpu", hopper=False).prefill_attention == "pallas"
    assert EngineOptions(prefill_attention="cudnn").resolve(4096, "gpu", hopper=False).prefill_attention == "cudnn"


@pytest.mark.parametrize("options, backend, message", [
    (dict(prefill_attention="cudnn"), "cpu", "needs a GPU"),
    (dict(prefill_attention="cudnn", dtype="float32"), "gpu", "conflicts with dtype 'float32'"),
    (dict(prefill_attention="cudnn", kernels="reference"), "gpu", "conflicts with kernels 'reference'"),
    (dict(prefill_attention="cudnn", kernels="pallas", interpret=True), "cpu", "conflicts with interpret"),
    (dict(prefill_attention="flash"), "gpu", "prefill_attention must be"),
    (dict(kernels="triton"), "gpu", "kernels must be"),
])
def test_conflicting_kernel_options_are_refused_by_name(options, backend, message):
    with pytest.raises(OptionsError, match=message):
        EngineOptions(**options).resolve(4096, backend)


def test_the_default_prefill_chunk_is_longer_for_a_model_with_routed_experts():
    dense, moe = EngineOptions().resolve(65536, "gpu"), EngineOptions().resolve(65536, "gpu", moe=True)
    assert (dense.prefill_chunk, moe.prefill_chunk) == (2048, 8192)
    # the tap ladder follows the resolved chunk (spec §14.2: max(4096, 2 chunk), gap max(1024, chunk))
    assert (dense.tap_ladder_tokens, dense.tap_min_gap_tokens) == (4096, 2048)
    assert (moe.tap_ladder_tokens, moe.tap_min_gap_tokens) == (16384, 8192)
    # a named chunk wins, and no chunk outgrows the context
    assert EngineOptions(prefill_chunk=1024).resolve(65536, "gpu", moe=True).prefill_chunk == 1024
    assert EngineOptions(max_model_len=3000).resolve(65536, "gpu", moe=True).prefill_chunk == 3008


def test_the_idle_prefill_chunk_is_longer_for_a_model_with_routed_experts_only():
    dense, moe = EngineOptions().resolve(65536, "gpu"), EngineOptions().resolve(65536, "gpu", moe=True)
    assert (dense.idle_prefill_chunk, moe.idle_prefill_chunk) == (2048, 32768)  # dense: no longer passes
    # a named one wins (also for a dense model); none outgrows the context or falls below a named prefill_chunk
    assert EngineOptions(idle_prefill_chunk=8192).resolve(65536, "gpu").idle_prefill_chunk == 8192
    assert EngineOptions(max_model_len=20000).resolve(65536, "gpu", moe=True).idle_prefill_chunk == 20032
    assert EngineOptions(prefill_chunk=65536, max_model_len=65536).resolve(
        65536, "gpu", moe=True).idle_prefill_chunk == 65536


@pytest.mark.parametrize("idle, message", [
    (100, "idle_prefill_chunk must be a positive multiple of 64, got 100"),
    (8192.0, "idle_prefill_chunk must be a positive multiple of 64, got 8192.0"),
    (1024, r"idle_prefill_chunk must be at least prefill_chunk \(2048\), got 1024"),
])
def test_an_idle_prefill_chunk_below_prefill_chunk_or_off_the_64_grid_is_refused(idle, message):
    with pytest.raises(OptionsError, match=message):
        EngineOptions(prefill_chunk=2048, idle_prefill_chunk=idle).resolve(65536, "gpu", moe=True)


def test_an_idle_prefill_chunk_below_a_derived_prefill_chunk_is_refused_for_that_model_only():
    options = EngineOptions(idle_prefill_chunk=4096)
    assert options.resolve(65536, "gpu").idle_prefill_chunk == 4096  # dense: the chunk is 2048
    with pytest.raises(OptionsError, match=r"at least prefill_chunk \(8192\), got 4096"):
        options.resolve(65536, "gpu", moe=True)
    options.check_conflicts()  # the model is not known yet: not refused


@pytest.mark.parametrize("chunk", [0, 100, -64, 64.0])
def test_a_prefill_chunk_that_is_not_a_positive_multiple_of_64_is_refused(chunk):
    with pytest.raises(OptionsError, match="prefill_chunk must be a positive multiple of 64"):
        EngineOptions(prefill_chunk=chunk).resolve(4096, "gpu")


@pytest.mark.parametrize("options, message", [
    (dict(max_concurrency=0), "max_concurrency must be 'auto' or in 1..256, got 0"),
    (dict(max_concurrency=257), "max_concurrency must be 'auto' or in 1..256, got 257"),
    (dict(dtype="auto"), "dtype must be 'bfloat16' or 'float32', got 'auto'"),
    (dict(kv_capacity=0), "kv_capacity must be 'auto' or a positive integer, got 0"),
    (dict(kv_capacity="all"), "kv_capacity must be 'auto' or a positive integer, got 'all'"),
    (dict(host_cache_mib=-1), "host_cache_mib must be 'auto' or >= 0, got -1"),
    (dict(memory_fraction=0), "memory_fraction must be in (0, 1], got 0"),
    (dict(memory_fraction=1.5), "memory_fraction must be in (0, 1], got 1.5"),
    (dict(output_window=0), "output_window must be a positive integer, got 0"),
    (dict(max_model_len=1), "max_model_len must be >= 2, got 1"),
    (dict(max_model_len=8192), "max_model_len must be in 2..4096, got 8192"),
    (dict(device_snapshot_slots=0), "device_snapshot_slots must be a positive integer, got 0"),
    (dict(max_new_taps=-1), "max_new_taps must be >= 0, got -1"),
    (dict(seed=-1), "seed must be >= 0, got -1"),
    (dict(tap_ladder_tokens=32), "tap_ladder_tokens must be >= 64, got 32"),
    (dict(tap_ladder_tokens=1024, tap_min_gap_tokens=2048),
     "tap_min_gap_tokens (2048) must not exceed tap_ladder_tokens (1024)"),
    (dict(cache_policy="lru"), "cache_policy must be 'hpc' or 'align', got 'lru'"),
    (dict(batch_invariant=1), "batch_invariant must be True or False, got 1"),
    (dict(no_prefix_reuse=True, host_cache_mib=64, max_new_taps=2),
     "no_prefix_reuse conflicts with host_cache_mib, max_new_taps: there is no prefix cache to configure"),
    (dict(no_prefix_reuse=True, cache_policy="align"), "no_prefix_reuse conflicts with cache_policy"),
    (dict(prefix_cache_file="x.cache", host_cache_mib=0),
     "prefix_cache_file needs a Host tier; it conflicts with host_cache_mib 0"),
])
def test_invalid_and_conflicting_options_are_refused_by_name(options, message):
    with pytest.raises(OptionsError, match=re.escape(message)):
        EngineOptions(**options).resolve(4096, "gpu")


def test_a_prefix_cache_file_must_name_a_file_in_an_existing_folder(tmp_path):
    with pytest.raises(OptionsError, match=f"prefix_cache_file {tmp_path} is a directory"):
        EngineOptions(prefix_cache_file=str(tmp_path)).resolve(4096)
    with pytest.raises(OptionsError, match=f"the directory {tmp_path / 'no'} does not exist"):
        EngineOptions(prefix_cache_file=str(tmp_path / "no" / "x.cache")).resolve(4096)
    assert EngineOptions(prefix_cache_file=str(tmp_path / "x.cache")).resolve(4096).prefix_cache_file == \
        str(tmp_path / "x.cache")


def test_max_concurrency_takes_1_to_256_or_auto():
    accepted = []
    for c in range(-1, 260):
        try:
            accepted.append(EngineOptions(max_concurrency=c).resolve(4096).max_concurrency)
        except OptionsError:
            pass
    assert accepted == list(range(1, 257))
    assert EngineOptions().resolve(4096).max_concurrency == 4  # auto on a CPU
    assert EngineOptions().resolve(4096, "gpu", auto_lanes=200).device_snapshot_slots == 201  # C + 1


def test_auto_host_cache_takes_a_quarter_of_the_available_memory_at_most_64_gib():
    gib = 2**30
    assert EngineOptions().resolve(4096, available_memory=20 * gib).host_cache_mib == 5 << 10
    assert EngineOptions().resolve(4096, available_memory=2048 * gib).host_cache_mib == 64 << 10
    assert EngineOptions().resolve(4096).host_cache_mib == 8 << 10  # the machine does not say
    assert EngineOptions(host_cache_mib=0).resolve(4096, available_memory=20 * gib).host_cache_mib == 0
    resolved = EngineOptions(host_cache_mib=0, max_concurrency=3).resolve(4096, available_memory=20 * gib)
    assert resolved.prefix_cache_options().host_cache_bytes == 0 and resolved.device_snapshot_slots == 5
    assert EngineOptions(host_cache_mib=100).resolve(4096, available_memory=20 * gib).host_cache_mib == 100


def test_auto_compile_threads_are_the_usable_cores_at_most_8():
    assert [EngineOptions().resolve(4096, cpu_cores=n).compile_threads for n in (None, 1, 2, 16)] == [1, 1, 2, 8]
    assert EngineOptions(compile_threads=12).resolve(4096, cpu_cores=2).compile_threads == 12


def test_the_prefix_cache_values_follow_the_host_tier_and_the_chunk():
    dense = EngineOptions(max_concurrency=3).resolve(65536, "gpu")
    assert (dense.device_snapshot_slots, dense.max_new_taps, dense.tap_ladder_tokens, dense.tap_min_gap_tokens) \
        == (4, 8, 4096, 2048)  # C + 1, 8, max(4096, 2 chunk), max(1024, chunk)
    off = EngineOptions(max_concurrency=3, no_prefix_reuse=True).resolve(65536, "gpu")
    assert (off.device_snapshot_slots, off.max_new_taps) == (1, 2)  # nothing is snapshotted without the cache
    given = EngineOptions(device_snapshot_slots=9, max_new_taps=0, tap_ladder_tokens=8192,
                          tap_min_gap_tokens=64).resolve(65536, "gpu", moe=True)
    assert (given.device_snapshot_slots, given.max_new_taps, given.tap_ladder_tokens, given.tap_min_gap_tokens) \
        == (9, 0, 8192, 64)


def test_prefix_cache_options_are_the_resolved_values_as_the_index_takes_them():
    resolved = EngineOptions(max_concurrency=3, host_cache_mib=1024).resolve(65536, "gpu", moe=True)
    assert resolved.prefix_cache_options() == PrefixCacheOptions(
        host_cache_bytes=1 << 30, device_snapshot_slots=4, max_new_taps=8, tap_ladder_tokens=16384,
        tap_min_gap_tokens=8192)
    off = EngineOptions(max_concurrency=3, no_prefix_reuse=True).resolve(65536, "gpu")
    assert off.prefix_cache_options() == PrefixCacheOptions(
        host_cache_bytes=0, device_snapshot_slots=1, max_new_taps=2, tap_ladder_tokens=4096, tap_min_gap_tokens=2048)
    with pytest.raises(OptionsError, match=r"call resolve\(\) first"):
        EngineOptions().prefix_cache_options()
    # a ladder given alone that the model's derived gap outgrows is the index's to refuse, by name
    with pytest.raises(OptionsError, match=r"tap_min_gap_tokens \(8192\) must not exceed tap_ladder_tokens \(4096\)"):
        EngineOptions(tap_ladder_tokens=4096).resolve(65536, "gpu", moe=True).prefix_cache_options()


@pytest.mark.parametrize("lanes, host_mib, moe, chunk", itertools.product((1, 8, 64), (0, 64, 8192), (False, True),
                                                                          (None, 512, 16384)))
def test_the_engine_and_the_index_derive_the_same_defaults(lanes, host_mib, moe, chunk):
    resolved = EngineOptions(max_concurrency=lanes, host_cache_mib=host_mib, prefill_chunk=chunk).resolve(
        65536, "gpu", moe=moe)
    assert resolved.prefix_cache_options() == PrefixCacheOptions.resolve(lanes, resolved.prefill_chunk,
                                                                          host_mib << 20)


def test_auto_kv_capacity_leaves_room_for_the_longest_prefill_pass(monkeypatch):
    """KV capacity "auto" reserves the longest pass's activation bound where it is above max(2 GiB, 5%): the
    35B-A3B's 32768-token idle pass on an 80 GiB GPU."""
    import jax
    import jax.numpy as jnp

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.state import prefill_activation_bytes
    from ninfer_jax.runtime import startup

    cfg = ModelConfig.from_file("configs/qwen3.5-35b-a3b.json")
    bound = prefill_activation_bytes(cfg, 32768, jnp.bfloat16)
    # it covers the pass's largest single activation, the routed rows' float32 outputs [T, top-k, H]
    assert bound >= 32768 * cfg.num_experts_per_tok * cfg.hidden_size * 4
    assert bound == 4 * prefill_activation_bytes(cfg, 8192, jnp.bfloat16)
    gib = 2**30

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 80 * gib, "bytes_in_use": 66 * gib}

    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    options = EngineOptions(memory_fraction=1.0).resolve(65536, "gpu", moe=True)
    page = 1 << 20
    tokens = startup.auto_kv_tokens(options, page, 0, bound)
    assert tokens == (14 * gib - bound) // page * 64  # not 14 GiB less the 4 GiB (5%) floor
    assert startup.auto_kv_tokens(options, page, 0, 1 * gib) == 10 * gib // page * 64  # a small pass: the floor


def test_auto_max_concurrency_takes_the_most_lanes_whose_slots_and_kv_fit_the_gpu(monkeypatch):
    """On a GPU, max_concurrency auto is the most lanes (at most 256) whose C + D state slots and 8192 KV tokens
    each fit what the weights leave; the pools then sized hold them. The 35B-A3B's shapes on an H200's memory."""
    import jax
    import jax.numpy as jnp

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.state import PAGE, page_bytes, prefill_activation_bytes, slot_bytes
    from ninfer_jax.runtime import startup

    cfg = ModelConfig.from_file("configs/qwen3.5-35b-a3b.json")
    gib = 2**30
    in_use = {"bytes": 0}

    class Device:
        platform, compute_capability = "gpu", "9.0"

        def memory_stats(self):
            return {"bytes_limit": 140 * gib, "bytes_in_use": in_use["bytes"]}

    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    slot, page = slot_bytes(cfg, jnp.bfloat16), page_bytes(cfg, jnp.bfloat16)
    reserve = max(7 * gib, prefill_activation_bytes(cfg, 32768, jnp.bfloat16))  # 5% of 140 GiB, or the pass

    def fits(lanes):  # the rule in words: 2C + 1 slots (a Host tier) and C x 8192 tokens within 90% of the rest
        budget = int((140 * gib - in_use["bytes"] - reserve) * 0.9)
        return (2 * lanes + 1) * slot + lanes * 8192 // PAGE * page <= budget

    in_use["bytes"] = 67 * gib  # the bf16 weights
    lanes = startup.resolve_options(EngineOptions(), cfg).max_concurrency
    assert fits(lanes) and not fits(lanes + 1) and 16 < lanes < 256
    resolved = startup.resolve_options(EngineOptions(), cfg)
    sizes = startup.size_pools(cfg, resolved)
    assert sizes.num_slots == 2 * lanes + 1 and sizes.num_pages * PAGE >= lanes * 8192
    in_use["bytes"] = 35 * gib  # FP8 weights: more lanes, still at most 256
    assert startup.resolve_options(EngineOptions(), cfg).max_concurrency == min(256, max(
        c for c in range(1, 300) if fits(c)))
    assert startup.resolve_options(EngineOptions(max_concurrency=8), cfg).max_concurrency == 8  # given: kept


def test_a_mesh_sizes_its_pools_by_one_devices_share_and_the_weights_still_to_come(monkeypatch):
    # Tensor parallel: each device holds 1 / N of a split page and slot, and host-loaded weights take their share
    # of the device after the pools are sized, so the budget leaves room for them.
    import jax
    import jax.numpy as jnp

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.state import PAGE, page_bytes, prefill_activation_bytes, slot_bytes
    from ninfer_jax.runtime import startup

    cfg = ModelConfig.from_file("configs/qwen3.5-27b.json")
    gib = 2**30

    class Device:
        platform, compute_capability = "gpu", "9.0"

        def memory_stats(self):
            return {"bytes_limit": 140 * gib, "bytes_in_use": 20 * gib}

    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = startup.resolve_options(EngineOptions(max_concurrency=8), cfg)
    slot, page = slot_bytes(cfg, jnp.bfloat16), page_bytes(cfg, jnp.bfloat16)
    reserve = max(7 * gib, prefill_activation_bytes(cfg, options.idle_prefill_chunk, jnp.bfloat16))
    slots = options.max_concurrency + options.device_snapshot_slots

    def pages(share, pending):  # the rule: the budget after the pending weights and the slots' share, in pages
        budget = int((140 * gib - 20 * gib - pending - int(slots * slot * share) - reserve) * 0.9)
        return budget // int(page * share) * PAGE // PAGE

    alone = startup.size_pools(cfg, options)
    halves = startup.size_pools(cfg, options, startup.DeviceShare(0.5, 0.5, 0))
    pending = startup.size_pools(cfg, options, startup.DeviceShare(0.5, 0.5, 25 * gib))
    assert alone.num_pages == pages(1.0, 0) and halves.num_pages == pages(0.5, 0)
    assert pending.num_pages == pages(0.5, 25 * gib) < halves.num_pages < 2.2 * alone.num_pages
    assert halves.page_bytes == alone.page_bytes == page  # a page's bytes stay the whole page's (the Host slab's)
