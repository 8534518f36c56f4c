"""EngineOptions.resolve: the kernels follow the device unless named, the prefill chunk follows the model unless
named, and conflicting or invalid options are refused."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("idle", [100, 1024, 8192.0])
def test_an_idle_prefill_chunk_below_prefill_chunk_or_off_the_64_grid_is_refused(idle):
    with pytest.raises(OptionsError, match="idle_prefill_chunk must be a multiple of 64 and at least prefill_chunk"):
        EngineOptions(prefill_chunk=2048, idle_prefill_chunk=idle).resolve(65536, "gpu", moe=True)


@pytest.mark.parametrize("chunk", [0, 100, -64, 64.0])
def test_a_prefill_chunk_that_is_not_a_positive_multiple_of_64_is_refused(chunk):
    with pytest.raises(OptionsError, match="prefill_chunk must be a positive multiple of 64"):
        EngineOptions(prefill_chunk=chunk).resolve(4096, "gpu")


def test_auto_kv_capacity_leaves_room_for_the_longest_prefill_pass(monkeypatch):
    """KV capacity "auto" reserves the longest pass's activation bound where it is above max(2 GiB, 5%): the
    35B-A3B's 32768-token idle pass on an 80 GiB GPU."""
    import jax
    import jax.numpy as jnp

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.state import prefill_activation_bytes
    from ninfer_jax.runtime import engine

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
    tokens = engine._auto_kv_tokens(options, page, 0, bound)
    assert tokens == (14 * gib - bound) // page * 64  # not 14 GiB less the 4 GiB (5%) floor
    assert engine._auto_kv_tokens(options, page, 0, 1 * gib) == 10 * gib // page * 64  # a small pass: the floor
