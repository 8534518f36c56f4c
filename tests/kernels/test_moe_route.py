"""The MoE router kernel (`pallas_kernels/moe_route.py`, interpret mode on CPU) against `reference.moe_route_ref`:
the same experts in the same order (ties to the lower expert, as lax.top_k) and the same renormalised weights; and
its Triton lowering at the 35B-A3B's 256 experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.model import ops
from pallas_kernels import _compat, moe_route
from pallas_kernels import reference as ref

INTERPRET = jax.default_backend() == "cpu"


def _case(rows, experts, hidden=32, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32),
            jnp.asarray(rng.standard_normal((experts, hidden)), jnp.float32))


@pytest.mark.parametrize("rows, experts, top_k", [(1, 256, 8), (8, 256, 8), (3, 8, 2), (2, 16, 16)],
                         ids=["35b-one-lane", "35b-eight-lanes", "tiny", "all-experts"])
def test_route_equals_the_reference(rows, experts, top_k):
    x, router = _case(rows, experts, seed=rows * experts)
    want_ids, want_w = ref.moe_route_ref(x, router, top_k)
    got_ids, got_w = moe_route.route(ref.moe_router_logits(x, router), top_k=top_k, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    assert got_ids.dtype == jnp.int32 and got_w.dtype == jnp.float32


def test_tied_logits_take_the_lower_expert_first():
    logits = jnp.asarray([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5, 0.5, 3.0]], jnp.float32)
    ids, weights = moe_route.route(logits, top_k=4, interpret=INTERPRET)
    assert np.asarray(ids).tolist() == [[7, 1, 2, 4]]
    want, want_ids = jax.lax.top_k(jax.nn.softmax(logits), 4)
    assert np.asarray(want_ids).tolist() == [[7, 1, 2, 4]]
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want / want.sum()), rtol=1e-6)


def test_ops_take_the_kernel_only_when_asked_and_able():
    x, router = _case(2, 8)
    on = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_moe_route=True)
    want = ref.moe_route_ref(x, router, 2)
    for kc, rows in ((on, 2), (ops.KernelConfig("pallas", interpret=INTERPRET), 2), (on, ops.DECODE_MAX_ROWS + 1)):
        xr = jnp.resize(x, (rows, x.shape[1]))
        got = ops.moe_route(kc, xr, router, 2)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref.moe_route_ref(xr, router, 2)[0]))
    np.testing.assert_array_equal(np.asarray(ops.moe_route(on, x, router, 2)[0]), np.asarray(want[0]))
    x6, router6 = _case(2, 6)  # six experts: not a power of two, the reference runs
    np.testing.assert_array_equal(np.asarray(ops.moe_route(on, x6, router6, 2)[0]),
                                  np.asarray(ref.moe_route_ref(x6, router6, 2)[0]))
    with pytest.raises(ValueError, match="power-of-two"):
        moe_route.route(jnp.zeros((1, 6), jnp.float32), top_k=2, interpret=True)
    with pytest.raises(ValueError, match="fuse_moe_route"):
        ops.KernelConfig(fuse_moe_route=True)


def test_lowers_to_triton_at_the_35b_shapes():
    _compat.lower_for_h200()
    text = moe_route.route.trace(jax.ShapeDtypeStruct((1, 256), jnp.float32), top_k=8).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "moe_route" in text
