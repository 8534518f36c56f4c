"""MoE expert kernels (`pallas_kernels.moe`) against `reference.moe_experts_ref`.

The same cases run on GPU and, in Pallas interpret mode, on CPU (tiny shapes: E=8, K=2, H=64, I=32).
Inputs are fresh random draws every run (the seed is in the assertion message). Interpret mode fills
kernel outputs with NaN before the kernels run, so an element no program wrote surfaces as NaN.
"""

from __future__ import annotations

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as pltriton

from ninfer_jax.model import ops
from kernel_support import INTERPRET, lower_for_h200
from pallas_kernels import moe
from pallas_kernels import reference as ref

E, K, H, I = 8, 2, 64, 32

# Prefill path with 16-row tiles (several tiles per expert, padding in most); the tiled decode path, its rows sharing
# their experts' tiles (the default) or a tile each.
PREFILL = moe.MoeConfig(block_m=16, decode_max_rows=0, gemv_max_rows=0)
DECODE = moe.MoeConfig(gemv_max_rows=0)
ROW_TILES = moe.MoeConfig(gemv_max_rows=0, decode_share_tiles=False)


def _inputs(seed: int, t: int, dtype, routing: str):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, H), np.float32)
    gate_up = rng.standard_normal((E, H, 2 * I), np.float32) * H**-0.5
    down = rng.standard_normal((E, I, H), np.float32) * I**-0.5
    if routing == "router":  # the reference router over a random gate
        ids, w = ref.moe_route_ref(jnp.asarray(x), jnp.asarray(rng.standard_normal((E, H), np.float32)), K)
        ids, w = np.asarray(ids), np.asarray(w)
    else:
        if routing == "sparse":  # only experts 1, 4, 6 receive tokens
            ids = np.stack([rng.choice([1, 4, 6], size=K, replace=False) for _ in range(t)])
        elif routing == "one_expert":  # every routed row lands on expert 5 (K copies per token)
            ids = np.full((t, K), 5)
        else:
            raise ValueError(routing)
        w = rng.random((t, K), np.float32) + 0.1
        w /= w.sum(axis=1, keepdims=True)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), jnp.asarray(ids, jnp.int32), jnp.asarray(w, jnp.float32), cast(gate_up), cast(down)


def _rel_err(out, want) -> float:
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(out - want) / np.linalg.norm(want))


def _shared(seed: int, t: int, dtype, inter: int = I) -> ref.SharedExpert:
    rng = np.random.default_rng(seed + 1)
    return ref.SharedExpert(jnp.asarray(rng.standard_normal((H, 2 * inter), np.float32) * H**-0.5, dtype),
                            jnp.asarray(rng.standard_normal((inter, H), np.float32) * inter**-0.5, dtype),
                            jnp.asarray(rng.random(t, np.float32) + 0.2))


def _check(cfg, t, dtype, routing, shared_inter: int | None = None):
    seed = secrets.randbits(32)
    args = _inputs(seed, t, dtype, routing)
    if shared_inter is not None:
        args = args + (_shared(seed, t, dtype, shared_inter),)
    out = moe.moe_experts(*args, config=cfg, interpret=INTERPRET)
    with jax.default_matmul_precision("highest"):  # a GPU's float32 matmuls are TF32 by default (1e-4 off)
        want = ref.moe_experts_ref(*args)
    assert out.shape == (t, H) and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all(), f"seed={seed}: unwritten (NaN) or non-finite output"
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    err = _rel_err(out, want)
    assert err < tol, f"seed={seed}: relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("routing", ["router", "sparse", "one_expert"])
@pytest.mark.parametrize("t", [1, 13, 40])
def test_prefill_path_matches_reference(t, routing, dtype):
    _check(PREFILL, t, dtype, routing)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("routing", ["router", "one_expert"])
@pytest.mark.parametrize("t", [1, 8])
def test_decode_path_matches_reference(t, routing, dtype):
    _check(ROW_TILES, t, dtype, routing)


@pytest.mark.parametrize("t,routing,dtype", [(40, "router", jnp.bfloat16), (13, "one_expert", jnp.float32)])
def test_prefill_default_tiles(t, routing, dtype):
    """DEFAULT_CONFIG's 128-row tiles: at these tiny shapes most of each tile is padding."""
    _check(dataclasses.replace(moe.DEFAULT_CONFIG, decode_max_rows=0, gemv_max_rows=0), t, dtype, routing)


