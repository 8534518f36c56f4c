"""MTP verify rounds chained on the device: each round is dispatched before the previous one is read, its tokens,
drafts and positions taken from that round's frontier. On the trained checkpoint, whose drafts are mostly kept,
greedy lanes emit exactly the tokens of decoding without speculation however they end (max_tokens, the engine's
stop token, a request's own stop token, the context), a seeded sampled lane the tokens of unchained rounds, and the
next turns resume from what the lanes left in the cache as plain decoding's do."""

import json

import pytest

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.frontend import load_tokenizer
from ninfer_jax.model.tiny import trained_checkpoint
from ninfer_jax.runtime.thinking_budget import think_close_id

CODE = [
    'import os\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse(text):\n    result = {}\n    for line in text.splitlines():\n",
    "import sys\n\n\ndef main(argv):\n    if len(argv) < 2:\n",
]
COMMON = dict(kernels="reference", max_concurrency=4, prefill_chunk=64, max_model_len=256, output_window=64,
              kv_capacity=64 * 64, device_snapshot_slots=6, host_cache_mib=16, warmup=False)


@pytest.fixture(scope="module")
def newline_stops(tmp_path_factory):
    """The trained checkpoint with "\\n" as its EOS, so the engine's own stop token comes up within a line."""
    source = trained_checkpoint()
    path = tmp_path_factory.mktemp("newline-eos")
    for item in source.iterdir():
        (path / item.name).symlink_to(item)
    (path / "config.json").unlink()
    config = json.loads((source / "config.json").read_text())
    newline = load_tokenizer(source).encode("\n")
    assert len(newline) == 1
    config["eos_token_id"] = newline[0]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def engines(newline_stops):
    plain = Engine.from_pretrained(newline_stops, **COMMON)
    chained = Engine.from_pretrained(newline_stops, speculative="mtp", num_speculative_tokens=3, **COMMON)
    yield plain, chained
    plain.stop()
    chained.stop()


def test_chained_rounds_emit_plain_decodings_tokens_and_the_cache_they_leave_resumes_exactly(engines):
    plain, chained = engines
    tok = plain.tokenizer
    prompts = [tok.encode(text * 9)[:120] for text in CODE]  # the endpoints these leave are past a 64-token tap
    prompts[3] = tok.encode(CODE[3] * 9)[:200]  # 56 tokens of context left: it ends at max_model_len
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    probe = plain.generate(prompts[2], greedy).token_ids
    requests = [
        SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True),   # ends at max_tokens
        SamplingParams(max_tokens=40, temperature=0.0),                    # ends at the engine's stop token
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,    # the request's own stop token
                       stop_token_ids=[probe[11]]),
        SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),  # ends at the context
    ]
    settled, settle = [], chained.scheduler._settle_continued

    def record(req, advanced):
        settled.append((req.finish_reason, advanced))
        settle(req, advanced)

    chained.scheduler._settle_continued = record
    want = [plain.generate(p, sp) for p, sp in zip(prompts, requests)]
    got = chained.generate_many(prompts, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want] == ["length", "stop", "stop", "length"]
    counters, spec = chained.scheduler.counters, chained.stats()["speculative"]
    assert counters["chained_rounds"] >= counters["decode_rounds"] - 4 > 0  # each lane's first round reads back
    assert spec["accepted"] > spec["drafted"] // 3
    # every lane ended while the next round continued it: the stop token fed alone (a plain round's closing feed),
    # drafts fed past the host's stop, nothing past max_tokens and the context
    assert sorted(settled) == [("length", 0), ("length", 0), ("stop", 1), ("stop", 1)]
    chained.check_ledger()

    # The next turns, resumed from what each lane left: the tokens and the cached share of plain decoding's
    for prompt, w, g in zip(prompts[:3], want, got):
        follow = prompt + list(g.token_ids) + tok.encode("\n\n# next\n")
        turn = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        a, b = plain.generate(follow, turn), chained.generate(follow, turn)
        assert b.token_ids == a.token_ids
        assert b.usage.cached_tokens == a.usage.cached_tokens > 0
    chained.check_ledger()
    plain.check_ledger()


