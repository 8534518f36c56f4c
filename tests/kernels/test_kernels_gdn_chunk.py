"""Chunked GDN prefill kernel (pallas_kernels.gdn_chunk) against a float64 naive recurrence and the jnp
reference, in Pallas interpret mode on CPU (the same kernels the H200 runs through Triton).

Fresh random inputs every run (the seed is in every failure message). Outputs are poisoned: interpret
mode fills kernel outputs with NaN before the kernel runs, and tap slots of the state pool are NaN on
entry, so every element that must be written is checked to be finite. Slots that must not be written
hold sentinels and are compared bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ninfer_jax.model import ops
from kernel_support import lower_for_h200
from pallas_kernels import gdn_chunk
from pallas_kernels import reference as ref

PAGE = 64
HK, HV, D = 1, 2, 16  # tiny: the phase sweep runs 64 calls per length
M = 4  # static tap count
SLOT = 0
TAP_SLOTS = np.arange(1, M + 1, dtype=np.int32)
N_SLOTS = M + 3  # two sentinel slots that nothing may touch
FUSED = gdn_chunk.GdnChunkConfig()
SPLIT = gdn_chunk.GdnChunkConfig(fuse_output=False)


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed), seed


def make_inputs(r, t, hk=HK, hv=HV, d=D):
    q = r.standard_normal((t, hk, d))
    k = r.standard_normal((t, hk, d))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((t, hv, d))
    g = -np.log1p(np.exp(r.standard_normal((t, hv)) - 1.0))  # -softplus: log decay < 0
    beta = 1.0 / (1.0 + np.exp(-r.standard_normal((t, hv))))
    return q, k, v, g, beta


def make_pool(r, hv=HV, d=D):
    pool = r.standard_normal((N_SLOTS, hv, d, d)) * 0.3
    pool[TAP_SLOTS] = np.nan  # must be written by valid taps
    return pool.astype(np.float32)


def taps_for(base, t):
    """All 64-aligned positions in (base, base + T], up to M, padded with -1; plus the oracle indices."""
    first = (base // PAGE + 1) * PAGE
    pos = [p for p in range(first, base + t + 1, PAGE)][:M]
    return np.array(pos + [-1] * (M - len(pos)), np.int32), pos


def identity_after(x, n):
    """Inputs with every token from n on replaced by identity tokens (k = v = g = beta = 0)."""
    q, k, v, g, beta = (np.array(a) for a in x)
    for a in (k, v, g, beta):
        a[n:] = 0
    return q, k, v, g, beta


_call = jax.jit(gdn_chunk.chunk_gated_delta_rule, static_argnames=("interpret", "config"))


def run(x, pool, base, taps, config=FUSED, dtype=jnp.float32):
    q, k, v, g, beta = x
    o, pool = _call(
        jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g, jnp.float32),
        jnp.asarray(beta, jnp.float32), jnp.asarray(pool), jnp.int32(SLOT), jnp.int32(base),
        jnp.asarray(taps), jnp.asarray(TAP_SLOTS), interpret=True, config=config,
    )
    return np.asarray(o), np.asarray(pool)


def check_against_oracle(x, pool_in, base, o, pool_out, tol, msg):
    """o, final state and every tap against the float64 recurrence; untouched slots bitwise."""
    q, k, v, g, beta = x
    t = v.shape[0]
    taps, pos = taps_for(base, t)
    o64, final64, states64 = ref.gdn_naive_f64(q, k, v, g, beta, pool_in[SLOT], record_states=True)
    assert np.isfinite(o).all(), f"{msg}: output not fully written"
    scale = np.abs(o64).max() + 1e-6
    assert np.abs(o - o64).max() / scale < tol, f"{msg}: o err {np.abs(o - o64).max() / scale:.2e}"
    s_scale = np.abs(final64).max()
    assert np.abs(pool_out[SLOT] - final64).max() / s_scale < tol, f"{msg}: final state"
    for j, p in enumerate(pos):
        tap = pool_out[TAP_SLOTS[j]]
        assert np.isfinite(tap).all(), f"{msg}: tap {p} not written"
        err = np.abs(tap - states64[p - base]).max() / s_scale
        assert err < tol, f"{msg}: tap {p} err {err:.2e}"
    for j in range(len(pos), M):  # invalid taps write nothing (slot stays NaN-poisoned)
        assert np.isnan(pool_out[TAP_SLOTS[j]]).all(), f"{msg}: unused tap slot {TAP_SLOTS[j]} written"
    np.testing.assert_array_equal(pool_out[M + 1 :], pool_in[M + 1 :], err_msg=f"{msg}: sentinel slots")
    return taps, pos


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_taps_every_phase(rng, t):
    """Every phase 0..63 (base = phase): o, final state and taps vs float64; each tap bitwise equal to
    the final state of the same-phase call whose tokens after the tap are identity tokens."""
    r, seed = rng
    x = make_inputs(r, t)
    pool = make_pool(r)
    for phase in range(PAGE):
        msg = f"seed={seed} T={t} phase={phase}"
        o, pool_out = run(x, pool, phase, taps_for(phase, t)[0])
        taps, pos = check_against_oracle(x, pool, phase, o, pool_out, 2e-5, msg)
        for j, p in enumerate(pos):
            _, pool_tr = run(identity_after(x, p - phase), pool, phase, taps)
            np.testing.assert_array_equal(
                pool_tr[SLOT], pool_out[TAP_SLOTS[j]], err_msg=f"{msg}: tap {p} != identity-padded call"
            )


@pytest.mark.parametrize("t", [65, 200])
def test_tap_bitwise_equals_truncated_call(rng, t):
    """The literal §10.7 property: a tap equals the final state of a separate, shorter call ending at
    the tap with the same phase (a new static length per case, so a few random cases per run)."""
    r, seed = rng
    x = make_inputs(r, t)
    pool = make_pool(r)
    phases = {0, PAGE - 1, int(r.integers(1, PAGE - 1))}
    for phase in sorted(phases):
        taps, pos = taps_for(phase, t)
        _, pool_out = run(x, pool, phase, taps)
        j = int(r.integers(len(pos)))
        n = pos[j] - phase
        _, pool_tr = run(tuple(a[:n] for a in x), pool, phase, taps)
        np.testing.assert_array_equal(
            pool_tr[SLOT], pool_out[TAP_SLOTS[j]],
            err_msg=f"seed={seed} T={t} phase={phase} tap {pos[j]}: tap != truncated call",
        )


@pytest.mark.parametrize("phase", [0, 5, 63])
def test_split_variant(rng, phase):
    """The split variant (per-chunk states + parallel output kernel) computes the same function, and its
    taps are the same values as the fused variant's."""
    r, seed = rng
    x = make_inputs(r, 200)
    pool = make_pool(r)
    taps = taps_for(phase, 200)[0]
    o, pool_out = run(x, pool, phase, taps, config=SPLIT)
    check_against_oracle(x, pool, phase, o, pool_out, 2e-5, f"seed={seed} split phase={phase}")
    _, pool_fused = run(x, pool, phase, taps)
    np.testing.assert_allclose(pool_out[: M + 1], pool_fused[: M + 1], rtol=1e-5, atol=1e-6)


