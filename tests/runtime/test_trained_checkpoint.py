"""The trained tiny checkpoint (`scripts/train_tiny_mtp.py`, stored in the package): it loads with its MTP layer,
and on Python code that layer's drafts are mostly kept, while greedy tokens stay those of decoding without them."""

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.model.tiny import trained_checkpoint

PROMPT = 'import os\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n'


def test_the_trained_checkpoints_mtp_drafts_are_mostly_kept_and_change_no_token():
    path = trained_checkpoint()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(kernels="reference", max_concurrency=1, max_model_len=256, no_prefix_reuse=True, warmup=False)
    plain = Engine.from_pretrained(path, **common)
    mtp = Engine.from_pretrained(path, speculative="mtp", num_speculative_tokens=1, **common)
    try:
        ids = plain.tokenizer.encode(PROMPT)
        want = plain.generate(ids, greedy)
        got = mtp.generate(ids, greedy)
        assert got.token_ids == want.token_ids
        spec = mtp.stats()["speculative"]
        # The training run measured 56% agreement of the MTP argmax with the next target token on held-out code;
        # random weights of the same config keep 0 of 138 (the script's sample). A prompt from the training domain:
        assert spec["drafted"] >= 10 and spec["acceptance_rate"] > 0.3
        assert "\n" in plain.tokenizer.decode(want.token_ids)  # code has lines; random weights repeat one word
    finally:
        plain.stop()
        mtp.stop()


LONG_PROMPT = PROMPT + '    with open(path) as f:\n        return f.read().splitlines()\n\n\n' + \
    'def count_words(text):\n    """Return how many words the text has."""\n    return len(text.split())\n\n\n' + \
    'def main():\n    for name in os.listdir("."):\n        if name.endswith(".py"):\n            print(name)\n\n\n' + \
    'def write_lines(path, lines):\n    """Write the lines to the file at path."""\n'


def test_chained_mtp_rounds_stop_where_plain_decoding_does_and_resumes_equal_no_reuse():
    """MTP verify rounds chained on the device (each dispatched before the previous one is read) stop a request
    exactly where plain decoding does, at stops placed across a round's rows; the next turn, resumed from the cache,
    equals no reuse. A stop among the engine's stop tokens is fed alone by the round in flight, so the lane's state
    ends exactly past its output and its endpoint is the one plain decoding leaves: the next turn caches as many
    tokens; a request's own stop_token_ids are the host's to find, and may only cache less."""
    path = trained_checkpoint()
    common = dict(kernels="reference", max_concurrency=2, max_model_len=512, warmup=False, prefill_chunk=64)
    root = Engine.from_pretrained(path, no_prefix_reuse=True, **common)
    plain = Engine.from_pretrained(path, **common)
    mtp = Engine.from_pretrained(path, speculative="mtp", num_speculative_tokens=3, **common)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stop_ids, stop_mask = mtp.scheduler.outputs.stop_ids, mtp.runner._stop_mask
    try:
        ids = root.tokenizer.encode(LONG_PROMPT)
        want = list(root.generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)).token_ids)
        # Stops the output reaches first there (the model loops over two lines, then changes one): early and late.
        firsts = [i for i in range(4, 60) if want.index(want[i]) == i]
        assert len(firsts) >= 6
        for engine_stop, first in [(True, firsts[1]), (True, firsts[3]), (True, firsts[-2]),
                                   (False, firsts[1]), (False, firsts[2])]:
            stop = want[first]
            if engine_stop:
                for engine in (plain, mtp):
                    engine.runner._stop_mask = engine.runner._stop_mask.at[stop].set(True)
                    engine.scheduler.outputs.stop_ids = frozenset([stop])
                params = SamplingParams(max_tokens=64, temperature=0.0)
            else:
                params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
            outs = [e.generate(ids, params) for e in (plain, mtp)]
            assert [(o.finish_reason, list(o.token_ids)) for o in outs] == [("stop", want[:first + 1])] * 2
            follow = list(ids) + want[:first + 1] + root.tokenizer.encode("\n\ndef f(x):\n    return x\n")
            resumed = [e.generate(follow, greedy) for e in (plain, mtp)]
            assert [r.token_ids for r in resumed] == [root.generate(follow, greedy).token_ids] * 2
            cached = [r.usage.cached_tokens for r in resumed]
            assert cached[1] == cached[0] == len(ids) + first + 1 if engine_stop else cached[1] <= cached[0]
            for engine in (plain, mtp):
                engine.runner._stop_mask, engine.scheduler.outputs.stop_ids = stop_mask, stop_ids
        assert mtp.stats()["speculative"]["chained_rounds"] > 0
        # One lane's rounds, chained or not, are one verify program (the warm-up's): the inputs keep their types.
        assert mtp.runner._steps["verify"]._cache_size() == 1
        mtp.check_ledger()
    finally:
        for engine in (root, plain, mtp):
            engine.stop()
