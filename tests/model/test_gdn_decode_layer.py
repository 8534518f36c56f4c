"""The fused GDN decode kernel (`pallas_kernels/gdn_decode_layer.py`, interpret mode) equals the model's unfused
decode step on the same inputs: layer output, state slots and conv histories, active and inactive lanes; and it
lowers to Triton at the real shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import ops, qwen3_5
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import ConcatWeight
from ninfer_jax.model.random_init import random_params
from kernel_support import INTERPRET, lower_for_h200
from pallas_kernels.gdn_decode import program_blocks
from pallas_kernels.fp8_matmul import quantize_rows
from pallas_kernels.gdn_decode_layer import GdnDecodeLayerConfig, gdn_decode_layer, gdn_rows_layer

UNFUSED = KernelConfig("pallas", interpret=True)
FUSED = dataclasses.replace(UNFUSED, fuse_gdn_decode=True)


def _layer_inputs(cfg, dtype, lanes, seed):
    params = random_params(cfg, seed=seed, dtype=dtype)
    layer = params.layers[cfg.gdn_layers[0]].mixer
    rng = np.random.default_rng(seed)
    slots_total = lanes + 3
    x = jnp.asarray(rng.standard_normal((lanes, cfg.hidden_size)), dtype)
    ssm = jnp.asarray(rng.standard_normal((slots_total, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                           cfg.linear_value_head_dim)) * 0.3, jnp.float32)
    conv = jnp.asarray(rng.standard_normal((slots_total, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)), dtype)
    slots = jnp.asarray(rng.permutation(slots_total)[:lanes], jnp.int32)
    active = jnp.asarray(np.arange(lanes) % 3 != 1)  # lane 1 (and every third after it) sits out
    return layer, x, ssm, conv, dict(slots=slots, active=active)


# Each lane count, config and dtype twice, each pair of them once.
@pytest.mark.parametrize("lanes,config,dtype", [(1, "tiny-moe", jnp.float32), (1, "tiny-dense", jnp.bfloat16),
                                                (3, "tiny-moe", jnp.bfloat16), (3, "tiny-dense", jnp.float32)],
                         ids=["1-tiny-moe-f32", "1-tiny-dense-bf16", "3-tiny-moe-bf16", "3-tiny-dense-f32"])
def test_fused_gdn_decode_equals_the_unfused_step(config, dtype, lanes):
    cfg = ModelConfig.from_file(f"configs/{config}.json")
    layer, x, ssm, conv, ctx = _layer_inputs(cfg, dtype, lanes, seed=lanes)
    step = jax.jit(qwen3_5.gdn_decode_mixer, static_argnames=("cfg", "kc"))
    want_y, want_ssm, want_conv = step(layer, x, cfg, UNFUSED, ssm, conv, ctx)
    got_y, got_ssm, got_conv = step(layer, x, cfg, FUSED, ssm, conv, ctx)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got_y, np.float32), np.asarray(want_y, np.float32), **tol)
    # The state's inputs are rounded to bf16 alike on a CPU; on a GPU XLA's fusions of the unfused step (and of the
    # interpreted kernel) keep some of them in float32, so there the state holds only to those roundings.
    np.testing.assert_allclose(np.asarray(got_ssm), np.asarray(want_ssm), **(dict(rtol=1e-5, atol=1e-5)
                                                                             if INTERPRET else tol))
    # Conv histories are copies of inputs: equal to the bit.
    np.testing.assert_array_equal(np.asarray(got_conv, np.float32), np.asarray(want_conv, np.float32))
    # Inactive lanes' slots and every slot no lane holds are untouched.
    held = {int(s) for s, a in zip(ctx["slots"], ctx["active"]) if a}
    for slot in range(ssm.shape[0]):
        if slot not in held:
            np.testing.assert_array_equal(np.asarray(got_ssm[slot]), np.asarray(ssm[slot]))
            np.testing.assert_array_equal(np.asarray(got_conv[slot]), np.asarray(conv[slot]))
    assert len(held) < ssm.shape[0] and any(not a for a in np.asarray(ctx["active"])) == (lanes > 1)


def test_b_and_a_apart_equal_the_joined_projection():
    """An FP8 checkpoint's GDN in-projection is two products ([qkv | z] FP8, [b | a] not, a ConcatWeight): the
    decode takes them apart, never joined, and the kernel gives what it gives on the joined rows, bit for bit; the
    fused step equals the unfused one (the composition, reading the sides apart too)."""
    cfg = ModelConfig.from_file("configs/tiny-moe.json")
    layer, x, ssm, conv, ctx = _layer_inputs(cfg, jnp.bfloat16, 3, seed=5)
    at = cfg.conv_dim + cfg.value_dim
    assert not isinstance(qwen3_5._gdn_in_dot(cfg)(FUSED, x, layer.in_proj), tuple)  # one weight, one product
    layer = layer.replace(in_proj=ConcatWeight((layer.in_proj[:, :at], layer.in_proj[:, at:])))
    parts = qwen3_5._gdn_in_dot(cfg)(FUSED, x, layer.in_proj)
    assert isinstance(parts, tuple) and parts[1].shape == (3, 2 * cfg.linear_num_value_heads)
    args = (ctx["active"], conv, layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w)
    kw = dict(num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, interpret=True)
    joined = gdn_decode_layer(jnp.concatenate(parts, axis=-1), *args, jnp.copy(ssm), ctx["slots"], **kw)
    apart = gdn_decode_layer(parts[0], *args, jnp.copy(ssm), ctx["slots"], **kw, gates=parts[1])
    for a, b in zip(apart, joined):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    step = jax.jit(qwen3_5.gdn_decode_mixer, static_argnames=("cfg", "kc"))
    want, got = (step(layer, x, cfg, kc, ssm, conv, ctx) for kc in (UNFUSED, FUSED))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gates"):
        gdn_decode_layer(parts[0], *args, ssm, ctx["slots"], **kw, gates=parts[1][:, :-1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_heads_split_over_programs_equal_whole_heads(dtype):
    """A head's Dv columns over several programs (the norm then after the kernel) give what one program per head
    gives (the norm inside it): same state, same histories, outputs to rounding."""
    cfg = ModelConfig.from_file("configs/tiny-moe.json")
    lanes = 3
    layer, x, ssm, conv, ctx = _layer_inputs(cfg, dtype, lanes, seed=7)
    proj = qwen3_5.dot(KernelConfig(), x, layer.in_proj)
    args = (proj, ctx["active"], conv, layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w, ssm, ctx["slots"])
    kw = dict(num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, interpret=True)
    whole = gdn_decode_layer(*args, **kw, config=GdnDecodeLayerConfig(min_programs=0))
    split = gdn_decode_layer(*args, **kw, config=GdnDecodeLayerConfig(min_programs=10**6))
    assert program_blocks(lanes * cfg.linear_num_value_heads, cfg.linear_value_head_dim, 128, 10**6) == 16
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(split[0], np.float32), np.asarray(whole[0], np.float32), **tol)
    np.testing.assert_allclose(np.asarray(split[1]), np.asarray(whole[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(split[2], np.float32), np.asarray(whole[2], np.float32))


@pytest.mark.parametrize("min_programs, rows", [(0, 1), (10**6, 3)], ids=["one-row-whole-heads",
                                                                          "three-rows-column-blocks"])
def test_heads_of_a_key_head_in_one_program_equal_one_head_a_program(min_programs, rows):
    """A key head's value heads in turn in one program (its q, k conv once; wide rounds) give what one program per
    value head gives, bit for bit: one row a lane with whole heads a program (the norm inside), three rows a lane in
    the commit form with column blocks (the norm after it)."""
    cfg = ModelConfig.from_file("configs/tiny-moe.json")
    group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    layer, x, ssm, conv, ctx = _layer_inputs(cfg, jnp.bfloat16, 3, seed=11)
    proj = qwen3_5.dot(KernelConfig(), x, layer.in_proj)
    args = (conv, layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w)
    kw = dict(num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, interpret=True)
    one, grouped = (GdnDecodeLayerConfig(num_warps=4, min_programs=min_programs, heads_per_program=hp)
                    for hp in (1, group))
    if rows == 1:
        outs = [gdn_decode_layer(proj, ctx["active"], *args, jnp.copy(ssm), ctx["slots"], **kw, config=c)
                for c in (one, grouped)]
    else:
        rows3 = jnp.stack([proj, proj[::-1], proj * 0.5], axis=1)
        counts = jnp.asarray([3, 0, 2], jnp.int32)
        outs = [gdn_rows_layer(rows3, counts, *args, jnp.copy(ssm), ctx["slots"], write_state=True, **kw, config=c)
                for c in (one, grouped)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("write_state", [False, True], ids=["verify", "commit"])
def test_fused_rows_equal_the_composed_rows(write_state):
    """T = 3 rows a lane (a verify round and its commit), lanes counting 3, 0 and 2 rows: the kernel's outputs of
    the counted rows, the conv histories after them, and (commit) the state slots equal `gdn_rows_composed`; a
    verify round leaves the pool as it was."""
    cfg = ModelConfig.from_file("configs/tiny-dense.json")
    layer, _, ssm, conv, ctx = _layer_inputs(cfg, jnp.float32, 3, seed=5)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((9, cfg.hidden_size)), jnp.float32)
    proj = qwen3_5.dot(KernelConfig(), x, layer.in_proj).reshape(3, 3, -1)
    rows, slots = jnp.asarray([3, 0, 2], jnp.int32), ctx["slots"]
    o, states, z, history = qwen3_5.gdn_rows_composed(layer, proj, cfg, UNFUSED, conv, ssm[slots], slots, rows)
    want_y = qwen3_5.gated_rms_norm(o, z.reshape(o.shape), layer.norm_w, cfg.rms_norm_eps)
    got = ops.gdn_rows_layer(FUSED, proj, rows, conv, layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w,
                             jnp.copy(ssm), slots, num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps,
                             write_state=write_state)
    counted = np.arange(3)[None, :] < np.asarray(rows)[:, None]
    np.testing.assert_allclose(np.asarray(got[0])[counted], np.asarray(want_y)[counted], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(history))
    np.testing.assert_array_equal(np.asarray(history[1]), np.asarray(conv[slots[1]]))  # 0 rows: history kept
    assert len(got) == 2 + write_state
    if write_state:
        want = np.asarray(ssm).copy()
        want[np.asarray(slots)] = np.asarray(states)
        np.testing.assert_allclose(np.asarray(got[2]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3], ids=["decode", "commit"])
def test_a_key_heads_program_writes_its_histories_into_the_pool(rows):
    """history_in_place with a key head's value heads in one program: the kernel writes the lanes' new histories
    into the pool itself, which then equals the pool with the returned histories scattered in (one head a program),
    bit for bit, as do the outputs and the state; the slots no lane holds keep theirs. A round that only reads the
    state (a verify round) cannot ask for the pool."""
    cfg = ModelConfig.from_file("configs/tiny-moe.json")
    layer, x, ssm, conv, ctx = _layer_inputs(cfg, jnp.bfloat16, 3, seed=19)
    proj = qwen3_5.dot(KernelConfig(), x, layer.in_proj)
    proj = jnp.stack([proj, proj[::-1], proj * 0.5][:rows], axis=1)
    counts = jnp.asarray([rows, 0, min(2, rows)], jnp.int32)
    args = (layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w)
    kw = dict(num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, interpret=INTERPRET, write_state=True)
    in_place = GdnDecodeLayerConfig(num_warps=4, min_programs=0, heads_per_program=0, history_in_place=True)
    assert program_blocks(3 * cfg.linear_num_value_heads, cfg.linear_value_head_dim, 128, 0) == 32  # whole heads
    y, pool, state = gdn_rows_layer(proj, counts, jnp.copy(conv), *args, jnp.copy(ssm), ctx["slots"], **kw,
                                    config=in_place, into_pool=True)
    want_y, tails, want_state = gdn_rows_layer(proj, counts, conv, *args, jnp.copy(ssm), ctx["slots"], **kw,
                                               config=GdnDecodeLayerConfig(num_warps=4, min_programs=0))
    want_pool = np.asarray(conv, np.float32).copy()
    want_pool[np.asarray(ctx["slots"])] = np.asarray(tails, np.float32)
    np.testing.assert_array_equal(np.asarray(pool, np.float32), want_pool)
    assert not np.array_equal(want_pool, np.asarray(conv, np.float32))
    for a, b in ((y, want_y), (state, want_state)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="into_pool"):
        gdn_rows_layer(proj, counts, conv, *args, ssm, ctx["slots"], **{**kw, "write_state": False}, into_pool=True)


@pytest.mark.parametrize("min_programs", [0, 10**6], ids=["in-kernel", "after-the-norm"])
def test_fp8_rows_equal_the_norms_rows_quantized(min_programs):
    """fp8_out (a value head of 128 one group): the norm's rows quantized as `quantize_rows` quantizes the bf16 rows,
    written by the kernel where a program holds whole heads and quantized after the norm where a head spans programs;
    the state and the histories as without it. Bit for bit in interpret mode. Compiled on a GPU, Triton's float32
    division may land a code one e4m3 step away on a rounding boundary, and XLA, fusing the norm with the
    quantization, drops the bf16 rounding between them (excess precision): a scale then moves by up to bf16's step."""
    cfg = dataclasses.replace(ModelConfig.from_file("configs/tiny-moe.json"), linear_value_head_dim=128)
    layer, x, ssm, conv, ctx = _layer_inputs(cfg, jnp.bfloat16, 3, seed=13)
    proj = qwen3_5.dot(KernelConfig(), x, layer.in_proj)
    args = (proj, ctx["active"], conv, layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w)
    kw = dict(num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, interpret=INTERPRET,
              config=GdnDecodeLayerConfig(min_programs=min_programs))
    y, *rest = gdn_decode_layer(*args, jnp.copy(ssm), ctx["slots"], **kw)
    (xq, xs), *rest8 = gdn_decode_layer(*args, jnp.copy(ssm), ctx["slots"], **kw, fp8_out=True)
    want_q, want_s = quantize_rows(y.reshape(3, -1))
    assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (cfg.linear_num_value_heads, 3)
    got, want = np.asarray(xq.reshape(3, -1), np.float32), np.asarray(want_q, np.float32)
    if INTERPRET:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(xs), np.asarray(want_s))
    else:
        np.testing.assert_allclose(np.asarray(xs), np.asarray(want_s), rtol=1e-6 if min_programs == 0 else 2.0**-8)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)  # e4m3's step at each code
        assert (np.abs(got - want) <= step).all() and np.mean(got != want) < 0.05
    for a, b in zip(rest8, rest):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="fp8_out"):
        gdn_decode_layer(*args, ssm, ctx["slots"], **kw, norm=False, fp8_out=True)