def test_gqa_and_bf16(rng):
    """Hv = 3 Hk (value head j reads key head j // 3), bf16 inputs with bf16 matrix operands."""
    r, seed = rng
    hk, hv, d, t, base = 2, 6, 32, 150, 70
    x = make_inputs(r, t, hk, hv, d)
    pool = (r.standard_normal((N_SLOTS, hv, d, d)) * 0.3).astype(np.float32)
    pool[TAP_SLOTS] = np.nan
    taps = taps_for(base, t)[0]
    xb = tuple(np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in x[:3]) + x[3:]
    o, pool_out = run(xb, pool, base, taps, dtype=jnp.bfloat16)
    assert o.dtype == jnp.bfloat16  # the output takes v's dtype
    check_against_oracle(xb, pool, base, o.astype(np.float32), pool_out, 2e-2, f"seed={seed} bf16 gqa")
    o32, pool32 = run(xb, pool, base, taps)
    check_against_oracle(xb, pool, base, o32, pool32, 2e-5, f"seed={seed} f32 gqa")


def test_the_recurrence_takes_wider_tiles_and_deeper_pipelining_with_two_byte_q_and_k():
    """3 load stages only with 2-byte q and k (4-byte ones overflow the H200's shared memory); block_v 64 where it
    still gives 96 programs (the 27B's 48 value heads), else 32; explicit knobs win; never wider than Dv."""
    auto = gdn_chunk.GdnChunkConfig()
    assert auto.recurrent_tiles(48, 128, jnp.bfloat16) == (64, 3)
    assert auto.recurrent_tiles(32, 128, jnp.bfloat16) == (32, 3)
    assert auto.recurrent_tiles(48, 128, jnp.float32) == (32, 2)
    assert auto.recurrent_tiles(2, 16, jnp.bfloat16) == (16, 3)
    assert gdn_chunk.GdnChunkConfig(block_v=16, num_stages=1).recurrent_tiles(48, 128, jnp.bfloat16) == (16, 1)


def test_wider_recurrent_tiles_compute_the_same_function(rng):
    """block_v 64 over Dv 64 (one program a head) against the float64 recurrence, the taps too."""
    r, seed = rng
    hk, hv, d, t, base = 1, 2, 64, 130, 29
    x = make_inputs(r, t, hk, hv, d)
    pool = make_pool(r, hv, d)
    o, pool_out = run(x, pool, base, taps_for(base, t)[0], config=gdn_chunk.GdnChunkConfig(block_v=64))
    check_against_oracle(x, pool, base, o, pool_out, 2e-5, f"seed={seed} block_v 64")


