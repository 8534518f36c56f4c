"""KV storage profiles (pallas_kernels.kv_quant): each format's round trip within its derived error bound, and
each profile's bytes per token and head equal to spec §3.1's table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant

SPEC_BYTES = {"bfloat16": 1024, "int8": 528, "fp8": 516, "k8v4": 402, "nvfp4": 288}


@pytest.mark.parametrize("profile", list(SPEC_BYTES))
def test_bytes_per_token_and_head_equal_the_spec_table(profile):
    assert kv_quant.bytes_per_token_head(profile, 256) == SPEC_BYTES[profile]
    # and the pool planes hold exactly that many bytes a token and head
    for fmt in kv_quant.PROFILES[profile]:
        if fmt is not None:
            pool = kv_quant.empty_pool(fmt, (1, 64, 1, 256), jnp.float32)
            assert sum(p.nbytes for p in kv_quant.planes(pool)) == 64 * fmt.bytes_per_row(256)


def test_auto_profile_takes_the_activations_dtype():
    assert kv_quant.bytes_per_token_head("auto", 256, jnp.float32) == 2048
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_quant.check_profile("int4", 256)
    with pytest.raises(ValueError, match="kv_dtype 'nvfp4'.*multiple of 32"):
        kv_quant.check_profile("nvfp4", 48)


# FP8 at a head of 64 too: its row group is capped at the head dim
@pytest.mark.parametrize("fmt,d", [(f, 256) for f in kv_quant.FORMATS.values()] + [(kv_quant.FP8_ROW256, 64)],
                         ids=lambda x: getattr(x, "name", x))
def test_round_trip_within_the_format_bound(fmt, d):
    r = np.random.default_rng(0)
    # rows of very different magnitudes, an all-zero row, exact zeros and outliers: every code range, below
    # NVFP4's largest magnitude (6 x 448)
    x = r.standard_normal((6, 3, d)).astype(np.float32) * np.array([1e-4, 1e-2, 1, 30, 300, 1])[:, None, None]
    x[5, 0] = 0
    x[2, 1, ::7] = 0
    x[3, :, 5] *= 10
    values, scales = kv_quant.quantize(fmt, jnp.asarray(x))
    assert values.dtype == fmt.value_dtype and scales.dtype == fmt.scale_dtype
    assert values.shape[-1] == fmt.value_cols(d) and scales.shape[-1] == d // fmt.group_of(d)
    back = np.asarray(kv_quant.dequantize(fmt, values, scales, d))
    per_elem = np.repeat(np.asarray(scales.astype(jnp.float32)), fmt.group_of(d), axis=-1)
    bound = np.asarray(kv_quant.error_bound(fmt, jnp.asarray(x), jnp.asarray(per_elem)))
    err = np.abs(back - x)
    assert np.all(err <= bound), (fmt.name, float((err / bound).max()))
    assert np.all(back[5, 0] == 0) and np.all(back[2, 1, ::7] == 0)
    # the scale holds the group's largest value (amax / qmax rounded up), at most two values of its dtype above
    amax = np.abs(x).reshape(*x.shape[:-1], -1, fmt.group_of(d)).max(-1)
    s = np.asarray(scales.astype(jnp.float32))
    assert np.all(s * fmt.qmax >= amax)
    info = jnp.finfo(fmt.scale_dtype)
    ok = amax > float(info.tiny) * fmt.qmax  # normal scales
    assert np.all(s[ok] <= amax[ok] / fmt.qmax * (1 + 2.0 ** -info.nmant) ** 2)


def test_e2m1_codes_decode_to_their_magnitudes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    np.testing.assert_array_equal(np.asarray(kv_quant.e2m1_decode(codes)), mags + [-m for m in mags])
    np.testing.assert_array_equal(np.asarray(kv_quant._e2m1_encode(jnp.asarray(mags + [-m for m in mags[1:]]))),
                                  list(range(8)) + list(range(9, 16)))


def test_nvfp4_packs_a_row_as_two_halves():
    """Byte j holds value j in its low nibble and value j + D/2 in its high one: a row of positive then negative
    values packs positive codes low and negative ones high, each within one scale step of its value."""
    x = np.concatenate([np.arange(1, 17), -np.arange(1, 17)]).astype(np.float32)[None]
    values, scales = kv_quant.quantize(kv_quant.NVFP4_G16, jnp.asarray(x))
    lo, hi = np.asarray(values) & 15, np.asarray(values) >> 4
    assert np.all(lo < 8) and np.all(hi >= 8)  # bit 3 is the sign
    s = np.asarray(scales.astype(jnp.float32))
    assert np.all(np.abs(np.asarray(kv_quant.e2m1_decode(jnp.asarray(lo))) * s[:, :1] - x[:, :16]) <= s[:, :1])
    assert np.all(np.abs(np.asarray(kv_quant.e2m1_decode(jnp.asarray(hi))) * s[:, 1:] - x[:, 16:]) <= s[:, 1:])
