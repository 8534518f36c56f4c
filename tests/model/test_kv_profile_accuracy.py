"""Accuracy of each KV storage profile (spec §3.1) on the tiny model (fp32 weights and activations): a 2048-token
prompt prefilled in chunks through the paged pools, all positions' logits, against the bf16 KV pools.

The bound is first-order: the logits are a smooth function of the stored K and V, so a small storage error moves
them by J·delta, and for errors of the same kind (rounding, zero mean, independent across elements) the RMS of
J·delta grows linearly with the RMS of delta. The bf16 pools calibrate the gain: their logit error against the
exact (fp32) pools per unit of their own K/V error. A profile's logit RMS error is then bounded by that gain times
its K/V RMS error (read from its pools), with a factor 2 for the second-order terms and for rounding that is not
independent; its largest logit error by the same gain on the bf16 pools' largest, with a factor 3 (a maximum is
noisier than an RMS). Greedy agreement follows: at every position where the bf16 KV run's top-2 logit margin
exceeds twice the largest difference the bounds allow between the two runs, the profile's greedy token is the bf16
run's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import ORACLE_VOCAB

from ninfer_jax.model import init_device_state, load_checkpoint, logits, prefill
from ninfer_jax.model.ops import REFERENCE
from pallas_kernels import kv_quant

PROMPT, CHUNK = 2048, 512


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _prefill_logits(params, cfg, tokens, base, page_table, state):
    no_taps = jnp.full((1,), -1, jnp.int32)
    hidden, state = prefill(params, cfg, REFERENCE, tokens, jnp.int32(tokens.shape[0]), base, page_table,
                            jnp.int32(0), state, no_taps, no_taps)
    return logits(params, hidden), state


_dequantized = jax.jit(kv_quant.take)  # one program per format, not one per eager operation


@pytest.fixture(scope="module")
def runs(checkpoint_factory):
    """profile -> (logits [PROMPT, V], the K and V pools' rows dequantized [layers x (K, V)]) of one prompt."""
    cfg, params = load_checkpoint(checkpoint_factory("tiny-dense", "text", seed=7, num_hidden_layers=4,
                              full_attention_interval=4),
                                  dtype="float32")
    prompt = np.random.default_rng(0).integers(0, ORACLE_VOCAB, PROMPT).astype(np.int32)
    pages = jnp.arange(PROMPT // 64, dtype=jnp.int32)
    out = {}
    for profile in ("auto", "bfloat16", "int8", "fp8", "k8v4", "nvfp4"):
        state = init_device_state(cfg, PROMPT // 64, 1, jnp.float32, jnp.float32, profile)
        chunks = []
        for base in range(0, PROMPT, CHUNK):
            lg, state = _prefill_logits(params, cfg, jnp.asarray(prompt[base:base + CHUNK]), jnp.int32(base), pages,
                                        state)
            chunks.append(np.asarray(lg))
        kv = [np.asarray(_dequantized(pool, pages)) for pool in state.k_pages + state.v_pages]
        out[profile] = np.concatenate(chunks), kv
    return out


def _rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


@pytest.mark.parametrize("profile", ["int8", "fp8", "k8v4", "nvfp4"])
def test_profile_logits_within_the_first_order_bound_of_bf16_kv(runs, profile):
    exact, exact_kv = runs["auto"]
    (bf16, bf16_kv), (got, got_kv) = runs["bfloat16"], runs[profile]
    kv_error = {name: _rms([a - b for a, b in zip(kv, exact_kv)]) for name, kv in (("bf16", bf16_kv), ("p", got_kv))}
    assert 0 < kv_error["bf16"] < kv_error["p"]
    ratio = kv_error["p"] / kv_error["bf16"]
    rms_bound = 2 * ratio * _rms(bf16 - exact)
    max_bound = 3 * ratio * np.abs(bf16 - exact).max()
    assert _rms(got - exact) <= rms_bound, (profile, _rms(got - exact), rms_bound)
    assert np.abs(got - exact).max() <= max_bound, (profile, np.abs(got - exact).max(), max_bound)
    top2 = np.sort(bf16, axis=-1)[:, -2:]
    # |got - bf16| <= max_bound + |bf16 - exact|: a larger margin of bf16's keeps its greedy token
    clear = top2[:, 1] - top2[:, 0] > 2 * (max_bound + np.abs(bf16 - exact).max())
    assert clear.mean() > 0.25  # the bound decides a good share of the positions
    np.testing.assert_array_equal(got[clear].argmax(-1), bf16[clear].argmax(-1))