def test_ops_dispatch_matches_reference(rng):
    """ops.gdn_prefill's pallas branch against its reference branch (same pool semantics)."""
    r, seed = rng
    t, base = 130, 100
    x = [jnp.asarray(a, jnp.float32) for a in make_inputs(r, t)]
    pool = jnp.asarray(r.standard_normal((N_SLOTS, HV, D, D)) * 0.3, jnp.float32)
    taps = jnp.array([128, 192, 256, -1], jnp.int32)
    kc = ops.KernelConfig(backend="pallas", interpret=True)
    args = (*x, pool, jnp.int32(SLOT), jnp.int32(base), taps, jnp.asarray(TAP_SLOTS))
    o_k, pool_k = jax.jit(ops.gdn_prefill, static_argnums=0)(kc, *args)
    o_r, pool_r = jax.jit(ops.gdn_prefill, static_argnums=0)(ops.REFERENCE, *args)
    np.testing.assert_allclose(np.asarray(o_k), np.asarray(o_r), rtol=1e-4, atol=1e-5, err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.asarray(pool_k), np.asarray(pool_r), rtol=1e-4, atol=1e-5, err_msg=f"seed={seed}")


def test_the_reference_chunked_form_and_its_chunk_states_equal_the_float64_recurrence(rng):
    """The jnp reference's chunked (UT) form, whose (I + A)^-1 is built by matmuls alone, at a phase of 37 over
    three chunks: o, the final state and each chunk's end state against the float64 recurrence."""
    r, seed = rng
    t, phase = 150, 37
    x = make_inputs(r, t)
    state = r.standard_normal((HV, D, D)) * 0.3
    o, final, chunk_states = ref.gdn_chunked_ref(*(jnp.asarray(a, jnp.float32) for a in x),
                                                 jnp.asarray(state, jnp.float32), phase=phase,
                                                 return_chunk_states=True)
    o64, final64, states64 = ref.gdn_naive_f64(*x, state, record_states=True)
    tol = 2e-5
    assert np.abs(np.asarray(o) - o64).max() / np.abs(o64).max() < tol, f"seed={seed}"
    scale = np.abs(final64).max()
    assert np.abs(np.asarray(final) - final64).max() / scale < tol, f"seed={seed}"
    ends = [PAGE * (i + 1) - phase for i in range(len(chunk_states))]  # the last one is the padded end: t
    assert ends[:2] == [27, 91] and len(ends) == 3
    for i, end in enumerate(ends[:2]):
        assert np.abs(np.asarray(chunk_states[i]) - states64[end]).max() / scale < tol, f"seed={seed} chunk {i}"


def test_rejects_bad_inputs():
    q = jnp.zeros((8, 1, 16))
    v = jnp.zeros((8, 3, 16))
    g = jnp.zeros((8, 3))
    pool = jnp.zeros((2, 3, 16, 16))
    none = jnp.full((1,), -1, jnp.int32)
    with pytest.raises(ValueError, match="power of 2"):
        gdn_chunk.chunk_gated_delta_rule(jnp.zeros((8, 1, 24)), jnp.zeros((8, 1, 24)), v, g, g, pool, 0, 0,
                                         none, none, interpret=True)
    with pytest.raises(ValueError, match="state_pool"):
        gdn_chunk.chunk_gated_delta_rule(q, q, v, g, g, pool.astype(jnp.bfloat16), 0, 0, none, none,
                                         interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        gdn_chunk.GdnChunkConfig(block_v=8)


@pytest.mark.parametrize("config, hv", [(FUSED, 48), (FUSED, 32), (SPLIT, 48)], ids=["fused-27b", "fused-35b", "split"])
def test_lowers_to_triton_at_real_shapes(config, hv):
    """The GPU path (Triton IR) builds at the 27B's and 35B-A3B's heads with 8 taps (block_v 64 and 32, 3 stages):
    unsupported primitives or shapes fail here, in CI, without a GPU."""
    lower_for_h200()
    sd = jax.ShapeDtypeStruct
    t, hk, d = 4096, 16, 128
    args = (sd((t, hk, d), jnp.bfloat16), sd((t, hk, d), jnp.bfloat16), sd((t, hv, d), jnp.bfloat16),
            sd((t, hv), jnp.float32), sd((t, hv), jnp.float32), sd((4, hv, d, d), jnp.float32),
            sd((), jnp.int32), sd((), jnp.int32), sd((8,), jnp.int32), sd((8,), jnp.int32))
    fn = jax.jit(gdn_chunk.chunk_gated_delta_rule, static_argnames=("interpret", "config"))
    text = fn.trace(*args, config=config).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