def test_a_seeded_sampled_lane_draws_the_same_tokens_chained_or_not(engines):
    """The sampler's step (which token of the output a row draws) comes from the frontier in a chained round."""
    _, chained = engines
    prompts = [chained.tokenizer.encode(text) for text in CODE[:2]]
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    before = chained.scheduler.counters["chained_rounds"]
    on = [o.token_ids for o in chained.generate_many(prompts, sampled)]
    assert chained.scheduler.counters["chained_rounds"] > before
    chained.scheduler.chain_rounds = False
    try:
        off = [o.token_ids for o in chained.generate_many(prompts, sampled)]
    finally:
        chained.scheduler.chain_rounds = True
    assert on == off
    chained.check_ledger()


def test_a_lane_with_a_stop_string_verifies_unchained(engines):
    """The host alone sees a stop string: rounds chained past it would leave the lane's state past its output."""
    plain, chained = engines
    prompt = chained.tokenizer.encode(CODE[0])
    text = plain.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)).text
    request = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[text[len(text) // 2:][:3]])
    before = chained.scheduler.counters["chained_rounds"]
    out = chained.generate(prompt, request)
    assert out.token_ids == plain.generate(prompt, request).token_ids and out.finish_reason == "stop"
    assert chained.scheduler.counters["chained_rounds"] == before
    assert chained.stats()["speculative"]["verify_rounds"] > 0
    chained.check_ledger()


def test_a_lane_that_processes_its_logits_joining_verify_rounds_leaves_every_lane_exact(engines):
    """A repetition penalty's statistics follow each token, so once that lane decodes, rounds decode plainly: the
    verify round in flight is read first, and the plain rounds take no token from its outputs."""
    plain, chained = engines
    prompts = [chained.tokenizer.encode(text) for text in CODE[:3]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    requests = [greedy, greedy, penalised]  # the third prefills last: the others verify meanwhile
    before = chained.stats()["speculative"]
    got = chained.generate_many(prompts, requests)
    assert [o.token_ids for o in got] == [plain.generate(p, sp).token_ids for p, sp in zip(prompts, requests)]
    after = chained.stats()["speculative"]
    assert after["verify_rounds"] > before["verify_rounds"] and after["plain_rounds"] > before["plain_rounds"]
    chained.check_ledger()


def test_a_thinking_budget_lane_verifies_drafts_until_its_budget_may_bind_and_again_once_thinking_ends(engines):
    """A thinking budget processes the lane's logits only from two rounds before it may bind: before, and again
    once `</think>` is out, the lane verifies MTP drafts. Tokens equal plain decoding's under the same budget (the
    end of thinking forced at the budget)."""
    plain, chained = engines
    end = think_close_id(chained.tokenizer)
    prompt = chained.tokenizer.encode(CODE[1] * 9)[:120]
    free = plain.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)).token_ids
    assert end not in free
    for budget in (30, 2):  # drafts before the budget binds; drafts only after the forced end of thinking
        request = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, thinking_budget=budget)
        want = plain.generate(prompt, request).token_ids
        assert want[:budget] == free[:budget] and want[budget] == end
        got = chained.generate(prompt, request)
        assert got.token_ids == want
        assert got.metrics.accepted_tokens > 0
    chained.check_ledger()


def test_rounds_switching_between_verifying_and_plain_decoding_keep_plain_decodings_tokens(engines):
    """Adaptive speculation (`RoundChoice`) may turn verify rounds off and on at any round; plain rounds leave the
    MTP layer's pages and carry behind the lanes, which costs drafts, never tokens. The scheduler times the steady
    rounds of each kind for it."""
    from ninfer_jax.runtime.speculative import RoundChoice

    plain, chained = engines
    counters = chained.scheduler.counters

    class Alternating(RoundChoice):  # three rounds verify, three decode plainly, in turn
        def speculate(self, lanes):
            return counters["decode_rounds"] // 3 % 2 == 0

    chained.scheduler.choice = choice = Alternating()
    try:
        prompts = [chained.tokenizer.encode(text) for text in CODE[:3]]
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        before = chained.stats()["speculative"]
        got = chained.generate_many(prompts, greedy)
        after = chained.stats()["speculative"]
    finally:
        chained.scheduler.choice = None
    assert [o.token_ids for o in got] == [plain.generate(p, greedy).token_ids for p in prompts]
    assert after["verify_rounds"] > before["verify_rounds"] + 3 and after["plain_rounds"] > before["plain_rounds"] + 3
    assert {verify for verify, _ in choice.windows} == {True, False}  # steady rounds of both kinds were timed
    chained.check_ledger()