def test_an_fp8_round_hands_the_norms_fp8_rows_to_the_out_projection(monkeypatch):
    """Three lanes on FP8 x FP8 weights (value heads of 128): the fused step writes the FP8 rows its out-projection
    multiplies (`ops.gdn_fp8_rows`), and the mixer's output, state and histories equal those with the rows quantized
    after the kernel, bit for bit."""
    cfg = dataclasses.replace(ModelConfig.from_file("configs/tiny-moe.json"), hidden_size=128,
                              linear_value_head_dim=128, moe_intermediate_size=128, shared_expert_intermediate_size=128)
    _, x, ssm, conv, ctx = _layer_inputs(cfg, jnp.bfloat16, 3, seed=17)
    layer = random_params(cfg, seed=17, fp8=True).layers[cfg.gdn_layers[0]].mixer
    kc = dataclasses.replace(FUSED, fp8_activations=True, fuse_gdn_fp8_rows=True)
    assert ops.gdn_fp8_rows(kc, 3, 128, layer.out_proj) and not ops.gdn_fp8_rows(kc, 1, 128, layer.out_proj)
    assert not ops.gdn_fp8_rows(dataclasses.replace(kc, fuse_gdn_fp8_rows=False), 3, 128, layer.out_proj)

    def step():  # a new function each time: traced afresh
        return jax.jit(lambda x, s, c, ctx: qwen3_5.gdn_decode_mixer(layer, x, cfg, kc, s, c, ctx))(x, ssm, conv, ctx)

    fed = step()
    monkeypatch.setattr(ops, "gdn_fp8_rows", lambda *a: False)
    for a, b in zip(fed, step()):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_one_lane_spreads_its_heads_over_more_programs():
    """35B-A3B (32 value heads of 128): one lane's heads in 32-column blocks (128 programs), eight lanes' whole."""
    assert program_blocks(1 * 32, 128, 128, 128) == 32
    assert program_blocks(8 * 32, 128, 128, 128) == 128
    assert program_blocks(1 * 48, 128, 128, 128) == 32  # 27B: 48 heads
    assert program_blocks(1 * 2, 16, 128, 128) == 16  # never under 16 columns


