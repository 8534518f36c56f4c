"""Speculative decoding: prompt lookup, the verify rule (the longest matching prefix for greedy lanes, rejection
sampling that keeps the target's distribution) and the engine's verify rounds, which emit exactly the tokens plain
decoding does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from oracle import ORACLE_VOCAB
from ninfer_jax import Engine, SamplingParams
from ninfer_jax.model import init_device_state, load_checkpoint, qwen3_5
from ninfer_jax.model.mtp import mtp_forward, mtp_logits
from ninfer_jax.model.ops import REFERENCE
from ninfer_jax.runtime import startup
from ninfer_jax.runtime.options import EngineOptions, OptionsError
from ninfer_jax.runtime.speculative import NgramProposer, RoundChoice, accept_drafts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
COMMON = dict(prefill_chunk=64, max_model_len=512, kv_capacity=64 * 64, output_window=64, warmup=False)


# --- prompt lookup -----------------------------------------------------------------------------------
def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    lookup = NgramProposer(3, 1, 3)
    seq = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3], np.int32)
    # The 3-gram "4 2 3" never occurred before, the 2-gram "2 3" did (ending at 3 and 8): the latest is followed
    # by 7 8 4.
    assert lookup.propose(seq, 10).tolist() == [7, 8, 4]
    assert lookup.propose(seq, 2).tolist() == [7, 8]  # the limit (max_tokens, context) caps the drafts
    assert lookup.propose(seq, 0).tolist() == []
    assert NgramProposer(3, 3, 3).propose(seq, 10).tolist() == []  # no 3-gram recurs
    assert lookup.propose(np.array([1, 2, 3], np.int32), 10).tolist() == []


def test_prompt_lookup_extends_a_cycle_shorter_than_the_drafts():
    seq = np.array([9, 4, 6, 4, 6, 4], np.int32)  # "6 4" last seen ending at 3: only one token followed it
    assert NgramProposer(4, 2, 2).propose(seq, 10).tolist() == [6, 4, 6, 4]


# --- the verify rule -----------------------------------------------------------------------------------
def _logits_preferring(choices, vocab=8):
    """Logits [B, T, V] whose argmax at row t of lane b is choices[b][t]."""
    out = np.zeros((len(choices), len(choices[0]), vocab), np.float32)
    for b, row in enumerate(choices):
        for t, c in enumerate(row):
            out[b, t, c] = 5.0
    return jnp.asarray(out)


def _greedy_sampler(b):
    zeros = jnp.zeros(b, jnp.int32)
    return (jnp.zeros(b, jnp.float32), zeros, jnp.ones(b, jnp.float32), zeros.astype(jnp.uint32), zeros,
            jnp.zeros(b, jnp.float32))


def test_greedy_verify_keeps_the_longest_matching_prefix_and_ends_at_a_stop():
    logits = _logits_preferring([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 7, 3, 4]])
    tokens = jnp.asarray([[0, 1, 2, 3],   # every draft right: 3 kept, then the bonus 4
                          [0, 1, 5, 3],   # the second draft wrong: 1 kept, then the target's 2
                          [0, 1, 2, 3],   # only one draft fed (count 2): 1 kept, then 2
                          [0, 1, 7, 3]],  # 7 is a stop token: it ends the lane there
                         jnp.int32)
    counts = jnp.asarray([4, 4, 2, 4], jnp.int32)
    stop_mask = jnp.zeros(8, bool).at[7].set(True)
    none = jnp.full((4, 2), -1, jnp.int32)
    emitted, kept, ended = accept_drafts(logits, tokens, counts, _greedy_sampler(4), stop_mask, jnp.ones(4, bool),
                                         none, full=False)
    assert kept.tolist() == [3, 1, 1, 1] and ended.tolist() == [False, False, False, True]
    assert emitted[0].tolist() == [1, 2, 3, 4] and emitted[1, :2].tolist() == [1, 2]
    assert emitted[2, :2].tolist() == [1, 2] and emitted[3, :2].tolist() == [1, 7]
    # ignore_eos: the stop token is just a token
    _, kept, ended = accept_drafts(logits, tokens, counts, _greedy_sampler(4), stop_mask, jnp.zeros(4, bool), none,
                                   full=False)
    assert kept.tolist() == [3, 1, 1, 3] and not ended.any()
    # a request's own stop ids end its lane, ignore_eos or not: lane 0's 2, lane 3's 3
    own = none.at[0, 1].set(2).at[3, 0].set(3)
    _, kept, ended = accept_drafts(logits, tokens, counts, _greedy_sampler(4), stop_mask, jnp.zeros(4, bool), own,
                                   full=False)
    assert kept.tolist() == [1, 1, 1, 2] and ended.tolist() == [True, False, False, True]


def _filtered(logits, temperature, top_k, top_p, min_p=0.0):
    """The sampler's distribution in float64: temperature, then min-p (probability at least min_p times the
    largest), top-k, then top-p over what is left (mass strictly above < top_p)."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(len(scaled), bool)
    keep[order[:top_k]] = True
    p = np.exp(scaled - scaled.max())
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    above = np.cumsum(p[order]) - p[order]
    keep[order[above >= top_p]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def test_rejection_sampling_keeps_the_target_distribution():
    """40000 lanes (seeds) of one verify round whose drafts are one-hot guesses: the first token must follow the
    target's filtered distribution, and so must the second among lanes that kept the first draft. A chi-square test
    at alpha 1e-3: moving 0.02 of mass between two tokens of probability <= 0.25 gives a noncentrality >= 60 at
    40000 samples (>= 25 for the second token's ~17000), a power above 0.99 (0.9) at 5 degrees of freedom."""
    n, v = 40000, 8
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 1.2, (3, v)).astype(np.float32)
    temperature, top_k, top_p, min_p = 0.8, 6, 0.97, 0.2  # min-p cuts one or two tokens of each row
    targets = [_filtered(r, temperature, top_k, top_p, min_p) for r in rows]
    d1, d2 = int(np.argsort(-targets[0])[1]), int(np.argsort(-targets[1])[0])  # a likely and the likeliest guess
    logits = jnp.asarray(np.broadcast_to(rows, (n, 3, v)))
    tokens = jnp.asarray(np.broadcast_to(np.array([0, d1, d2], np.int32), (n, 3)))
    sampler = (jnp.full(n, temperature), jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p),
               jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32), jnp.full(n, min_p))
    emitted, kept, _ = accept_drafts(logits, tokens, jnp.full(n, 3, jnp.int32), sampler, jnp.zeros(v, bool),
                                  jnp.zeros(n, bool), jnp.full((n, 1), -1, jnp.int32), full=True)
    emitted, kept = np.asarray(emitted), np.asarray(kept)

    def chi_square_p(samples, p):
        support = p > 0
        counts = np.bincount(samples, minlength=v)
        assert counts[~support].sum() == 0, "a token the filters cut was emitted"
        return stats.chisquare(counts[support], p[support] * len(samples)).pvalue

    assert chi_square_p(emitted[:, 0], targets[0]) > 1e-3
    second = kept >= 1
    assert abs(second.mean() - targets[0][d1]) < 4 * np.sqrt(targets[0][d1] * (1 - targets[0][d1]) / n)
    assert chi_square_p(emitted[second, 1], targets[1]) > 1e-3
    assert np.all(emitted[kept >= 1, 0] == d1)