@pytest.mark.parametrize("t,routing,dtype", [(40, "router", jnp.bfloat16), (40, "one_expert", jnp.float32)])
def test_prefill_mid_tiles(t, routing, dtype):
    """MID_PREFILL_CONFIG's 64-row tiles on 4 warps (64-127 rows per expert)."""
    _check(dataclasses.replace(moe.MID_PREFILL_CONFIG, decode_max_rows=0, gemv_max_rows=0), t, dtype, routing)


def test_default_config_follows_the_rows_per_expert():
    e = 256
    assert moe.default_config(8, e) == moe.DEFAULT_CONFIG  # one lane: the split-K path (gemv_max_rows)
    assert moe.default_config(64, e) is moe.WIDE_DECODE_CONFIG
    assert moe.default_config(512 * 8, e) is moe.SPARSE_PREFILL_CONFIG  # 16 rows per expert
    assert moe.default_config(2048 * 8, e) is moe.MID_PREFILL_CONFIG  # 64
    assert moe.default_config(4096 * 8, e) is moe.DEFAULT_CONFIG  # 128
    assert moe.default_config(8192 * 8, e) is moe.DEFAULT_CONFIG  # 256
    # FP8 x FP8 tiles: 16 rows up to 8 rows per expert (a wide decode round), 32 from there; a decode round's rows
    # up to decode_max_rows stay weight-only
    assert moe.default_config(64 * 8, e, fp8_rows=True) is moe.FP8_NARROW_ROWS_CONFIG  # 2 per expert
    assert moe.default_config(256 * 8, e, fp8_rows=True) is moe.FP8_NARROW_ROWS_CONFIG  # 8
    assert moe.default_config(256 * 8 + 1, e, fp8_rows=True) is moe.FP8_ROWS_CONFIG
    assert moe.default_config(512 * 8, e, fp8_rows=True) is moe.FP8_ROWS_CONFIG
    assert moe.default_config(32768 * 8, e, fp8_rows=True) is moe.FP8_ROWS_CONFIG
    assert moe.default_config(64, e, fp8_rows=True) is moe.WIDE_DECODE_CONFIG


@pytest.mark.parametrize("routing", ["router", "one_expert"])
def test_wide_decode_config(routing):
    _check(moe.WIDE_DECODE_CONFIG, 8, jnp.bfloat16, routing)


@pytest.mark.parametrize("t,routing,dtype", [(8, "router", jnp.float32), (8, "one_expert", jnp.bfloat16),
                                             (16, "one_expert", jnp.float32), (6, "router", jnp.float32)],
                         ids=["router", "one-tile-full", "two-tiles-an-expert", "rows-not-a-power-of-two"])
def test_decode_rows_of_one_expert_share_its_tiles(t, routing, dtype):
    """decode_share_tiles: 16 rows on one expert fill one tile, 32 take two, R = 12 keeps a tile a row."""
    _check(DECODE, t, dtype, routing)


@pytest.mark.parametrize("t,dtype", [(8, jnp.float32), (8, jnp.bfloat16), (32, jnp.float32)],
                         ids=["f32", "bf16", "tokens-past-a-tile"])
def test_the_shared_expert_rides_in_the_decode_tiles(t, dtype):
    """decode_shared_tile: the shared expert one more tile of both kernels, its gate the rows' weight; 32 tokens do
    not fit one tile and take the two matmuls."""
    _check(dataclasses.replace(DECODE, decode_shared_tile=True), t, dtype, "router", shared_inter=I)


@pytest.mark.parametrize("t,dtype,routing", [(24, jnp.float32, "router"), (13, jnp.bfloat16, "one_expert")],
                         ids=["f32-two-tiles-one-padded", "bf16-one-expert"])
def test_the_shared_expert_rides_in_row_tiles_of_the_tiled_layout(t, dtype, routing):
    """tiled_shared_max_tokens: in the sorted layout (16-row tiles) the shared expert's T rows are ceil(T / 16) more
    tiles of both kernels, their gate the rows' weight; 24 tokens fill one and half of another."""
    _check(dataclasses.replace(PREFILL, tiled_shared_max_tokens=t), t, dtype, routing, shared_inter=I)


