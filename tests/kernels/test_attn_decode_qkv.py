"""The fused attention decode step up to the attention kernel (`pallas_kernels/attn_decode_qkv.py`, interpret mode on
CPU) against the model's own composition (`qwen3_5._attn_split`, `rms_norm`, `rope`, `_write_kv`), and its Triton
lowering at the 35B-A3B's and the 27B's head shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import ops, qwen3_5, tiny
from kernel_support import INTERPRET, lower_for_h200
from pallas_kernels import attn_decode_qkv, kv_quant
from pallas_kernels.reference import PAGE

TINY = ModelConfig.from_dict(tiny.preset_config("tiny-moe"))  # 4 query heads, 2 KV heads of 64, rotary dim 16


def _cfg(hq, hkv, d, rot):
    return dataclasses.replace(TINY, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, rotary_dim=rot)


def _case(cfg, dtype, seed):
    rng = np.random.default_rng(seed)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lanes, pages = 3, 12
    proj = jnp.asarray(rng.standard_normal((lanes, hq * 2 * d + 2 * hkv * d)) * 2, dtype)
    q_norm, k_norm = (jnp.asarray(rng.standard_normal(d) * 0.2, dtype) for _ in range(2))
    positions = jnp.asarray([5, 64 * 3 + 63, 130], jnp.int32)  # a page's first half, its last row, another page
    tables = jnp.asarray(rng.permutation(pages)[: lanes * 4].reshape(lanes, 4), jnp.int32)
    active = jnp.asarray([True, True, False])
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((pages, PAGE, hkv, d)), dtype) for _ in range(2))
    return proj, q_norm, k_norm, positions, tables, active, k_pages, v_pages


# Each lane's MRoPE delta (an image earlier in its prompt): keys rotate there, and land at their KV position
ROPE_SHIFT = jnp.asarray([-40, 0, 11], jnp.int32)


def _composition(cfg, proj, q_norm, k_norm, positions, tables, active, k_pages, v_pages):
    return qwen3_5.attn_decode_qkv_composed(q_norm, k_norm, proj, positions, tables, active, k_pages, v_pages, cfg,
                                            positions + ROPE_SHIFT)


def _fused(cfg, proj, q_norm, k_norm, positions, tables, active, k_pages, v_pages):
    return attn_decode_qkv.attn_decode_qkv(
        proj, q_norm, k_norm, jnp.asarray(qwen3_5.rope_inv_freq(cfg)), positions, tables, active, k_pages, v_pages,
        positions + ROPE_SHIFT, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        rotary_dim=cfg.rotary_dim, eps=cfg.rms_norm_eps, interpret=INTERPRET)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 2, 64, 16), (16, 2, 256, 64), (6, 2, 96, 32)],
                         ids=["tiny", "35b-heads", "head-dim-96"])
def test_fused_step_equals_the_models_composition(shape, dtype):
    """q normalised and rotated as the model does; each active lane's key (normalised, rotated) and value land at its
    position's page row; an inactive lane writes nothing; every other pool row is untouched."""
    cfg = _cfg(*shape)
    args = _case(cfg, dtype, seed=sum(shape))
    want_q, want_k, want_v = _composition(cfg, *args)
    got_q, got_k, got_v = _fused(cfg, *args)
    assert got_q.shape == want_q.shape and got_q.dtype == dtype
    # float32: the same operations to rounding; bf16: cos / sin and the products may round once differently
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))  # values: copied
    k_before = np.asarray(args[6], np.float32)
    changed = np.argwhere((np.asarray(got_k, np.float32) != k_before).any(axis=(2, 3)))
    positions, tables = np.asarray(args[3]), np.asarray(args[4])
    written = {(int(tables[b, positions[b] // PAGE]), int(positions[b] % PAGE)) for b in (0, 1)}  # lane 2 inactive
    assert {tuple(map(int, rc)) for rc in changed} <= written


@pytest.mark.parametrize("profile", ["int8", "k8v4", "nvfp4"])  # K: INT8, FP8, NVFP4; V: INT8, NVFP4
def test_fused_step_writes_quantized_pools_as_the_composition_does(profile):
    """The written rows' values equal the composition's: V's planes bit for bit (the values are copied), K's within
    twice the format's rounding bound (the keys themselves agree to float32 rounding, which may move a code by a
    step); every other row is untouched."""
    cfg = _cfg(4, 2, 128, 32)  # two INT8 groups a row, eight NVFP4 ones
    proj, q_norm, k_norm, positions, tables, active, k_plain, v_plain = _case(cfg, jnp.float32, seed=5)
    pools = [kv_quant.QuantPages(*kv_quant.quantize(fmt, x), fmt.name)
             for fmt, x in zip(kv_quant.PROFILES[profile], (k_plain, v_plain))]
    args = (proj, q_norm, k_norm, positions, tables, active, *pools)
    want_q, want_k, want_v = _composition(cfg, *args)
    got_q, got_k, got_v = _fused(cfg, *args)
    np.testing.assert_allclose(np.asarray(got_q), np.asarray(want_q), rtol=1e-5, atol=1e-5)
    for plane_got, plane_want in zip(kv_quant.planes(got_v), kv_quant.planes(want_v)):
        np.testing.assert_array_equal(np.asarray(plane_got).view(np.uint8), np.asarray(plane_want).view(np.uint8))
    fmt, d = got_k.format, cfg.head_dim
    k_got, k_want = (np.asarray(kv_quant.take(k, jnp.arange(k.shape[0]))) for k in (got_k, want_k))
    step = np.repeat(np.asarray(want_k.scales.astype(jnp.float32)), fmt.group_of(d), axis=-1)
    bound = 2 * np.asarray(kv_quant.error_bound(fmt, jnp.asarray(k_want), jnp.asarray(step))) + 1e-5 * np.abs(k_want)
    assert np.all(np.abs(k_got - k_want) <= bound)
    written = np.zeros(k_got.shape[:2], bool)
    for b in (0, 1):  # lane 2 is inactive
        written[int(tables[b, positions[b] // PAGE]), int(positions[b] % PAGE)] = True
    for before, after in zip(kv_quant.planes(pools[0]), kv_quant.planes(got_k)):
        np.testing.assert_array_equal(np.asarray(after)[~written].view(np.uint8),
                                      np.asarray(before)[~written].view(np.uint8))


def test_model_decode_takes_it_only_when_asked_and_able():
    proj = jnp.zeros((2, TINY.num_attention_heads * 2 * TINY.head_dim + 2 * TINY.num_key_value_heads * TINY.head_dim))
    pools = jnp.zeros((4, PAGE, TINY.num_key_value_heads, TINY.head_dim))
    norm = jnp.zeros(TINY.head_dim)
    args = (proj, norm, norm, qwen3_5.rope_inv_freq(TINY), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.int32),
            jnp.ones(2, bool), pools, pools, TINY)
    on = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_attn_qkv=True)
    assert ops.attn_decode_qkv(on, *args) is not None
    assert ops.attn_decode_qkv(ops.KernelConfig("pallas", interpret=INTERPRET), *args) is None  # flag off
    odd = dataclasses.replace(TINY, rotary_dim=24)  # halves of 12: not one block
    assert ops.attn_decode_qkv(on, *args[:-1], odd) is None
    with pytest.raises(ValueError, match="fuse_attn_qkv"):
        ops.KernelConfig(fuse_attn_qkv=True)
    with pytest.raises(ValueError, match="query heads"):
        attn_decode_qkv.attn_decode_qkv(proj[:, :-1], *args[1:-1], num_heads=4, num_kv_heads=2, rotary_dim=16,
                                        eps=1e-6, interpret=True)


@pytest.mark.parametrize("hq, hkv, profile", [(16, 2, "bfloat16"), (24, 4, "bfloat16"), (24, 4, "int8"),
                                               (24, 4, "k8v4"), (24, 4, "nvfp4")],
                         ids=["35b-a3b", "27b", "27b-int8", "27b-k8v4", "27b-nvfp4"])
def test_lowers_to_triton_at_the_real_head_shapes(hq, hkv, profile):
    lower_for_h200()
    spec = jax.ShapeDtypeStruct
    d, rot, lanes = 256, 64, 1
    k_pool, v_pool = (jax.tree.map(lambda a: spec((1024, *a.shape[1:]), a.dtype),
                                   kv_quant.empty_pool(fmt, (1, PAGE, hkv, d), jnp.bfloat16))
                      for fmt in kv_quant.PROFILES[profile])
    text = attn_decode_qkv.attn_decode_qkv.trace(
        spec((lanes, hq * 2 * d + 2 * hkv * d), jnp.bfloat16), spec((d,), jnp.bfloat16), spec((d,), jnp.bfloat16),
        spec((rot // 2,), jnp.float32), spec((lanes,), jnp.int32), spec((lanes, 528), jnp.int32),
        spec((lanes,), jnp.bool_), k_pool, v_pool, num_heads=hq, num_kv_heads=hkv, rotary_dim=rot, eps=1e-6,
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "attn_decode_qkv" in text