# --- whether speculation pays ----------------------------------------------------------------------------
def test_speculation_runs_while_its_rounds_measure_faster_per_width_and_is_tried_again_after_plain_rounds():
    choice, m, step = RoundChoice(), RoundChoice.MEASURE, 2.0**-7  # seconds a round: binary, so rates are exact
    for _ in range(m):  # an unmeasured width speculates first
        assert choice.speculate(6)
        choice.record(True, 6, 16, step)  # 2,048 tok/s
    for _ in range(m + 2):  # then measures plain rounds
        assert not choice.speculate(6)
        choice.plain_round()
        choice.record(False, 7, 7, step / 2)  # 1,792 tok/s
    assert choice.speculate(6) and choice.speculate(8)  # 5-8 lanes share a width
    assert choice.speculate(9)  # 16 lanes: not measured, speculation first
    for _ in range(RoundChoice.WINDOW - m - 1):
        choice.record(True, 6, 16, step)
    choice.record(True, 6, 16, 4 * step)  # one round held up on the host: 512 tok/s alone
    assert choice.speculate(6)  # the window's 1,872 tok/s (a mean of the last few rounds' rates would be below plain)
    fewer = 0  # rounds keeping fewer drafts: 1,536 tok/s, each displacing the window's oldest round
    while choice.speculate(6):
        choice.record(True, 6, 12, step)
        fewer += 1
    assert fewer == 6 and choice.chose_plain == 1  # (31 - 6) * 16 + 16 + 6 * 12 tokens in 35 steps: 1,785 tok/s
    for _ in range(RoundChoice.PROBE_AFTER):
        assert not choice.speculate(6)
        choice.plain_round()
        choice.record(False, 8, 8, step / 2)  # plain rounds now 2,048 tok/s; the window forgets the 1,792 ones
    assert choice.as_dict() == {"chose_plain": 1, "tokens_per_s": {"plain@8": 2048.0}}  # verify measured afresh
    for _ in range(m):
        assert choice.speculate(6)
        choice.record(True, 6, 16, step)  # 2,048 tok/s: a tie keeps speculating
    assert choice.speculate(6) and choice.chose_plain == 1
    assert choice.as_dict() == {"chose_plain": 1, "tokens_per_s": {"plain@8": 2048.0, "verify@8": 2048.0}}


