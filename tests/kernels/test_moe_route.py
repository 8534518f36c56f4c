"""The MoE router kernel (`pallas_kernels/moe_route.py`, interpret mode on CPU) against `reference.moe_route_ref`:
the same experts in the same order (ties to the lower expert, as lax.top_k) and the same renormalised weights; and
its Triton lowering at the 35B-A3B's 256 experts; and the one-lane experts routing inside their first kernel
(`moe.moe_experts_routed`) against the router kernel, then the experts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.model import ops
from kernel_support import INTERPRET, lower_for_h200
from pallas_kernels import moe, moe_route
from pallas_kernels import reference as ref



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
        assert got[2] is None  # no shared gate asked for
    np.testing.assert_array_equal(np.asarray(ops.moe_route(on, x, router, 2)[0]), np.asarray(want[0]))
    x6, router6 = _case(2, 6)  # six experts: not a power of two, the reference runs
    np.testing.assert_array_equal(np.asarray(ops.moe_route(on, x6, router6, 2)[0]),
                                  np.asarray(ref.moe_route_ref(x6, router6, 2)[0]))
    with pytest.raises(ValueError, match="power-of-two"):
        moe_route.route(jnp.zeros((1, 6), jnp.float32), top_k=2, interpret=True)
    with pytest.raises(ValueError, match="fuse_moe_route"):
        ops.KernelConfig(fuse_moe_route=True)


@pytest.mark.parametrize("shared", [False, True], ids=["router", "router-and-shared-gate"])
def test_lowers_to_triton_at_the_35b_shapes(shared):
    lower_for_h200()
    spec = jax.ShapeDtypeStruct
    gate = (spec((1, 2048), jnp.bfloat16), spec((2048, 1), jnp.bfloat16)) if shared else ()
    text = moe_route.route.trace(spec((1, 256), jnp.float32), *gate, top_k=8).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "moe_route" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_route_also_computes_the_shared_expert_gate(rows, dtype):
    """Given the rows and the shared expert's gate [H, 1], the kernel returns its weight per token: sigmoid of the
    gate's projection rounded to the rows' dtype (reference.shared_expert_gate), with the same routing."""
    x, router = _case(rows, 16, hidden=64, seed=rows)
    x = x.astype(dtype)
    gate_w = jnp.asarray(np.random.default_rng(7).standard_normal((64, 1)) * 0.3, dtype)
    logits = ref.moe_router_logits(x, router)
    ids, weights, shared = moe_route.route(logits, x, gate_w, top_k=4, interpret=INTERPRET)
    want_ids, want_w = ref.moe_route_logits_ref(logits, 4)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    want_shared = ref.shared_expert_gate(x, gate_w)
    assert shared.shape == (rows,) and shared.dtype == jnp.float32
    # the dot product's sum order differs from XLA's: within one rounding of the rows' dtype, before the sigmoid
    tol = 1e-6 if dtype == jnp.float32 else 4e-3
    np.testing.assert_allclose(np.asarray(shared), np.asarray(want_shared), rtol=tol, atol=tol)
    # and through ops, which the model calls
    on = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_moe_route=True)
    got = ops.moe_route(on, x, router, 4, gate_w)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want_shared), rtol=tol, atol=tol)
    off = ops.moe_route(ops.KernelConfig("pallas", interpret=INTERPRET), x, router, 4, gate_w)
    np.testing.assert_array_equal(np.asarray(off[2]), np.asarray(want_shared))


def test_router_logits_equal_float64():
    """bf16 operands accumulated in float32: the products are exact, so the logits are the float64 dot products of
    the bf16 values to float32 accuracy."""
    x, router = (a.astype(jnp.bfloat16) for a in _case(3, 16, hidden=256, seed=3))
    want = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    got = ref.moe_router_logits(x, router)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_shared_gate_needs_a_power_of_two_hidden_size():
    logits = jnp.zeros((1, 8), jnp.float32)
    assert not moe_route.supported(logits, 2, jnp.zeros((1, 48)))
    with pytest.raises(ValueError, match="power-of-two H"):
        moe_route.route(logits, jnp.zeros((1, 48)), jnp.zeros((48, 1)), top_k=2, interpret=True)
    x, router = _case(1, 8, hidden=48)  # through ops the reference takes it
    on = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_moe_route=True)
    gate_w = jnp.ones((48, 1), jnp.float32) * 0.01
    np.testing.assert_allclose(np.asarray(ops.moe_route(on, x, router, 2, gate_w)[2]),
                               np.asarray(ref.shared_expert_gate(x, gate_w)))


def _experts(rng, experts, hidden, inter, dtype):
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) * hidden**-0.5, dtype)

    return w(experts, hidden, 2 * inter), w(experts, inter, hidden), w(hidden, 2 * inter), w(inter, hidden)


@pytest.mark.parametrize("tokens, dtype, shared", [(1, jnp.bfloat16, True), (2, jnp.float32, False)],
                         ids=["one-lane-with-shared", "two-lanes"])
def test_experts_routing_in_their_first_kernel_equal_the_router_kernel_then_the_experts(tokens, dtype, shared):
    """`moe.moe_experts_routed` chooses each token's experts inside the matrix-vector gate_up kernel: the same ids,
    weights and shared gate as `route`, and the same layer output to the bit (the same kernels' arithmetic)."""
    rng = np.random.default_rng(tokens)
    experts, top_k, hidden, inter = 16, 4, 64, 32
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    logits = ref.moe_router_logits(x, jnp.asarray(rng.standard_normal((experts, hidden)), dtype))
    gate_up, down, s_gate_up, s_down = _experts(rng, experts, hidden, inter, dtype)
    gate_w = jnp.asarray(rng.standard_normal((hidden, 1)) * 0.3, dtype) if shared else None
    routed = moe_route.route(logits, x if shared else None, gate_w, top_k=top_k, interpret=INTERPRET)
    ids, weights = routed[:2]
    with_gate = ref.SharedExpert(s_gate_up, s_down, routed[2]) if shared else None
    want = moe.moe_experts(x, ids, weights, gate_up, down, with_gate, interpret=INTERPRET)
    no_gate = ref.SharedExpert(s_gate_up, s_down, None) if shared else None
    out, got_ids, got_w = moe.moe_experts_routed(x, logits, gate_up, down, no_gate, gate_w, top_k=top_k,
                                                 interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(weights))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    # ops takes it only when asked, and only for the matrix-vector path's rows
    on = ops.KernelConfig("pallas", interpret=INTERPRET, fuse_moe_route=True)
    router = jnp.asarray(rng.standard_normal((experts, hidden)), dtype)
    got = ops.moe_routed_experts(on, x, router, top_k, gate_up, down, no_gate, gate_w)
    ids, weights, gate = ops.moe_route(on, x, router, top_k, gate_w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(moe.moe_experts(
        x, ids, weights, gate_up, down, ref.SharedExpert(s_gate_up, s_down, gate) if shared else None,
        interpret=INTERPRET)))
    assert ops.moe_routed_experts(ops.KernelConfig("pallas", interpret=INTERPRET), x, router, top_k, gate_up, down,
                                  no_gate, gate_w) is None
    wide = jnp.resize(x, (moe.DEFAULT_CONFIG.gemv_max_rows // top_k + 1, hidden))
    assert ops.moe_routed_experts(on, wide, router, top_k, gate_up, down, no_gate, gate_w) is None


def test_routed_experts_refuse_what_the_router_kernel_cannot_take():
    rng = np.random.default_rng(0)
    gate_up, down, s_gate_up, s_down = _experts(rng, 16, 64, 32, jnp.float32)
    x, logits = jnp.zeros((1, 64), jnp.float32), jnp.zeros((1, 16), jnp.float32)
    with pytest.raises(ValueError, match="logits"):
        moe.moe_experts_routed(x, logits.astype(jnp.bfloat16), gate_up, down, top_k=4, interpret=True)
    with pytest.raises(ValueError, match="gate"):
        moe.moe_experts_routed(x, logits, gate_up, down, ref.SharedExpert(s_gate_up, s_down, None), top_k=4,
                               interpret=True)
    with pytest.raises(ValueError, match="matrix-vector"):
        moe.moe_experts_routed(jnp.zeros((5, 64), jnp.float32), jnp.zeros((5, 16), jnp.float32), gate_up, down,
                               top_k=4, interpret=True)


def test_routed_experts_lower_to_triton_at_the_35b_shapes():
    lower_for_h200()
    spec = jax.ShapeDtypeStruct
    e, h, i = 256, 2048, 512
    shared = ref.SharedExpert(spec((h, 2 * i), jnp.bfloat16), spec((i, h), jnp.bfloat16), None)
    text = moe.moe_experts_routed.trace(
        spec((1, h), jnp.bfloat16), spec((1, e), jnp.float32), spec((e, h, 2 * i), jnp.bfloat16),
        spec((e, i, h), jnp.bfloat16), shared, spec((h, 1), jnp.bfloat16), top_k=8).lower(
        lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "([^"]*)"', text)) == {"moe_gemv_route_gate_up", "moe_gemv_down"}
