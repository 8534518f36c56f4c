"""A one-row projection (a one-lane decode round) reaches the compiler as a two-row matmul with the right value.

XLA's GPU compiler turns a vector x matrix dot into multiply + reduce, which at the 35B-A3B's shapes wrote
the whole [K, N] product out (docs/benchmarks/decode_round_probe.md); `dot` hands it two rows instead."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.model.ops import REFERENCE
from ninfer_jax.model.qwen3_5 import dot


def _operands(x, w):
    text = jax.jit(dot, static_argnums=0).lower(REFERENCE, x, w).as_text()
    return text, re.findall(r"stablehlo\.dot_general.*?: \(tensor<([0-9x]+)xbf16>", text)


def test_one_row_projection_is_a_two_row_matmul_behind_a_barrier():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    text, lhs_shapes = _operands(x, w)
    assert lhs_shapes == ["2x64"]
    assert "optimization_barrier" in text
    got = np.asarray(dot(REFERENCE, x, w), np.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.shape == (1, 48)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-1)


def test_a_product_for_the_norm_keeps_its_duplicate_row():
    """to_norm=True: the two-row matmul's output comes whole (the add + norm kernel reads row 0 only; cutting row 1
    off first would be a copy kernel); both rows are the product."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    got = np.asarray(dot(REFERENCE, x, w, to_norm=True), np.float32)
    assert got.shape == (2, 48)
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[:1], np.asarray(dot(REFERENCE, x, w), np.float32))
    three = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    assert dot(REFERENCE, three, w, to_norm=True).shape == (3, 48)  # more rows: a plain matmul, nothing attached


@pytest.mark.parametrize("rows, k, n", [(3, 64, 48), (1, 6144, 5120)], ids=["three-rows", "27b-o-proj"])
def test_projections_xla_keeps_as_matmuls_are_left_as_they_are(rows, k, n):
    # Wider inputs, and one row times a matrix at or above XLA's rewrite size (the 27B's smallest projection): left
    # as they were.
    x, w = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    text, lhs_shapes = _operands(x, w)
    assert lhs_shapes == [f"{rows}x{k}"]
    assert "optimization_barrier" not in text
