"""The prefix cache in the KV profiles' page layouts (spec §3.1, §11.2, §13.3) on the tiny model (fp32, 4 layers):
inside a profile, a resumed request (a Device tap, a Device endpoint with its tail, a Host-only restore, a persisted
file after a restart) and the §13.3 scenarios that write and read pages (multi-turn copy-on-write tails, a shared
preamble among concurrent sessions, identical prompts together, a cancelled prefill's published blocks) give the
tokens and first logprobs the same profile gives without reuse, and the pages' bytes move unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cache_support import assert_blocks_stored_once, assert_same_output, cancel_mid_prefill, tokens, with_hints
from cache_support import settle_host as settle

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.config import ModelConfig
from ninfer_jax.frontend.prepared_prompt import TapHintKind
from ninfer_jax.model.state import prefill_activation_bytes
from ninfer_jax.prefix_cache import HostSlabPool
from ninfer_jax.runtime import startup
from ninfer_jax.runtime.device.transfer import gather_pages, scatter_pages
from ninfer_jax.runtime.options import EngineOptions
from pallas_kernels import kv_quant

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
LONG = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, logprobs=5)
NO_REUSE = dataclasses.replace(GREEDY, prefix_cache=False)
SMALL = {"max_concurrency": 1, "prefill_chunk": 128, "max_model_len": 512, "output_window": 64,
         "kv_capacity": 16 * 64, "host_cache_mib": 4, "warmup": False}
# The page layouts the resumes and scenarios below run in, with their bytes. One attention layer of 2 KV heads of 64
# dims; per token and head, K + V: int8 2 x (64 + 2 B of one float16 scale, its group capped at 64); k8v4 the FP8 K
# (64 + 2) + the NVFP4 V (32 B of nibbles + 4 FP8 scales); nvfp4 2 x (32 + 4). Times 2 heads. fp8's pages at these
# heads are int8's layout (one float16 scale for the 64-value row; the two codecs are tests/kernels/test_kv_quant.py's);
# bfloat16 pages move as raw bytes as the activations' dtype's do, whose resumes and scenarios are the rest of
# tests/engine_cache/ (and bf16 pages move bit-exactly in test_host_tier.py). Every profile's page bytes:
# test_auto_capacity_and_the_host_slabs_take_the_profiles_page_bytes.
BYTES_PER_TOKEN = {"int8": 264, "k8v4": 204, "nvfp4": 144}


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41, num_hidden_layers=4,
                              full_attention_interval=4)


def same_as_without_reuse(engine, prompt, cached, source, host):
    resumed = engine.generate(prompt, GREEDY)
    record = engine.cache_record(resumed.request_id)
    assert resumed.usage.cached_tokens == cached and record["source"] == source
    assert (record["restored_host_bytes"] > 0) == host
    assert_same_output(resumed, engine.generate(prompt, NO_REUSE))


@pytest.mark.parametrize("profile", list(BYTES_PER_TOKEN))
def test_resumes_inside_a_profile_equal_its_runs_without_reuse(checkpoint, tmp_path, profile):
    path = tmp_path / "prefix.cache"
    engine = Engine.from_pretrained(checkpoint, kv_dtype=profile, prefix_cache_file=str(path), **SMALL)
    kv = engine.stats()["kv"]
    assert kv == {"dtype": profile, "bytes_per_token": BYTES_PER_TOKEN[profile], "capacity_tokens": 16 * 64}
    assert engine.cache_manager.index.slabs.slab_bytes == -(-64 * kv["bytes_per_token"] // 4096) * 4096
    prompt = tokens(300, 1)
    first = engine.generate(prompt, LONG)  # the prompt-tail tap at 256, the endpoint at 369 (a 49-token tail)
    edited = prompt[:280] + tokens(20, 2)
    same_as_without_reuse(engine, edited, 256, "tap", host=False)
    history = prompt + list(first.token_ids)
    same_as_without_reuse(engine, history + tokens(20, 3), 369, "endpoint", host=False)
    engine.demote_device_cache()
    same_as_without_reuse(engine, edited, 256, "tap", host=True)
    settle(engine, warmed=False)
    engine.stop()  # saves the Host tier

    restarted = Engine.from_pretrained(checkpoint, kv_dtype=profile, prefix_cache_file=str(path), **SMALL)
    assert restarted.stats()["prefix_cache"]["loaded"]["outcome"] == "restored"
    assert restarted._cache_file.fingerprint["kv_dtype"] == profile  # another profile's file is not used
    same_as_without_reuse(restarted, history + tokens(40, 4), 369, "endpoint", host=True)
    settle(restarted, warmed=False)
    restarted.stop()


WIDE = {"max_concurrency": 4, "prefill_chunk": 128, "max_model_len": 1024, "output_window": 64,
        "kv_capacity": 48 * 64, "host_cache_mib": 0, "max_new_taps": 4, "tap_ladder_tokens": 256,
        "tap_min_gap_tokens": 128, "device_snapshot_slots": 12, "warmup": False}


@pytest.mark.parametrize("profile", list(BYTES_PER_TOKEN))
def test_the_page_writing_scenarios_inside_a_profile_equal_its_runs_without_reuse(checkpoint, profile):
    engine = Engine.from_pretrained(checkpoint, kv_dtype=profile, **WIDE)

    def without_reuse(prompts):
        return engine.generate_many(prompts, NO_REUSE)

    # Multi-turn: each turn resumes the last endpoint; two continuations of one endpoint leave its tail page intact
    history, end = tokens(150, 5), 0
    for turn in range(2):
        out = engine.generate(history, LONG)
        assert out.usage.cached_tokens == end
        assert out.token_ids == engine.generate(history, dataclasses.replace(LONG, prefix_cache=False)).token_ids
        end = len(history) + len(out.token_ids) - 1
        history = history + list(out.token_ids) + tokens(30, 10 + turn)
    base = history[:end]
    continuations = [base + tokens(20, 20), base + tokens(20, 21), base + tokens(20, 20)]
    for out, ref in zip([engine.generate(c, GREEDY) for c in continuations], without_reuse(continuations)):
        assert out.usage.cached_tokens == end
        assert_same_output(out, ref)

    # A shared preamble among concurrent sessions is stored once; identical prompts arriving together agree
    preamble = tokens(256, 7)
    sessions = [with_hints(preamble + tokens(40 + 7 * i, 30 + i), (256, TapHintKind.END_OF_SYSTEM)) for i in range(4)]
    engine.generate(sessions[0], GREEDY)
    outs = engine.generate_many(sessions, GREEDY)
    assert all(o.usage.cached_tokens >= 256 for o in outs)
    for out, ref in zip(outs, without_reuse([s.token_ids.tolist() for s in sessions])):
        assert_same_output(out, ref)
    assert_blocks_stored_once(engine, preamble)
    same = tokens(333, 8)
    ref = without_reuse([same])[0]
    assert all(o.token_ids == ref.token_ids for o in engine.generate_many([same] * 4, GREEDY))

    # A prefill cancelled after its first chunk publishes that chunk's blocks, and a resume from them is exact
    prompt = tokens(600, 9)
    cancel_mid_prefill(engine, prompt, GREEDY)
    out = engine.generate(prompt, GREEDY)
    assert 128 <= out.usage.cached_tokens < 600
    assert_same_output(out, without_reuse([prompt])[0])
    settle(engine, warmed=False)
    engine.stop()


# spec §3.1: a 64-token page of the 27B (16 attention layers x 4 KV heads) in each profile, in KiB
PAGE_KIB_27B = {"bfloat16": 4096, "int8": 2112, "fp8": 2064, "k8v4": 1608, "nvfp4": 1152}


@pytest.mark.parametrize("profile", list(PAGE_KIB_27B))
def test_auto_capacity_and_the_host_slabs_take_the_profiles_page_bytes(monkeypatch, profile):
    """kv_capacity "auto" divides the free device memory by the profile's page bytes, and the Host tier's slab is a
    page of the profile (rounded to 4 KiB)."""
    cfg = ModelConfig.from_file("configs/qwen3.5-27b.json")
    gib = 2**30

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 140 * gib, "bytes_in_use": 60 * gib}

    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    options = EngineOptions(kv_dtype=profile, memory_fraction=1.0).resolve(65536, "gpu")
    sizes = startup.size_pools(cfg, options)
    assert sizes.page_bytes == PAGE_KIB_27B[profile] << 10
    reserve = max(2 * gib, int(0.05 * 140 * gib), prefill_activation_bytes(cfg, options.idle_prefill_chunk,
                                                                           jnp.bfloat16))
    free = 80 * gib - sizes.num_slots * sizes.slot_bytes - reserve
    assert sizes.num_pages == free // sizes.page_bytes
    slabs = HostSlabPool(8 * gib, sizes.page_bytes, sizes.slot_bytes)
    assert slabs.slab_bytes == sizes.page_bytes  # already 4 KiB multiples


def test_page_bundles_of_quantized_pools_round_trip_bit_exactly():
    """A bundle is each layer's K planes then V planes, page bytes as they lie (no requantisation); scattered into
    another page (an out-of-range one dropped) it gives back the same bytes in every plane."""
    rng = np.random.default_rng(3)

    def pool(fmt):
        values, scales = kv_quant.quantize(fmt, jnp.asarray(rng.standard_normal((5, 64, 2, 64)), jnp.float32))
        return kv_quant.QuantPages(values, scales, fmt.name)

    k_pages = (pool(kv_quant.INT8_G64), pool(kv_quant.FP8_ROW256))
    v_pages = (pool(kv_quant.INT8_G64), pool(kv_quant.NVFP4_G16))
    gathered = np.asarray(gather_pages(k_pages, v_pages, jnp.asarray([1, 4])))
    planes = [plane for k, v in zip(k_pages, v_pages) for plane in kv_quant.planes(k) + kv_quant.planes(v)]
    expect = [np.asarray(plane[p]).view(np.uint8).reshape(-1) for p in (1, 4) for plane in planes]
    np.testing.assert_array_equal(gathered.view(np.uint8).reshape(-1), np.concatenate(expect))
    rows = np.zeros((2, gathered.shape[1] + 32), np.uint32)  # slab padding after the bundle
    rows[:, :gathered.shape[1]] = gathered
    moved_k, moved_v = scatter_pages(k_pages, v_pages, jnp.asarray([2, 5]), jnp.asarray(rows))
    moved = [plane for k, v in zip(moved_k, moved_v) for plane in kv_quant.planes(k) + kv_quant.planes(v)]
    for before, after in zip(planes, moved):
        np.testing.assert_array_equal(np.asarray(after[2]).view(np.uint8), np.asarray(before[1]).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(after[3:]).view(np.uint8), np.asarray(before[3:]).view(np.uint8))