# --- options ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, words", [
    (dict(num_speculative_tokens=2), "needs speculative decoding"),
    (dict(speculative="ngram", batch_invariant=True), "conflicts with batch_invariant"),
    (dict(speculative="ngram", prompt_lookup_min=5, prompt_lookup_max=3), "must not exceed"),
    (dict(speculative="ngram", num_speculative_tokens=5), "num_speculative_tokens must be in 1..4"),
    (dict(adaptive_speculation="on"), "adaptive_speculation 'on' needs speculative decoding"),
])
def test_conflicting_speculative_options_are_refused(options, words):
    with pytest.raises(OptionsError, match=words):
        EngineOptions(**options).check_conflicts()


def test_adaptive_speculation_is_on_with_a_gpu_and_off_on_a_cpu():
    def adaptive(backend, **options):
        return EngineOptions(speculative="mtp", **options).resolve(4096, backend).adaptive_speculation
    assert (adaptive("gpu"), adaptive("cpu"), adaptive("cpu", adaptive_speculation="on")) == ("on", "off", "on")
    assert EngineOptions().resolve(4096, "gpu").adaptive_speculation == "off"  # nothing to adapt


# --- the engine -----------------------------------------------------------------------------------------
class ScriptedProposer:
    """Drafts a known continuation, its i-th proposal right in its first i % (k + 1) drafts only, so that rounds keep
    every count of drafts from 0 to k."""

    def __init__(self, runs: dict, k: int):
        self.runs, self.k, self.calls = runs, k, 0

    def propose(self, tokens, limit):
        for prompt, out in self.runs.items():
            if len(tokens) >= len(prompt) and tuple(tokens[:len(prompt)].tolist()) == prompt:
                done = len(tokens) - len(prompt)
                drafts = np.asarray(out[done:done + min(self.k, limit)], np.int32)
                self.calls += 1
                wrong = np.arange(len(drafts)) == self.calls % (self.k + 1)
                return np.where(wrong, (drafts + 1) % ORACLE_VOCAB, drafts)
        return np.zeros(0, np.int32)


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, ORACLE_VOCAB, int(n)).tolist() for n in (53, 9, 70, 130, 33, 64, 5, 100)]


@pytest.fixture(scope="module")
def plain_runs(checkpoint_factory):
    """preset -> (checkpoint, prompts, the plain engine's greedy outputs of them at 8 lanes, that engine). The last
    prompt is the model's own outputs of three others: the model falls back into that trajectory, so prompt lookup
    finds drafts."""
    made = {}

    def get(preset):
        if preset not in made:
            path = checkpoint_factory(preset, "text", seed=17)
            prompts = _prompts()
            plain = Engine.from_pretrained(path, max_concurrency=8, no_prefix_reuse=True, **COMMON)
            outs = [o.token_ids for o in plain.generate_many(prompts, GREEDY)]
            prompts.append([t for o in outs[1:4] for t in o])
            outs.append(plain.generate(prompts[-1], GREEDY).token_ids)
            made[preset] = path, prompts, outs, plain
        return made[preset]

    yield get
    for *_, engine in made.values():
        engine.stop()


@pytest.fixture(scope="module")
def speculative_engines(plain_runs):
    """(preset, k) -> an engine with prompt lookup on, at 8 lanes (stopped at the module's end)."""
    made = {}

    def get(preset, k):
        if (preset, k) not in made:
            path = plain_runs(preset)[0]
            made[preset, k] = Engine.from_pretrained(path, max_concurrency=8, speculative="ngram",
                                                     num_speculative_tokens=k, **COMMON)
        return made[preset, k]

    yield get
    for engine in made.values():
        engine.stop()


