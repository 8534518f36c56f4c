"""Shared helpers of the engine-level cache tests: prompts, the resumed-equals-root check, leak checks."""

import threading

import numpy as np

from ninfer_jax.frontend.prepared_prompt import PreparedPrompt, TapHint, prepare_tokens
from oracle import ORACLE_VOCAB


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, ORACLE_VOCAB, n).astype(np.int32).tolist()


def with_hints(ids, *hints) -> PreparedPrompt:
    return prepare_tokens(ids, [TapHint(p, k) for p, k in hints])


def assert_same_output(resumed, reference):
    assert resumed.token_ids == reference.token_ids
    first, ref = resumed.logprobs[0], reference.logprobs[0]
    assert [t for t, _ in first["top"]] == [t for t, _ in ref["top"]]
    np.testing.assert_allclose([lp for _, lp in first["top"]], [lp for _, lp in ref["top"]], atol=1e-5, rtol=0)


def settle_host(engine, *, warmed=True):
    """Invariants, the slab ledger, and nothing leaked: no private page, staging slot, pin or Filling slab."""
    engine.check_ledger()
    stats = engine.stats()
    assert stats["pages"]["active"] == 0 and stats["pages"]["filling"] == 0
    assert stats["requests"]["running"] == 0
    slabs = stats["prefix_cache"]["host_slabs"]
    assert slabs["filling"] == 0
    assert sum(v for k, v in slabs.items() if k != "capacity") == slabs["capacity"]
    if warmed:
        assert stats["compiles_since_warmup"] == 0  # the transfer ops were compiled at startup


def assert_blocks_stored_once(engine, prefix):
    """Each whole 64-token block of `prefix` is one node of the engine's radix tree (so one device page)."""
    tree = engine.cache_manager.index.tree
    for b in range(len(prefix) // 64):
        block = np.asarray(prefix[64 * b: 64 * b + 64], "<i4").tobytes()
        assert sum(1 for n in tree.nodes.values() if n.depth == b and n.tokens == block) == 1


def cancel_mid_prefill(engine, prompt, sampling, request_id="cancel-me"):
    """Submit `prompt` and cancel it at its first progress event, which takes effect after its first prefill chunk;
    returns once it has finished."""
    done = threading.Event()

    def sink(event):
        if event.finish_reason is None and event.usage is not None:
            engine.cancel(request_id)
        if event.finish_reason is not None:
            done.set()

    engine.submit(prompt, sampling, request_id=request_id, sink=sink)
    assert done.wait(120)


def io_error(*args):
    raise OSError(5, "Input/output error")
