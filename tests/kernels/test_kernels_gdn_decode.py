"""GDN decode kernel (pallas_kernels.gdn_decode) against the float64 recurrence and ops' reference branch,
in Pallas interpret mode on CPU. Fresh random inputs every run; interpret mode fills outputs with NaN
before the kernel runs, so an unwritten element fails the finiteness check; slots no lane owns hold
sentinels compared bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ninfer_jax.model import ops
from kernel_support import lower_for_h200
from pallas_kernels import gdn_decode
from pallas_kernels import reference as ref


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed), seed


def make_step(r, lanes, hk, hv, d):
    q = r.standard_normal((lanes, hk, d))
    k = r.standard_normal((lanes, hk, d))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((lanes, hv, d))
    g = -np.log1p(np.exp(r.standard_normal((lanes, hv))))
    beta = 1.0 / (1.0 + np.exp(-r.standard_normal((lanes, hv))))
    return q, k, v, g, beta


@pytest.mark.parametrize(
    "lanes,hk,hv,d,config",
    [
        (1, 1, 2, 16, None),
        (3, 2, 6, 32, None),
        (8, 2, 4, 64, gdn_decode.GdnDecodeConfig(block_v=16, num_warps=4)),
        (64, 1, 2, 16, None),  # many lanes: nothing assumes C <= 8
    ],
)
def test_matches_float64_recurrence(rng, lanes, hk, hv, d, config):
    r, seed = rng
    n_slots = 2 * lanes + 3
    slots = r.permutation(n_slots)[:lanes].astype(np.int32)  # distinct, scattered
    pool = (r.standard_normal((n_slots, hv, d, d)) * 0.3).astype(np.float32)
    x = make_step(r, lanes, hk, hv, d)
    o, pool_out = jax.jit(gdn_decode.gdn_decode, static_argnames=("interpret", "config"))(
        *(jnp.asarray(a, jnp.float32) for a in x), jnp.asarray(pool), jnp.asarray(slots), interpret=True,
        config=config,
    )
    o, pool_out = np.asarray(o), np.asarray(pool_out)
    assert np.isfinite(o).all(), f"seed={seed}: output not fully written"
    for b in range(lanes):
        o64, s64 = ref.gdn_naive_f64(*(a[b : b + 1] for a in x), pool[slots[b]])
        np.testing.assert_allclose(o[b], o64[0], rtol=1e-5, atol=1e-6, err_msg=f"seed={seed} lane {b}")
        np.testing.assert_allclose(pool_out[slots[b]], s64, rtol=1e-5, atol=1e-6, err_msg=f"seed={seed} lane {b}")
    others = np.setdiff1d(np.arange(n_slots), slots)
    np.testing.assert_array_equal(pool_out[others], pool[others], err_msg=f"seed={seed}: foreign slot written")


def test_identity_token_leaves_state_bitwise(rng):
    """A lane with nothing to decode passes an identity token: its state must not change at all."""
    r, seed = rng
    q, k, v, g, beta = make_step(r, 2, 1, 2, 16)
    k[1], v[1], g[1], beta[1] = 0, 0, 0, 0
    pool = (r.standard_normal((4, 2, 16, 16)) * 0.3).astype(np.float32)
    _, out = gdn_decode.gdn_decode(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)),
                                   jnp.asarray(pool), jnp.array([3, 1], jnp.int32), interpret=True)
    np.testing.assert_array_equal(np.asarray(out)[1], pool[1], err_msg=f"seed={seed}")


def test_ops_dispatch_bf16_matches_reference(rng):
    r, seed = rng
    lanes, hk, hv, d = 4, 2, 4, 32
    x = [jnp.asarray(a, jnp.bfloat16) for a in make_step(r, lanes, hk, hv, d)[:3]]
    x += [jnp.asarray(a, jnp.float32) for a in make_step(r, lanes, hk, hv, d)[3:]]
    pool = jnp.asarray(r.standard_normal((9, hv, d, d)) * 0.3, jnp.float32)
    slots = jnp.array([7, 0, 3, 5], jnp.int32)
    kc = ops.KernelConfig(backend="pallas", interpret=True)
    o_k, p_k = jax.jit(ops.gdn_decode, static_argnums=0)(kc, *x, pool, slots)
    o_r, p_r = jax.jit(ops.gdn_decode, static_argnums=0)(ops.REFERENCE, *x, pool, slots)
    np.testing.assert_allclose(np.asarray(o_k), np.asarray(o_r), rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.asarray(p_k), np.asarray(p_r), rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")


def test_rejects_bad_inputs():
    z = jnp.zeros((2, 1, 16))
    with pytest.raises(ValueError, match="slots"):
        gdn_decode.gdn_decode(z, z, jnp.zeros((2, 2, 16)), jnp.zeros((2, 2)), jnp.zeros((2, 2)),
                              jnp.zeros((3, 2, 16, 16)), jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        gdn_decode.GdnDecodeConfig(block_v=48)


def test_lowers_to_triton_at_real_shapes():
    lower_for_h200()
    sd = jax.ShapeDtypeStruct
    args = (sd((32, 16, 128), jnp.bfloat16), sd((32, 16, 128), jnp.bfloat16), sd((32, 48, 128), jnp.bfloat16),
            sd((32, 48), jnp.float32), sd((32, 48), jnp.float32), sd((64, 48, 128, 128), jnp.float32),
            sd((32,), jnp.int32))
    text = gdn_decode.gdn_decode.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
