"""Mixed steps (chunked prefill): while lanes decode, a prompt's pass runs in the same step as their round
(`runner.mixed`), and every request still gets the tokens a cacheless forward gives."""

import time

import jax.extend
import numpy as np
import pytest

import oracle
from oracle import ORACLE_VOCAB
from ninfer_jax import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Two lanes, passes of 128 tokens (64 in a mixed step): each prompt but the first prefills while the other lane
# decodes
OPTIONS = dict(max_concurrency=2, prefill_chunk=128, idle_prefill_chunk=128, mixed_prefill_tokens=64,
               max_model_len=512, kv_capacity=24 * 64, output_window=64)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-moe", "text", seed=7)


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = Engine.from_pretrained(checkpoint, **OPTIONS)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def forward_greedy(checkpoint):
    return oracle.forward_greedy(checkpoint)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, ORACLE_VOCAB, n).tolist()


def _mixed_steps(engine) -> int:
    return engine.stats()["scheduler"].get("mixed_steps", 0)


def test_passes_mixed_into_rounds_give_the_forwards_greedy_tokens_and_compile_nothing(engine, forward_greedy):
    prompts = [_prompt(n, seed) for seed, n in enumerate((20, 150, 260, 90))]
    before = _mixed_steps(engine)
    outs = engine.generate_many(prompts, GREEDY)
    # each prompt but the first prefills while the other lane decodes: its passes ride in that lane's rounds
    assert _mixed_steps(engine) - before >= 4
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == forward_greedy(prompt, out.token_ids)
    # the second turn resumes from what the mixed passes cached (their taps and the endpoint) and extends it
    turn2 = prompts[2] + list(outs[2].token_ids) + _prompt(100, 9)
    out = engine.generate_many([prompts[0] + [5] * 40, turn2], GREEDY)[1]
    assert out.usage.cached_tokens >= 256
    assert out.token_ids == forward_greedy(turn2, out.token_ids)
    stats = engine.stats()
    assert stats["compiles_since_warmup"] == 0 and stats["pages"]["active"] == 0
    engine.check_ledger()


def test_a_mixed_pass_that_ends_a_sampled_prompt_samples_as_a_pass_alone(engine):
    """A seeded sampled request with logprobs and a logit bias whose last pass rides in a greedy lane's round takes
    the same tokens and logprobs as when it prefills alone."""
    prompt = _prompt(200, 11)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True,
                             logit_bias={7: 2.5}, prefix_cache=False)  # neither run reads the other's blocks
    alone = engine.generate(prompt, sampled)
    before = _mixed_steps(engine)
    _, mixed = engine.generate_many([_prompt(30, 12), prompt], [GREEDY, sampled])
    assert _mixed_steps(engine) > before
    assert mixed.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, mixed.logprobs):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    engine.check_ledger()


def test_cancels_while_passes_ride_in_rounds_free_everything(engine, forward_greedy):
    """Requests cancelled at every point of their mixed passes (a first token read a step later included) leave
    the running request's tokens exact and nothing held."""
    running = _prompt(40, 21)
    rid = engine.submit(running, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for i, delay in enumerate((0.0, 0.05, 0.2, 0.5)):
        cancelled = engine.submit(_prompt(190, 30 + i), SamplingParams(max_tokens=3, ignore_eos=True))
        time.sleep(delay)
        engine.cancel(cancelled)
    out = engine.generate(running + [3], GREEDY)  # waits behind the rest: every cancel has landed
    assert out.token_ids == forward_greedy(running + [3], out.token_ids)
    engine.cancel(rid)
    deadline = time.monotonic() + 30
    while engine.stats()["requests"]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["requests"]["running"] == 0 and stats["pages"]["active"] == 0
    engine.check_ledger()


def test_a_mixed_step_writes_the_kv_pools_in_place(engine):
    # The pass's and the round's KV writes both come before either attention reads a pool: a read between two
    # writes of a pool made XLA copy the whole pool, each layer, each mixed step.
    from ninfer_jax.benchmarks.profiling import compiled_copies, mixed_inputs

    k_pages = engine.runner.state.k_pages[0]
    pool = f"{k_pages.dtype.name.replace('float', 'f')}[{','.join(map(str, k_pages.shape))}]"
    copies = compiled_copies(engine, "mixed", *mixed_inputs(engine, 1, 64, engine.runner.mixed_tokens, 128))
    assert copies["copies"] > 0  # the parse finds copies (the GDN pools' on a CPU)
    assert pool not in copies["shapes"]


def _host_loops(jaxpr) -> int:
    """While loops outside Pallas kernels, at any depth: each makes the GPU runtime read its trip count back on the
    host before it launches the rest of the step."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue  # a loop inside a kernel runs on the device
        n += eqn.primitive.name == "while"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _host_loops(sub)
    return n


def test_a_mixed_steps_pass_and_a_decode_round_run_without_a_host_loop(engine):
    # With prefill_attention "cudnn" a pass alone gathers its prefix segment by segment in a while loop; beside a
    # round that loop would hold the host until the device reached each attention layer (TPOT p99 49 -> 32 ms at
    # 64 lanes of the 35B-A3B, docs/benchmarks/arrivals.md), so the mixed step reads it with the Pallas kernel.
    from ninfer_jax.benchmarks.profiling import mixed_inputs
    from ninfer_jax.model.ops import KernelConfig
    from pallas_kernels.paged_attention import PrefillConfig

    r = engine.runner
    kc = KernelConfig("pallas", interpret=True, prefill_attention=PrefillConfig(impl="cudnn"))
    packed, r_packed, prev = mixed_inputs(engine, 1, 64, r.mixed_tokens, 128)
    mixed = r._steps["mixed"].trace(r.params, r.cfg, kc, False, (r.mixed_tokens, r.max_taps), r.state, packed,
                                    r.media, r_packed, prev)
    alone = r._steps["prefill"].trace(r.params, r.cfg, kc, False, (r.mixed_tokens, r.max_taps), r.state, packed,
                                      r.media, r.mtp_carry)
    decode = r._steps["decode"].trace(r.params, r.cfg, kc, False, r.state, r_packed, prev)
    layers = len(r.cfg.attn_layers)
    assert _host_loops(alone.jaxpr.jaxpr) == layers
    assert _host_loops(mixed.jaxpr.jaxpr) == _host_loops(decode.jaxpr.jaxpr) == 0