@pytest.mark.parametrize("preset, k", [("tiny-dense", 1), ("tiny-dense", 4), ("tiny-moe", 4)])
def test_speculative_greedy_tokens_equal_plain_decoding(plain_runs, speculative_engines, preset, k):
    """Eight requests arriving together (the first decodes alone while the others prefill, then eight lanes), with
    drafts wrong at known places so that rounds keep every count of drafts from 0 to k. k sets only the verify
    rows (k + 1 per lane), so the two ends of its range stand for the rest."""
    path, prompts, plain, _ = plain_runs(preset)
    engine = speculative_engines(preset, k)
    engine.scheduler.proposer = ScriptedProposer({tuple(p): o for p, o in zip(prompts, plain)}, k)
    before = engine.stats()["speculative"]
    outs = engine.generate_many(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    spec = engine.stats()["speculative"]
    assert all(spec["accept_length_histogram"][n] > before["accept_length_histogram"][n] for n in range(1, k + 2))
    assert sum(o.metrics.accepted_tokens for o in outs) == spec["accepted"] - before["accepted"]
    engine.check_ledger()
    assert engine.stats()["pages"]["active"] == 0


REFERENCE_ROWS = 256  # every reference sequence padded to one length: one program each (causal: padding is inert)
_reference_prefill = jax.jit(qwen3_5.prefill, static_argnums=(1, 2))


def _reference_drafts(params, cfg, sequence, k):
    """The k MTP drafts that follow `sequence` (its last token not yet fed), by `mtp_forward` over the whole
    sequence without a cache: the target's hidden states from one prefill, then the layer chained on its own
    hidden and drafts."""
    fed = len(sequence) - 1
    pages, no_taps = REFERENCE_ROWS // 64, jnp.full((1,), -1, jnp.int32)
    padded = np.zeros(REFERENCE_ROWS, np.int32)
    padded[:len(sequence)] = sequence
    state = init_device_state(cfg, pages, 1, jnp.float32, jnp.float32)
    hidden, _ = _reference_prefill(params, cfg, REFERENCE, jnp.asarray(padded), jnp.int32(fed), jnp.int32(0),
                                   jnp.arange(pages, dtype=jnp.int32), jnp.int32(0), state, no_taps, no_taps)
    following, drafts = np.roll(padded, -1), []
    for j in range(k):  # row fed - 1 + j takes the previous row's MTP hidden and draft
        out = mtp_forward(params, cfg, hidden, jnp.asarray(following))
        drafts.append(int(jnp.argmax(mtp_logits(params, out[fed - 1 + j]))))
        hidden = hidden.at[fed + j].set(out[fed - 1 + j])
        following[fed + j] = drafts[-1]
    return drafts


def test_mtp_drafts_equal_the_layer_chained_without_a_cache_and_tokens_equal_plain(plain_runs):
    """MTP speculation at k = 3, five requests together (a round of 8 lanes with padding): greedy tokens equal
    plain decoding. The drafts the device chains each round (from the MTP pages its prefill chunks and verify rounds
    wrote, one position behind the target, and the carried hidden) equal `mtp_forward` over the whole sequence; the
    drafts the rounds verify are replaced by scripted ones right in their first i % 4 places, so rounds keep 0 to 3
    drafts and the MTP rows of every kept count are written."""
    path, prompts, plain, _ = plain_runs("tiny-dense")
    engine = Engine.from_pretrained(path, max_concurrency=8, speculative="mtp", num_speculative_tokens=3, **COMMON)
    cfg, params = load_checkpoint(path, dtype="float32")
    scripted = ScriptedProposer({tuple(p): o for p, o in zip(prompts, plain)}, 3)
    seen, retire = [], engine.scheduler._retire_verify

    def retire_and_script(done):
        retire(done)
        for req in done.reqs:
            if req.lane is not None and req.finish_reason is None:
                seen.append((req.sequence().tolist(), req.drafts.tolist()))
                req.drafts = scripted.propose(req.sequence(), 3)

    engine.scheduler._retire_verify = retire_and_script
    engine.scheduler.chain_rounds = False  # the scripted drafts replace the device's after each read
    try:
        outs = engine.generate_many(prompts[:5], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [o[:16] for o in plain[:5]]
        spec = engine.stats()["speculative"]
        assert all(spec["accept_length_histogram"][n] > 0 for n in range(1, 5))
        engine.check_ledger()
    finally:
        engine.stop()
    picked = seen[::3]  # every lane's rounds are alike; a spread of them keeps the reference cheap
    assert len(picked) >= 10
    assert [drafts for _, drafts in picked] == [_reference_drafts(params, cfg, seq, 3) for seq, _ in picked]


def test_mtp_speculation_of_a_moe_model_keeps_plain_decodings_tokens(plain_runs):
    """The MoE model's MTP layer (its FFN a routed MoE) drafting at k = 1 for three lanes."""
    path, prompts, plain, _ = plain_runs("tiny-moe")
    engine = Engine.from_pretrained(path, max_concurrency=4, speculative="mtp", num_speculative_tokens=1, **COMMON)
    try:
        outs = engine.generate_many(prompts[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [o[:8] for o in plain[:3]]
        assert engine.stats()["speculative"]["drafted"] > 0
        engine.check_ledger()
    finally:
        engine.stop()


def test_mtp_needs_a_checkpoint_with_the_layer(checkpoint_factory, monkeypatch):
    import ninfer_jax.runtime.engine as engine_module

    def without_mtp(*args, **kwargs):
        cfg, params = load_checkpoint(*args, **kwargs)
        return cfg, params.replace(mtp=None)

    monkeypatch.setattr(engine_module, "load_checkpoint", without_mtp)
    with pytest.raises(OptionsError, match="has none"):
        Engine.from_pretrained(checkpoint_factory("tiny-dense", "text", seed=17), speculative="mtp", **COMMON)


def test_prompt_lookup_drafts_are_kept_where_the_model_repeats_itself(plain_runs, speculative_engines):
    path, prompts, plain, _ = plain_runs("tiny-dense")
    engine = speculative_engines("tiny-dense", 4)
    engine.scheduler.proposer = NgramProposer(4, 2, 4)
    before = engine.stats()["speculative"]
    out = engine.generate(prompts[-1], GREEDY)
    assert out.token_ids == plain[-1]
    spec = engine.stats()["speculative"]
    assert spec["accepted"] - before["accepted"] == out.metrics.accepted_tokens > 0
    assert out.metrics.accepted_tokens < out.metrics.drafted_tokens
    # where no n-gram recurs, speculation pauses and rounds run one in flight, as with it off
    before = engine.stats()["speculative"]
    assert engine.generate(prompts[4], GREEDY).token_ids == plain[4]
    spec = engine.stats()["speculative"]
    assert spec["pauses"] > before["pauses"] and spec["verify_rounds"] == before["verify_rounds"]
    engine.check_ledger()


def test_sampled_lanes_verify_and_stop_within_their_limits(plain_runs, speculative_engines):
    """Sampling lanes run the rejection rule in the engine: seeded runs repeat, and max_tokens holds."""
    path, prompts, plain, _ = plain_runs("tiny-dense")
    engine = speculative_engines("tiny-dense", 4)
    engine.scheduler.proposer = ScriptedProposer({tuple(p): o for p, o in zip(prompts, plain)}, 4)
    sampled = SamplingParams(max_tokens=13, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)
    first, second = (engine.generate_many(prompts[:2], sampled) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 13 and o.metrics.drafted_tokens > 0 for o in first)
    engine.check_ledger()


@pytest.mark.parametrize("at", [5, 6, 7])
def test_a_stop_inside_kept_drafts_ends_the_request_there_and_its_cache_stays_exact(plain_runs, speculative_engines,
                                                                                    at):
    """A stop token the host finds among a round's kept drafts (stop_token_ids) ends the output at it; the lane's
    state ran ahead of it, so no endpoint is taken, or, when the stop was the round's last token, one more round
    feeds it as plain decoding does. Either way the next turn, resumed from the cache, equals no reuse."""
    path, prompts, plain, root = plain_runs("tiny-dense")
    engine = speculative_engines("tiny-dense", 4)
    engine.scheduler.proposer = ScriptedProposer({tuple(p): o for p, o in zip(prompts, plain)}, 4)
    prompt, expected = prompts[3], plain[3]
    stop = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[expected[at]])
    out = engine.generate(prompt, stop)
    first = expected.index(expected[at])
    assert out.finish_reason == "stop" and out.token_ids == expected[:first + 1]
    follow = list(prompt) + list(out.token_ids) + list(range(40, 110))
    resumed = engine.generate(follow, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert resumed.usage.cached_tokens >= 128
    assert resumed.token_ids == root.generate(follow, SamplingParams(max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True)).token_ids
    engine.check_ledger()


# --- the model's verify step ------------------------------------------------------------------------------
def _verify_then_commit(params, cfg, kc, tokens, positions, tables, slots, counts, kept, state):
    hidden, state, replay = qwen3_5.verify(params, cfg, kc, tokens, positions, tables, slots, counts, state)
    return hidden, qwen3_5.commit_verified(params, cfg, kc, state, replay, slots, kept, counts > 0)


def test_verify_rows_with_the_pallas_kernels_equal_decoding_them_one_by_one(checkpoint_factory):
    """Two lanes past a prefilled prompt verify 4 rows (one lane feeds 3) and keep 2 and 1 of them, on the Pallas
    kernels (interpret mode, the engine's fused decode kernels on): the rows' hidden states equal decoding the same
    tokens one round at a time on the references, and the lanes' GDN states and conv histories equal decoding only
    the kept rows (the rows past them left no trace), to float32 rounding (the programs fuse differently). The
    engine's tests show the reference kernels' verify rounds give plain decoding's tokens."""
    cfg, params = load_checkpoint(checkpoint_factory("tiny-dense", "text", seed=21), dtype="float32")
    kc = startup.kernel_config(EngineOptions(kernels="pallas", interpret=True, dtype="float32",
                                             prefill_attention="pallas"))
    rng = np.random.default_rng(3)
    tables = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4))
    slots, base = jnp.asarray([1, 0], jnp.int32), 20
    state = init_device_state(cfg, 8, 3, jnp.float32, jnp.float32)
    no_taps = jnp.full((1,), -1, jnp.int32)
    for lane in range(2):  # a prompt of `base` tokens in each lane
        _, state = qwen3_5.prefill(params, cfg, REFERENCE, jnp.asarray(rng.integers(0, ORACLE_VOCAB, base), jnp.int32),
                                   jnp.int32(base), jnp.int32(0), tables[lane], slots[lane], state, no_taps, no_taps)
    tokens = jnp.asarray(rng.integers(0, ORACLE_VOCAB, (2, 4)), jnp.int32)
    counts, kept = jnp.asarray([4, 3], jnp.int32), jnp.asarray([2, 1], jnp.int32)
    positions = jnp.full(2, base, jnp.int32)
    verify = jax.jit(_verify_then_commit, static_argnames=("cfg", "kc"))
    hidden, verified = verify(params, cfg, kc, tokens, positions, tables, slots, counts, kept,
                              jax.tree.map(jnp.copy, state))
    step = jax.jit(qwen3_5.decode, static_argnames=("cfg", "kc"))
    rows, kept_state = [], None
    for t in range(4):
        active = jnp.asarray([t < 4, t < 3])
        h, state = step(params, cfg, REFERENCE, tokens[:, t], positions + t, tables, slots, active, state)
        rows.append(h)
        if t == 1:  # lane 0 keeps rows 0..2, lane 1 rows 0..1: lane 1's state now, lane 0's after row 2
            kept_state = [s[slots[1]] for s in state.ssm + state.conv]
        if t == 2:
            kept_state = [np.stack([s[slots[0]], k]) for s, k in zip(state.ssm + state.conv, kept_state)]
    tol = dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(hidden).reshape(2, 4, -1)[0], np.stack(rows, 1)[0], **tol)
    np.testing.assert_allclose(np.asarray(hidden).reshape(2, 4, -1)[1, :3], np.stack(rows, 1)[1, :3], **tol)
    for got, want in zip(verified.ssm + verified.conv, kept_state):
        np.testing.assert_allclose(np.asarray(got)[np.asarray(slots)], want, **tol)


def test_logprobs_of_verified_tokens_equal_plain_decodings(plain_runs, speculative_engines):
    path, prompts, plain, root = plain_runs("tiny-dense")
    engine = speculative_engines("tiny-dense", 4)
    engine.scheduler.proposer = ScriptedProposer({tuple(p): o for p, o in zip(prompts, plain)}, 4)
    asked = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    before = engine.stats()["speculative"]["verify_rounds"]
    got, want = engine.generate(prompts[2], asked), root.generate(prompts[2], asked)
    assert engine.stats()["speculative"]["verify_rounds"] > before
    assert got.token_ids == want.token_ids and len(got.logprobs) == 12
    for a, b in zip(got.logprobs, want.logprobs):
        assert a["token_id"] == b["token_id"] and [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
        np.testing.assert_allclose([a["logprob"], *(lp for _, lp in a["top"])],
                                   [b["logprob"], *(lp for _, lp in b["top"])], rtol=0, atol=1e-5)
    engine.check_ledger()
