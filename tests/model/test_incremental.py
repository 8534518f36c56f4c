"""Chunked prefill with carried conv state, recurrent state and paged KV equals one pass; greedy decode
through the batched decode step equals HF transformers' greedy generate."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from oracle import ORACLE_VOCAB, hf_model
from ninfer_jax.model import decode, forward, init_device_state, load_checkpoint, logits, prefill
from ninfer_jax.model.ops import REFERENCE, KernelConfig

PROMPT_LEN = 203
MAX_PAGES = 8


@functools.partial(jax.jit, static_argnames=("cfg", "kc"), donate_argnames=("state",))
def _prefill_logits(params, cfg, tokens, n_valid, base, page_table, slot, state, kc=REFERENCE):
    no_taps = jnp.full((1,), -1, jnp.int32)
    hidden, state = prefill(params, cfg, kc, tokens, n_valid, base, page_table, slot, state, no_taps, no_taps)
    return logits(params, hidden), state


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _decode_logits(params, cfg, tokens, positions, page_tables, slots, active, state):
    hidden, state = decode(params, cfg, REFERENCE, tokens, positions, page_tables, slots, active, state)
    return logits(params, hidden), state


@functools.partial(jax.jit, static_argnames=("cfg", "kc"))
def _decode_logits_with(params, cfg, kc, tokens, positions, page_tables, slots, active, state):
    hidden, state = decode(params, cfg, kc, tokens, positions, page_tables, slots, active, state)
    return logits(params, hidden), state


def _chunked_prefill(params, cfg, tokens, chunk, state, slot, page_table, kc=REFERENCE):
    """Prefill `tokens` in chunks of `chunk` (the last padded to the same shape); all logits."""
    out = []
    for base in range(0, len(tokens), chunk):
        piece = tokens[base : base + chunk]
        padded = np.zeros(chunk, np.int32)
        padded[: len(piece)] = piece
        lg, state = _prefill_logits(
            params, cfg, jnp.asarray(padded), jnp.int32(len(piece)), jnp.int32(base), page_table,
            jnp.int32(slot), state, kc=kc,
        )
        out.append(np.asarray(lg)[: len(piece)])
    return np.concatenate(out), state


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def model(request, checkpoint_factory):
    directory = checkpoint_factory(request.param, "text", seed=21)
    cfg, params = load_checkpoint(directory, dtype="float32")
    return directory, cfg, params


@pytest.mark.parametrize("chunk", [1, 17, 64, 100])
def test_chunked_prefill_equals_one_pass(model, chunk):
    _, cfg, params = model
    tokens = np.random.default_rng(chunk).integers(0, ORACLE_VOCAB, PROMPT_LEN).astype(np.int32)
    whole = np.asarray(forward(params, cfg, tokens))
    # Two slots and shuffled pages: the lane must read only its own slot and its own pages.
    state = init_device_state(cfg, num_pages=MAX_PAGES + 2, num_slots=2, kv_dtype=jnp.float32,
                              conv_dtype=jnp.float32)
    page_table = jnp.asarray(np.random.default_rng(0).permutation(MAX_PAGES + 2)[:MAX_PAGES], jnp.int32)
    pieces, _ = _chunked_prefill(params, cfg, tokens, chunk, state, slot=1, page_table=page_table)
    chex.assert_trees_all_close(pieces, whole, atol=1e-5, rtol=0)


def test_chunked_prefill_with_the_fused_gdn_conv_matches_the_references(model):
    """The Pallas kernels (interpret mode) with the GDN conv kernel: chunks of 100 carry the conv history across
    their boundary and the last one is mostly padding; logits equal the references', and so does the state each path
    leaves (conv history, recurrent state, KV pages)."""
    _, cfg, params = model
    tokens = np.random.default_rng(3).integers(0, ORACLE_VOCAB, PROMPT_LEN).astype(np.int32)
    def fresh():  # each path donates its own
        return init_device_state(cfg, num_pages=MAX_PAGES + 2, num_slots=2, kv_dtype=jnp.float32,
                                 conv_dtype=jnp.float32)

    page_table = jnp.asarray(np.arange(MAX_PAGES), jnp.int32)
    fused = KernelConfig("pallas", interpret=True, fuse_gdn_conv=True)
    want, want_state = _chunked_prefill(params, cfg, tokens, 100, fresh(), slot=1, page_table=page_table)
    got, got_state = _chunked_prefill(params, cfg, tokens, 100, fresh(), slot=1, page_table=page_table, kc=fused)
    chex.assert_trees_all_close(got, want, atol=2e-4, rtol=0)
    chex.assert_trees_all_close(got_state, want_state, atol=2e-4, rtol=0)


def test_greedy_decode_matches_transformers_generate(model):
    directory, cfg, params = model
    lanes, new_tokens = 3, 32
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, ORACLE_VOCAB, n).astype(np.int32) for n in (70, 131, 29)]
    state = init_device_state(cfg, num_pages=lanes * 4, num_slots=lanes, kv_dtype=jnp.float32,
                              conv_dtype=jnp.float32)
    tables = np.arange(lanes * 4, dtype=np.int32).reshape(lanes, 4)
    generated = [[] for _ in range(lanes)]
    for lane, prompt in enumerate(prompts):
        lg, state = _chunked_prefill(params, cfg, prompt, 64, state, lane, jnp.asarray(tables[lane]))
        generated[lane].append(int(lg[-1].argmax()))
    positions = np.array([len(p) for p in prompts], np.int32)
    for step in range(new_tokens - 1):
        # Lane 1 sits out one step in three: inactive lanes must be left untouched.
        active = np.array([True, step % 3 != 2, True])
        last = np.array([g[-1] for g in generated], np.int32)
        lg, state = _decode_logits(
            params, cfg, jnp.asarray(last), jnp.asarray(positions), jnp.asarray(tables),
            jnp.arange(lanes, dtype=jnp.int32), jnp.asarray(active), state,
        )
        lg = np.asarray(lg)
        for lane in range(lanes):
            if active[lane]:
                generated[lane].append(int(lg[lane].argmax()))
                positions[lane] += 1
    hf = hf_model(directory)
    for lane, prompt in enumerate(prompts):
        want = len(generated[lane])
        with torch.no_grad():
            out = hf.generate(
                torch.tensor(prompt)[None].long(), max_new_tokens=want, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        assert generated[lane] == out[0, len(prompt):].tolist(), f"lane {lane}"
    assert min(len(g) for g in generated) >= 20


@pytest.mark.parametrize("fused", [False, True], ids=["kernels", "fused-gdn-layer-and-norms"])
@pytest.mark.parametrize("lanes", [1, 3])
def test_decode_with_the_pallas_kernels_matches_the_references(model, lanes, fused):
    """The decode step on the Pallas kernels (interpret mode): one lane takes the MoE matrix-vector kernels with
    the shared expert as an extra row, attention and GDN their decode kernels (fused: the GDN layer's one kernel, the
    add + norm kernels, the router kernel, the attention's gated merge and at one lane the GDN out-projection
    normalizing its input and the attention's out-projection row written twice); the logits
    equal the references' over a few steps, each path carrying its own state."""
    _, cfg, params = model
    rng = np.random.default_rng(lanes)
    state = init_device_state(cfg, num_pages=lanes * 4, num_slots=lanes, kv_dtype=jnp.float32,
                              conv_dtype=jnp.float32)
    tables = np.arange(lanes * 4, dtype=np.int32).reshape(lanes, 4)
    last = []
    for lane in range(lanes):
        prompt = rng.integers(0, ORACLE_VOCAB, 40 + 23 * lane).astype(np.int32)
        lg, state = _chunked_prefill(params, cfg, prompt, 64, state, lane, jnp.asarray(tables[lane]))
        last.append(int(lg[-1].argmax()))
    positions = np.array([40 + 23 * lane for lane in range(lanes)], np.int32)
    states = {"reference": state, "pallas": state}
    kernels = {"reference": REFERENCE, "pallas": KernelConfig("pallas", interpret=True, fuse_gdn_decode=fused,
                                                          fuse_add_norm=fused, fuse_moe_route=fused,
                                                          fuse_attn_qkv=fused, fuse_gdn_out=fused,
                                                          fuse_attn_out=fused)}
    for _ in range(3):
        out = {}
        for name, kc in kernels.items():
            out[name], states[name] = _decode_logits_with(
                params, cfg, kc, jnp.asarray(last, jnp.int32), jnp.asarray(positions), jnp.asarray(tables),
                jnp.arange(lanes, dtype=jnp.int32), jnp.ones(lanes, bool), states[name])
        chex.assert_trees_all_close(out["pallas"], out["reference"], atol=2e-4, rtol=0)
        last = np.asarray(out["reference"]).argmax(-1).astype(np.int32).tolist()
        positions += 1
