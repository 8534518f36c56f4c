"""The prefill block-FP8 GEMM (pallas_kernels/fp8_gemm.py). Mosaic GPU compiles only for a GPU, so on CPU: its
jnp reference (the kernel's blocking and scaling) against float64, input checks, the configs a wide round picks,
and that every tuned config lowers for the H200 at a real shape. The kernel itself is checked on the H200
against the same reference by scripts/bench_fp8_kernels.py --only gemm (the 27B's shapes at 2048 and 8192 rows) and
--only gemm-wide (64-256 rows, every K split and tail config it times)."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_gemm, fp8_matmul
from ninfer_jax.model.tiny import quantize_fp8_blocks

M, K, N = 256, 384, 256


def _case(seed=0, m=M, k=K, n=N):
    """x, and a block-FP8 weight whose blocks' scales span three orders of magnitude, with its float64 value."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.repeat(np.repeat(10.0 ** rng.uniform(-3, 0, (n // 128, k // 128)), 128, 0),
                                                128, 1)
    values, scales = quantize_fp8_blocks(w.astype(np.float32))
    exact = values.astype(np.float64) * np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(values), jnp.asarray(scales), exact


def _x_as_quantized(x):
    xq, xs = (np.asarray(a, np.float64) for a in fp8_matmul.quantize_rows(x))
    m, k = xq.shape
    return (xq.reshape(m, k // 128, 128) * xs.T[..., None]).reshape(m, k)


def test_reference_is_the_quantized_rows_times_the_weight():
    """Block by block products scaled by the activation's and weight's scales equal, in float64, x quantized per
    token and 128-group times W; and differ from x's own product by the quantization's error (e4m3: 3 mantissa
    bits, each activation within 2^-4 of itself)."""
    x, values, scales, exact = _case()
    got = np.asarray(fp8_gemm.reference(x, values, scales), np.float64)
    want = _x_as_quantized(x) @ exact.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    plain = np.asarray(x, np.float64) @ exact.T
    assert 1e-3 < np.linalg.norm(got - plain) / np.linalg.norm(plain) < 2**-5


def test_refuses_partial_blocks_and_other_weight_dtypes():
    x, values, scales, _ = _case()
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_gemm.fp8_gemm(x[:, :320], values[:, :320], scales)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm.fp8_gemm(x, values.astype(jnp.bfloat16), scales)
    with pytest.raises(ValueError, match="tile_n"):
        fp8_gemm.GemmConfig(tile_n=256)
    with pytest.raises(ValueError, match="k_splits 2 ranges of 1-block steps do not divide"):
        fp8_gemm.fp8_gemm(x, values, scales, config=fp8_gemm.GemmConfig(k_splits=2))  # 3 blocks of K
    with pytest.raises(ValueError, match="k_splits 1 ranges of 2-block steps do not divide"):
        fp8_gemm.fp8_gemm(x, values, scales, config=fp8_gemm.GemmConfig(step_blocks=2))
    with pytest.raises(ValueError, match="step_blocks"):
        fp8_gemm.GemmConfig(step_blocks=2, overlap=True)


def test_wide_round_config_follows_the_row_and_tile_counts():
    """At 64 rows the warpgroups split the columns: the 27B's down (20 tiles of 256 columns) takes four K ranges on
    three stages; its o_proj, whose four ranges would be 12 blocks long, 64-column tiles in two; its gate_up (136
    tiles on 132 SMs) one range, the four tiles past the wave in eight; the 35B-A3B's GDN in-projection (48 tiles)
    64-column warpgroup tiles. At more rows K ranges double while the CTAs fit the SMs, and a last wave at most a
    quarter full runs in K ranges: gate_up's at 128 and 256 rows, the 35B-A3B's attention qkv's at 256 (12 tiles
    past the wave), not its GDN in-projection's (60), nor past 256 rows where no tail was timed (gate_up's 16 tiles
    past eight waves at 512)."""
    cfg = fp8_gemm.auto_config(64, 5120, 17408, 132)
    assert (cfg.wg_split, cfg.tile_n, cfg.k_splits, cfg.max_concurrent_steps) == ("n", 128, 4, 3)
    cfg = fp8_gemm.auto_config(33, 5120, 6144, 132)
    assert (cfg.wg_split, cfg.tile_n, cfg.k_splits, cfg.max_concurrent_steps) == ("n", 64, 2, 3)
    cfg = fp8_gemm.auto_config(64, 34816, 5120, 132)
    assert (cfg.wg_split, cfg.tile_n, cfg.k_splits, cfg.max_concurrent_steps, cfg.tail_splits) == ("n", 128, 1, 4, 8)
    cfg = fp8_gemm.auto_config(64, 12288, 2048, 132)
    assert (cfg.wg_split, cfg.tile_n, cfg.k_splits, cfg.max_concurrent_steps, cfg.tail_splits) == ("n", 64, 1, 4, 1)
    cfg = fp8_gemm.auto_config(64, 2048, 4096, 132)
    assert (cfg.tile_n, cfg.k_splits) == (64, fp8_gemm.MAX_K_SPLITS)
    cfg = fp8_gemm.auto_config(64, 5120, 384, 132)  # three K blocks: no whole ranges, narrower tiles instead
    assert (cfg.tile_n, cfg.k_splits) == (64, 1)
    cfg = fp8_gemm.auto_config(128, 5120, 6144, 132)
    assert (cfg.wg_split, cfg.k_splits) == ("m", 2)
    assert fp8_gemm.auto_config(128, 2048, 4096, 132).k_splits == 4
    assert fp8_gemm.auto_config(256, 2048, 4096, 132).k_splits == 4
    for m in (128, 256):
        assert fp8_gemm.auto_config(m, 34816, 5120, 132) == dataclasses.replace(fp8_gemm.DEFAULT_CONFIG, tail_splits=8)
    assert fp8_gemm.auto_config(256, 9216, 2048, 132).tail_splits == 8
    assert fp8_gemm.auto_config(256, 12288, 2048, 132).tail_splits == 1
    assert fp8_gemm.auto_config(512, 34816, 5120, 132).tail_splits == 1
    assert fp8_gemm.auto_config(2048, 34816, 5120, 132) == fp8_gemm.DEFAULT_CONFIG
    assert fp8_gemm.auto_config(256, 5120, 17408, 132) == fp8_gemm.DEFAULT_CONFIG


@pytest.mark.parametrize("cfg", [fp8_gemm.DEFAULT_CONFIG, fp8_gemm.GemmConfig(overlap=True),
                                 fp8_gemm.GemmConfig(cluster="m"),
                                 fp8_gemm.GemmConfig(tile_m=128, tile_n=64, cluster=None),
                                 fp8_gemm.GemmConfig(k_splits=4),
                                 fp8_gemm.GemmConfig(wg_split="n", k_splits=2, max_concurrent_steps=3),
                                 fp8_gemm.auto_config(64, 5120, 34816, 132),
                                 fp8_gemm.auto_config(64, 12288, 2048, 132),
                                 dataclasses.replace(fp8_gemm.DEFAULT_CONFIG, tail_splits=8),
                                 fp8_gemm.GemmConfig(step_blocks=2, max_concurrent_steps=2),
                                 dataclasses.replace(fp8_gemm.auto_config(64, 34816, 5120, 132), step_blocks=2,
                                                     max_concurrent_steps=2, tail_splits=4)],
                         ids=["default", "overlap", "cluster_m", "256x64", "k_splits", "wg_split_n", "wide_round",
                              "wide_round_64_cols", "tail_splits", "step_blocks", "wide_round_step_blocks"])
def test_lowers_for_h200_at_the_27b_mlp(cfg):
    """Mosaic GPU's lowering checks the wgmma operand types, layouts and pipeline without a GPU (not the SMEM
    budget: 256x64 with an N cluster lowers, then needs 233,536 bytes of SMEM against 232,448 compiled on an H100;
    the bench's 256x64 runs without a cluster). Each config also on a `blocked` weight."""
    assert "mosaic_gpu" in fp8_gemm.lower(2048, 5120, 34816, cfg).as_text()
    assert "mosaic_gpu" in fp8_gemm.lower(64, 5120, 34816, cfg, blocked=True).as_text()


def _launch_as_reference(xq, xs, values, scales, cfg, out_dtype, num_sms, interpret=False, groups=None, cols=None):
    """`fp8_gemm._gemm`'s contract in jnp: W's columns cols = (first, count), float32 partial sums of each K range
    stacked on rows; a launch from column 0 narrower than N leaves the rest of its output NaN."""
    values = fp8_matmul.unblocked(values)
    k, n = xq.shape[1], values.shape[0]
    col0, count = cols or (0, n)
    assert count % cfg.cta_n == 0 and col0 % cfg.cta_n == 0
    r = k // 128 // cfg.k_splits
    parts = [fp8_gemm.reference_rows(xq[:, i * r * 128:(i + 1) * r * 128], xs[i * r:(i + 1) * r],
                                     values[col0:col0 + count, i * r * 128:(i + 1) * r * 128],
                                     scales[col0 // 128:(col0 + count) // 128, i * r:(i + 1) * r])
             for i in range(cfg.k_splits)]
    out = jnp.concatenate(parts, axis=0)
    if col0 == 0 and count < n:
        out = jnp.pad(out, ((0, 0), (0, n - count)), constant_values=jnp.nan)
    return out.astype(out_dtype if cfg.k_splits == 1 else jnp.float32)


@pytest.mark.parametrize("m,n", [(64, 2304), (200, 2176)])
def test_tiles_past_the_last_whole_wave_run_as_a_tail_in_k_ranges(monkeypatch, m, n):
    """On 8 SMs, 2304 columns at 64 rows are nine 256-column tiles: eight fill the grid's wave, the ninth's K runs
    as a second launch in four ranges whose partial sums land in its columns; at 200 rows (256 padded, two 128-row
    tiles a column tile) 32 of 34 tiles fill four waves and the last column's two run in four ranges. The
    wrapper's result equals the reference of the whole product; each launch keeps to the kernel's contract."""
    monkeypatch.setattr(fp8_gemm, "_num_sms", lambda: 8)
    monkeypatch.setattr(fp8_gemm, "_gemm", _launch_as_reference)
    x, values, scales, _ = _case(seed=5, m=m, k=512, n=n)
    xq, xs = fp8_matmul.quantize_rows(x)
    cfg = fp8_gemm.auto_config(m, n, 512, 8)
    assert cfg.tail_splits == 4
    got = np.asarray(fp8_gemm.fp8_gemm_rows.__wrapped__(xq, xs, values, scales, out_dtype=jnp.float32, config=cfg))
    want = np.asarray(fp8_gemm.reference_rows(xq, xs, values, scales))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_grouped_reference_multiplies_each_row_tile_by_its_groups_weight():
    """The grouped product's reference, in float64: each 128-row tile's rows (quantized, their scales applied) times
    its group's dequantized weight; a tile marked -1 is zeros."""
    rng = np.random.default_rng(3)
    cases = [_case(seed) for seed in range(3)]
    values, scales = jnp.stack([c[1] for c in cases]), jnp.stack([c[2] for c in cases])
    groups = jnp.asarray([2, 0, 0, -1], jnp.int32)
    xq, xs = fp8_matmul.quantize_rows(jnp.asarray(rng.standard_normal((512, K)), jnp.float32))
    got = np.asarray(fp8_gemm.grouped_reference(xq, xs, groups, values, scales, out_dtype=jnp.float32), np.float64)
    x = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64).T, 128, axis=1)
    for tile, g in enumerate([2, 0, 0]):
        rows = slice(tile * 128, (tile + 1) * 128)
        want = x[rows] @ cases[g][3].T
        np.testing.assert_allclose(got[rows], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[384:].any()
    with pytest.raises(ValueError, match="tiles of 128"):
        fp8_gemm.grouped_gemm(xq[:200], xs[:, :200], groups[:1], values, scales)


@pytest.mark.parametrize("k,n", [(2048, 1024), (512, 2048)], ids=["gate_up", "down"])
def test_grouped_gemm_lowers_for_h200_at_the_35b_a3b_experts(k, n):
    """256 experts, 64 row tiles; the grouped kernel loads each tile's group from memory and skips tiles marked
    -1."""
    assert "mosaic_gpu" in fp8_gemm.lower_grouped(8192, k, n, 256).as_text()


@pytest.mark.parametrize("m,n", [(64, 2304), (64, 256), (512, 256)], ids=["tail", "k-ranges", "one-range"])
def test_blocked_weights_give_the_rows_products(monkeypatch, m, n):
    """The wrapper takes a `blocked` weight as its [N, K] rows (a tail launch's columns, K ranges, one range alike),
    to the bit; the kernel itself reads it on the H200 in scripts/ab_kernel_flags.py's layout variants."""
    monkeypatch.setattr(fp8_gemm, "_num_sms", lambda: 8)
    monkeypatch.setattr(fp8_gemm, "_gemm", _launch_as_reference)
    x, values, scales, _ = _case(seed=9, m=m, k=1024, n=n)
    xq, xs = fp8_matmul.quantize_rows(x)
    got, want = (fp8_gemm.fp8_gemm_rows.__wrapped__(xq, xs, v, scales, out_dtype=jnp.bfloat16)
                 for v in (fp8_matmul.blocked(values), values))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="values"):
        fp8_gemm.fp8_gemm_rows.__wrapped__(xq, xs, fp8_matmul.blocked(values)[:, :, :64], scales,
                                           out_dtype=jnp.bfloat16)


def test_a_split_product_leaves_its_partial_sums_unadded_when_asked(monkeypatch):
    """partial_sums: a product in K ranges comes as their float32 partial sums [S, M, N], which `sum_partials` adds
    into the product's very bits; one range (more rows here), or a tail, gives the product as always."""
    monkeypatch.setattr(fp8_gemm, "_num_sms", lambda: 8)
    monkeypatch.setattr(fp8_gemm, "_gemm", _launch_as_reference)
    x, values, scales, _ = _case(seed=7, m=64, k=1024, n=256)
    xq, xs = fp8_matmul.quantize_rows(x)
    run = functools.partial(fp8_gemm.fp8_gemm_rows.__wrapped__, xq, xs, values, scales, out_dtype=jnp.bfloat16)
    assert fp8_gemm.auto_config(64, 256, 1024, 8).k_splits == 4
    parts, product = run(partial_sums=True), run()
    assert parts.shape == (4, 64, 256) and parts.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(fp8_matmul.sum_partials(parts, jnp.bfloat16), np.float32),
                                  np.asarray(product, np.float32))
    one = fp8_gemm.DEFAULT_CONFIG
    np.testing.assert_array_equal(np.asarray(run(partial_sums=True, config=one), np.float32),
                                  np.asarray(run(config=one), np.float32))


def test_model_product_takes_the_gemm_for_prefill_rows_with_fp8_activations(monkeypatch):
    """ops.quantized_dot: on a Hopper GPU with fp8_activations, more rows than a decode round go through the GEMM,
    also with the other kernels in interpret mode; without fp8_activations (weight-only's bf16 rounding promise) they
    stay dequantized."""
    from ninfer_jax.model import ops
    from ninfer_jax.model.params import QuantizedWeight

    x, values, scales, _ = _case()
    calls = []
    monkeypatch.setattr(fp8_gemm, "available", lambda: True)
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_rows", lambda q, xs, v, s, out_dtype, partial_sums: calls.append(q.shape)
                        or fp8_gemm.reference_rows(q, xs, v, s).astype(out_dtype))
    w = QuantizedWeight(values, scales)
    got = ops.quantized_dot(ops.KernelConfig("pallas", fp8_activations=True), x, w)
    assert calls == [(M, K)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fp8_gemm.reference(x, values, scales)))
    ops.quantized_dot(ops.KernelConfig("pallas"), x, w)
    assert calls == [(M, K)]
    ops.quantized_dot(ops.KernelConfig("pallas", interpret=True, fp8_activations=True), x, w)
    assert calls == [(M, K)] * 2