def test_fusion_needs_the_pallas_backend():
    with pytest.raises(ValueError, match="pallas"):
        KernelConfig(fuse_gdn_decode=True)


@pytest.mark.parametrize("lanes", [1, 8, 64])  # 64: the wide rounds' config (WIDE_CONFIG)
@pytest.mark.parametrize("config", ["qwen3.5-35b-a3b", "qwen3.5-27b"])
def test_fused_gdn_decode_lowers_to_triton_at_the_real_shapes(config, lanes):
    lower_for_h200()
    cfg = ModelConfig.from_file(f"configs/{config}.json")
    spec, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    slots = 18
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    args = (spec((lanes, cfg.conv_dim + hv * dv + 2 * hv), bf16), spec((lanes,), jnp.bool_),
            spec((slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), bf16),
            spec((cfg.linear_conv_kernel_dim, cfg.conv_dim), bf16), spec((hv,), jnp.float32), spec((hv,), jnp.float32),
            spec((dv,), bf16), spec((slots, hv, cfg.linear_key_head_dim, dv), jnp.float32), spec((lanes,), jnp.int32))
    text = gdn_decode_layer.trace(*args, num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps,
                                  into_pool=True).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_decode_layer" in text
    assert ("scatter" in text) == (lanes < 64)  # wide rounds write the histories in place, narrower ones scatter
    fp8 = gdn_decode_layer.trace(*args, num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, fp8_out=True)
    assert "gdn_decode_layer" in fp8.lower(lowering_platforms=("cuda",)).as_text()  # the rows quantized in or after
    apart = (spec((lanes, cfg.conv_dim + hv * dv), bf16), *args[1:])  # an FP8 checkpoint's b and a apart
    assert "gdn_decode_layer" in gdn_decode_layer.trace(
        *apart, num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, gates=spec((lanes, 2 * hv), bf16)
    ).lower(lowering_platforms=("cuda",)).as_text()
    rows = gdn_rows_layer.trace(spec((lanes, 4, args[0].shape[1]), bf16), spec((lanes,), jnp.int32), *args[2:],
                                num_key_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps, write_state=False)
    assert "gdn_rows_layer" in rows.lower(lowering_platforms=("cuda",)).as_text()
