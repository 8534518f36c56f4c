"""The GDN out-projection with its gated norm inside (pallas_kernels/gdn_out_proj.py) against a float64 reference of
the same: the normed rows as `reference.gated_rms_norm` rounds them, times w. z is read in place from the
in-projection's output; value heads that the configured splits do not divide take fewer splits."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_support import INTERPRET
from pallas_kernels import gdn_out_proj
from pallas_kernels.reference import gated_rms_norm

C, EPS = 48, 1e-6  # the pre-conv channels before z in the in-projection's output


def _case(rows, hv, dv, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    o = jnp.asarray(rng.standard_normal((rows, hv, dv)) * 3, dtype)
    proj = jnp.asarray(rng.standard_normal((rows, C + hv * dv + 2 * hv)), dtype)
    norm_w = jnp.asarray(rng.random(dv) + 0.5, dtype)
    w = jnp.asarray(rng.standard_normal((hv * dv, n)) * (hv * dv) ** -0.5, dtype)
    return o, proj, norm_w, w


def _want(o, proj, norm_w, w):
    rows, hv, dv = o.shape
    y = gated_rms_norm(o, proj[:, C:C + hv * dv].reshape(rows, hv, dv), norm_w, EPS).reshape(rows, -1)
    return np.asarray(y, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("rows,hv,splits", [(1, 4, 4), (2, 6, 4)], ids=["one-row", "heads-past-the-splits"])
def test_gated_out_projection_matches_float64(rows, hv, splits):
    o, proj, norm_w, w = _case(rows, hv, 32, 64, jnp.float32, seed=hv)
    cfg = gdn_out_proj.GdnOutConfig(block_n=32, splits=splits)
    got = gdn_out_proj.gdn_out_proj(o, proj, norm_w, w, z_col=C, eps=EPS, config=cfg, interpret=INTERPRET)
    want = _want(o, proj, norm_w, w)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bf16_rows_stay_within_the_outputs_rounding():
    o, proj, norm_w, w = _case(1, 4, 32, 128, jnp.bfloat16)
    got = gdn_out_proj.gdn_out_proj(o, proj, norm_w, w, z_col=C, eps=EPS, interpret=INTERPRET)
    assert got.dtype == jnp.bfloat16
    want = _want(o, proj, norm_w, w)
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 2.0**-8 * np.abs(want).max()


def test_shapes_the_kernel_cannot_take_are_refused():
    o, proj, norm_w, w = _case(1, 4, 32, 64, jnp.float32)
    assert not gdn_out_proj.supported(o.shape, (4 * 32, 48))  # N off the column block
    with pytest.raises(ValueError, match="must be \\[Hv Dv, N\\]"):
        gdn_out_proj.gdn_out_proj(o, proj, norm_w, w[:96], z_col=C, eps=EPS, interpret=INTERPRET)
    with pytest.raises(ValueError, match="do not hold z"):
        gdn_out_proj.gdn_out_proj(o, proj[:, :C + 64], norm_w, w, z_col=C, eps=EPS, interpret=INTERPRET)