def test_shared_decode_tiles_lower_to_triton_at_35b_a3b_shapes():
    """Eight lanes' 64 rows with `_tile`'s in-kernel layout (a cumsum and a [16, R] match) lower to Triton IR, with
    no layout kernel beside them, and with the shared expert as one more tile."""
    lower_for_h200()
    e, k, h, i, t = 256, 8, 2048, 512, 8
    spec = jax.ShapeDtypeStruct
    args = (spec((t, h), jnp.bfloat16), spec((t, k), jnp.int32), spec((t, k), jnp.float32),
            spec((e, h, 2 * i), jnp.bfloat16), spec((e, i, h), jnp.bfloat16))
    target = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    text = moe.moe_experts.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(target) == 2 and "sort" not in text
    shared = ref.SharedExpert(spec((h, 2 * i), jnp.bfloat16), spec((i, h), jnp.bfloat16), spec((t,), jnp.float32))
    cfg = dataclasses.replace(moe.WIDE_DECODE_CONFIG, decode_shared_tile=True)
    text = moe.moe_experts.trace(*args, shared, config=cfg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(target) == 2 and "stablehlo.dot_general" not in text  # the shared expert inside the kernels


def test_ops_dispatch():
    """The model's pallas branch with config None (`moe.default_config`), R past the decode threshold."""
    seed = secrets.randbits(32)
    args = _inputs(seed, 40, jnp.bfloat16, "router")
    kc = ops.KernelConfig(backend="pallas", interpret=INTERPRET)
    out = ops.moe_experts(kc, *args)
    err = _rel_err(out, ref.moe_experts_ref(*args))
    assert err < 2e-2, f"seed={seed}: relative error {err:.2e}"


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_rows_invariants(block_m):
    rng = np.random.default_rng(secrets.randbits(32))
    r = 50
    flat = rng.choice([0, 3, 7], size=r).astype(np.int32)  # experts 1, 2, 4, 5, 6 stay empty
    sorted_rows, tile_expert = map(np.asarray, moe.align_rows(jnp.asarray(flat), E, block_m))
    assert sorted_rows.shape == (block_m * tile_expert.shape[0],)
    assert sorted(sorted_rows[sorted_rows < r].tolist()) == list(range(r))  # every row exactly once
    used = tile_expert >= 0
    assert used.sum() == sum(-(-np.sum(flat == e) // block_m) for e in range(E))
    assert (tile_expert[used] == np.sort(tile_expert[used])).all() and not used[used.sum():].any()
    for m in np.nonzero(used)[0]:  # a tile holds rows of its own expert, then padding (R) only
        rows = sorted_rows[m * block_m:(m + 1) * block_m]
        real = rows[rows < r]
        assert (flat[real] == tile_expert[m]).all()
        assert (rows[: len(real)] == real).all() and (np.diff(real) > 0).all()
    assert (sorted_rows[~np.repeat(used, block_m)] == r).all()


def test_shared_tiles_layout_holds_every_row_once_and_pads_past_them():
    """The routed rows' tiles as `align_rows` lays them, then 24 shared rows in two 16-row tiles; every padding slot,
    the routed tiles' included, is the spare row R + T (a padding slot on a shared row would race its write)."""
    r, t, block_m = 50, 24, 16
    flat = np.random.default_rng(secrets.randbits(32)).choice([0, 3, 7], size=r).astype(np.int32)
    tile_expert, rows = map(np.asarray, moe.shared_tiles_layout(jnp.asarray(flat), E, block_m, t))
    routed_rows, routed_tiles = map(np.asarray, moe.align_rows(jnp.asarray(flat), E, block_m))
    n = routed_tiles.shape[0]
    assert (tile_expert[:n] == routed_tiles).all() and (tile_expert[n:] == moe._SHARED_TILE).all()
    assert tile_expert.shape == (n + 2,) and rows.shape == ((n + 2) * block_m,)
    assert (rows[:n * block_m] == np.where(routed_rows < r, routed_rows, r + t)).all()
    assert (rows[n * block_m:] == np.minimum(np.arange(2 * block_m), t) + r).all()
    assert sorted(rows[rows < r + t].tolist()) == list(range(r + t))  # every row exactly once


def test_rejects_bad_inputs():
    x, ids, w, gu, dn = _inputs(0, 4, jnp.float32, "router")
    with pytest.raises(ValueError, match="expert_ids"):
        moe.moe_experts(x, ids[:, :1], w, gu, dn, interpret=INTERPRET)
    with pytest.raises(ValueError, match="gate_up"):
        moe.moe_experts(x, ids, w, gu[:, :, :I], dn, interpret=INTERPRET)
    with pytest.raises(ValueError, match="dtype"):
        moe.moe_experts(x, ids, w, gu, dn.astype(jnp.bfloat16), interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        moe.MoeConfig(block_m=48)
    with pytest.raises(ValueError, match="num_stages"):
        moe.MoeConfig(num_stages=0)


@pytest.mark.parametrize("tokens", [1, 512, 8192])
def test_lowers_to_triton_at_35b_a3b_shapes(tokens):
    """Both paths lower to Triton IR at the real shapes (E=256, K=8, H=2048, I=512, bf16), on any machine."""
    lower_for_h200()
    e, k, h, i = 256, 8, 2048, 512
    spec = jax.ShapeDtypeStruct
    args = (spec((tokens, h), jnp.bfloat16), spec((tokens, k), jnp.int32), spec((tokens, k), jnp.float32),
            spec((e, h, 2 * i), jnp.bfloat16), spec((e, i, h), jnp.bfloat16))
    text = moe.moe_experts.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    target = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    assert text.count(target) == 2  # gate_up and down kernels


# The split-K matrix-vector path at the tiny shapes: 16-wide column blocks and 16-deep steps, so both
# kernels split their contraction (H=64: 2 pieces of 2 steps; I=32: 2 pieces of 1 step).
GEMV = moe.MoeConfig(gemv_block_n=16, gemv_block_k=16, gemv_splits=2, gemv_down_block_n=16,
                     gemv_down_block_k=16, gemv_down_splits=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("routing", ["router", "one_expert"])
@pytest.mark.parametrize("t", [1, 8])
def test_gemv_decode_path_matches_reference(t, routing, dtype):
    _check(dataclasses.replace(GEMV, gemv_max_rows=t * K), t, dtype, routing)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 3])
def test_gemv_path_runs_the_shared_expert_as_more_rows(t, dtype):
    _check(dataclasses.replace(GEMV, gemv_max_rows=t * K), t, dtype, "router", shared_inter=I)


@pytest.mark.parametrize("cfg, t, shared_inter", [
    (GEMV, 1, 2 * I), (DECODE, 3, I), (dataclasses.replace(PREFILL, tiled_shared_max_tokens=23), 24, I)],
    ids=["gemv-other-width", "tiled-decode", "prefill-past-the-shared-tiles"])
def test_other_paths_add_the_shared_expert(cfg, t, shared_inter):
    """A shared expert of another width than the experts', or a tiled path past its tiles' limits: two matmuls
    added."""
    _check(dataclasses.replace(cfg, gemv_max_rows=t * K) if cfg is GEMV else cfg, t, jnp.float32, "router",
           shared_inter=shared_inter)


def test_shared_expert_must_match_the_experts():
    args = _inputs(0, 2, jnp.float32, "router")
    bad_weight = ref.SharedExpert(*_shared(0, 2, jnp.float32)[:2], jnp.ones(3, jnp.float32))
    with pytest.raises(ValueError, match="shared"):
        moe.moe_experts(*args, bad_weight, interpret=INTERPRET)
    bad_dtype = _shared(0, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match="shared"):
        moe.moe_experts(*args, bad_dtype, interpret=INTERPRET)


def test_one_lane_takes_the_gemv_path_and_more_lanes_the_tiles():
    """Which kernels the defaults pick at the 35B-A3B shapes: one lane (8 rows) the split-K pair."""
    lower_for_h200()
    e, k, h, i = 256, 8, 2048, 512
    spec = jax.ShapeDtypeStruct
    names = {}
    for tokens in (1, 8):
        args = (spec((tokens, h), jnp.bfloat16), spec((tokens, k), jnp.int32), spec((tokens, k), jnp.float32),
                spec((e, h, 2 * i), jnp.bfloat16), spec((e, i, h), jnp.bfloat16))
        names[tokens] = moe.moe_experts.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "moe_gemv_gate_up" in names[1] and "moe_gemv_down" in names[1]
    assert "moe_gemv" not in names[8] and "moe_gate_up" in names[8]


def test_one_lane_reads_the_shared_expert_in_the_gemv_kernels():
    """At the 35B-A3B shapes one lane's shared expert adds no kernel and no matmul of its own."""
    lower_for_h200()
    e, k, h, i = 256, 8, 2048, 512
    spec = jax.ShapeDtypeStruct
    args = (spec((1, h), jnp.bfloat16), spec((1, k), jnp.int32), spec((1, k), jnp.float32),
            spec((e, h, 2 * i), jnp.bfloat16), spec((e, i, h), jnp.bfloat16),
            ref.SharedExpert(spec((h, 2 * i), jnp.bfloat16), spec((i, h), jnp.bfloat16), spec((1,), jnp.float32)))
    text = moe.moe_experts.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    target = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    assert text.count(target) == 2 and "moe_gemv_gate_up" in text
    assert "dot_general" not in text

