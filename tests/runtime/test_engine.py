"""The serving engine: exact greedy outputs under concurrency and chunking, sampling controls, streaming,
cancellation, bounded completion, refusal of bad input, no leaks and no compiles while serving."""

import asyncio
import collections
import dataclasses
import gc
import random
import threading
import time

import jax
import numpy as np
import pytest
import torch

from oracle import ORACLE_VOCAB, forward_greedy, hf_model
from ninfer_jax import Engine, InvalidRequestError, PromptTooLongError, SamplingParams
from ninfer_jax.runtime import engine as engine_module
from ninfer_jax.runtime.device import buckets
from ninfer_jax.runtime.device.runner import ModelRunner

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(count, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 150, count)
    return [rng.integers(0, ORACLE_VOCAB, int(n)).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=31)


@pytest.fixture(scope="module")
def engine8(checkpoint):
    engine = Engine.from_pretrained(checkpoint, max_concurrency=8, prefill_chunk=64, max_model_len=512,
                                    kv_capacity=64 * 64, output_window=64)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    model = hf_model(checkpoint)

    def run(prompt, n):
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt)[None], max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return tuple(out[0, len(prompt):].tolist())

    return run


@pytest.fixture(scope="module")
def hf_forward_greedy(checkpoint):
    return forward_greedy(checkpoint)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "engine8" in request.fixturenames:
        engine = request.getfixturevalue("engine8")
        engine.check_ledger()
        stats = engine.stats()
        assert stats["pages"]["active"] == 0 and stats["requests"]["running"] == 0
        assert stats["compiles_since_warmup"] == 0


def test_single_request_matches_transformers_greedy(engine8, hf_greedy):
    prompt = _prompts(1, seed=1)[0]
    out = engine8.generate(prompt, GREEDY)
    assert out.finish_reason == "length" and out.usage.completion_tokens == 12
    assert out.token_ids == hf_greedy(prompt, 12)
    assert out.usage.prompt_tokens == len(prompt) and out.metrics.ttft_s > 0


def test_eight_concurrent_requests_match_transformers_greedy(engine8, hf_greedy):
    prompts = _prompts(8, seed=2)
    outs = engine8.generate_many(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(prompt, 12)
        m = out.metrics  # arrival -> lane -> first chunk dispatched -> first token -> last token
        assert 0 <= m.queue_s <= m.first_scheduled_s <= m.ttft_s < m.latency_s
    # One chunk per step, oldest first: the last of eight prompts waits behind the other seven's chunks.
    assert max(o.metrics.first_scheduled_s for o in outs) > min(o.metrics.first_scheduled_s for o in outs)


def test_outputs_do_not_depend_on_prefill_chunk_or_concurrency(engine8, checkpoint):
    prompts = _prompts(5, seed=3)
    with Engine.from_pretrained(checkpoint, max_concurrency=2, prefill_chunk=128, max_model_len=512) as other:
        sequential = [other.generate(p, GREEDY).token_ids for p in prompts]
        other.check_ledger()
    concurrent = [o.token_ids for o in engine8.generate_many(prompts, GREEDY)]
    assert sequential == concurrent


def test_a_decode_round_runs_its_active_lanes_padded_to_a_power_of_two(engine8, hf_greedy, monkeypatch):
    sizes = []
    run = engine8.runner._decode_packed
    monkeypatch.setattr(engine8.runner, "_decode_packed",
                        lambda packed, *a: (sizes.append(len(packed)), run(packed, *a))[1])
    prompt = _prompts(1, seed=11)[0]
    assert engine8.generate(prompt, GREEDY).token_ids == hf_greedy(prompt, 12)
    assert set(sizes) == {1}  # one lane: one row, not eight
    sizes.clear()
    prompts = _prompts(3, seed=12)
    outs = engine8.generate_many(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(p, 12) for p in prompts]
    assert 4 in sizes and max(sizes) == 4 and set(sizes) <= {1, 2, 4}


def test_batch_invariant_rounds_run_every_lane_and_match_transformers(checkpoint, hf_greedy):
    prompts = _prompts(3, seed=9)
    with Engine.from_pretrained(checkpoint, max_concurrency=4, prefill_chunk=64, max_model_len=512,
                                kv_capacity=32 * 64, output_window=64, batch_invariant=True) as engine:
        assert engine.runner.decode_sizes == (4,)
        outs = engine.generate_many(prompts, GREEDY)
        engine.check_ledger()
        assert engine.stats()["compiles_since_warmup"] == 0
    assert [o.token_ids for o in outs] == [hf_greedy(p, 12) for p in prompts]


def test_a_prompt_no_decode_waits_on_runs_in_idle_passes_and_others_keep_the_prefill_chunk(
        checkpoint, hf_forward_greedy, monkeypatch):
    rng = np.random.default_rng(21)
    long_a, long_b, long_c = (rng.integers(0, ORACLE_VOCAB, n).tolist() for n in (300, 256, 300))
    short = rng.integers(0, ORACLE_VOCAB, 10).tolist()
    with Engine.from_pretrained(checkpoint, max_concurrency=2, prefill_chunk=64, idle_prefill_chunk=256,
                                max_model_len=512, kv_capacity=32 * 64, output_window=64) as engine:
        assert engine.runner.idle_sizes == (128, 256)
        passes = []
        prefill = engine.runner.prefill
        monkeypatch.setattr(engine.runner, "prefill", lambda tokens, *a, **k: (passes.append(len(tokens)),
                                                                              prefill(tokens, *a, **k))[1])
        # Alone: the longest idle pass that fits, then the rest in prefill chunks; transformers' greedy tokens.
        alone = engine.generate(long_a, GREEDY).token_ids
        assert alone == hf_forward_greedy(long_a, alone)
        assert passes == [256, 44]
        # An idle pass ends a prompt only for the greedy sampler (the only one compiled at those lengths).
        passes.clear()
        engine.generate(long_b, SamplingParams(max_tokens=2, temperature=0.8, seed=3))
        assert passes == [128, 64, 64]
        # While another lane decodes, a long prompt keeps to prefill_chunk, so that lane's rounds wait less.
        passes.clear()
        outs = engine.generate_many([short, long_c], [SamplingParams(max_tokens=40, ignore_eos=True), GREEDY])
        assert passes == [10, 64, 64, 64, 64, 44]
        assert outs[1].token_ids == hf_forward_greedy(long_c, outs[1].token_ids)
        stats = engine.stats()
        assert stats["scheduler"]["idle_prefill_chunks"] == 2 and stats["compiles_since_warmup"] == 0
        engine.check_ledger()


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine8):
    prompt = _prompts(1, seed=4)[0]
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = engine8.generate_many([prompt, prompt], sp)
    assert a.token_ids == b.token_ids
    c = engine8.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True))
    assert c.token_ids != a.token_ids


def test_generate_samples_gives_sample_i_seed_s_plus_i_and_computes_the_prompt_once(engine8):
    """vLLM's n in the Python API: the samples equal requests seeded s, s + 1, ... made one at a time, and the later
    samples resume from the first's prefill instead of computing the prompt again."""
    rng = np.random.default_rng(23)
    prompt = rng.integers(0, ORACLE_VOCAB, 140).tolist()  # two whole blocks of 64, not cached by earlier tests
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    outs = engine8.generate_samples(prompt, sp, n=3)
    assert [o.usage.cached_tokens for o in outs] == [0, 128, 128]
    alone = [engine8.generate(prompt, dataclasses.replace(sp, seed=5 + i)).token_ids for i in range(3)]
    assert [o.token_ids for o in outs] == alone and len(set(alone)) == 3
    assert all(o.prompt_token_ids == tuple(prompt) for o in outs)
    with pytest.raises(ValueError, match="n must be"):
        engine8.generate_samples(prompt, sp, n=0)


def test_unseeded_requests_draw_their_seeds_from_the_seed_option(checkpoint):
    """--seed (vLLM's): requests without a seed take, in order, the next 32 bits of a generator seeded with it; the
    same requests in the same order then sample the same tokens, and another seed samples others."""
    prompt = _prompts(1, seed=13)[0]
    sp = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = {}
    for seed in (5, 5, 6):
        with Engine.from_pretrained(checkpoint, max_concurrency=2, prefill_chunk=64, max_model_len=256,
                                    kv_capacity=16 * 64, output_window=64, seed=seed) as engine:
            first, second = engine.generate(prompt, sp), engine.generate(prompt, sp)
            runs.setdefault(seed, []).append((first.token_ids, second.token_ids))
            draws = random.Random(seed)
            as_given = [engine.generate(prompt, dataclasses.replace(sp, seed=draws.getrandbits(32))).token_ids
                        for _ in range(2)]
            assert as_given == [first.token_ids, second.token_ids]
    assert runs[5][0] == runs[5][1] and runs[5][0][0] != runs[5][0][1]
    assert runs[6][0][0] != runs[5][0][0]


def test_top_k_one_is_greedy(engine8, hf_greedy):
    prompt = _prompts(1, seed=5)[0]
    out = engine8.generate(prompt, SamplingParams(max_tokens=6, temperature=0.7, top_k=1, ignore_eos=True))
    assert out.token_ids == hf_greedy(prompt, 6)


def test_stop_token_ids_end_the_request(engine8, hf_greedy):
    prompt = _prompts(1, seed=6)[0]
    expected = hf_greedy(prompt, 12)
    stop_at = expected[4]
    out = engine8.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))
    first = expected.index(stop_at)
    assert out.finish_reason == "stop" and out.token_ids == expected[: first + 1]


def test_logprobs_are_log_probabilities_of_chosen_tokens(engine8):
    prompt = _prompts(1, seed=7)[0]
    out = engine8.generate(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == token and entry["logprob"] <= 0
        assert len(entry["top"]) == 3 and entry["top"][0][0] == token  # greedy picks the top token
        assert entry["top"][0][1] == pytest.approx(entry["logprob"], abs=1e-6)


def test_logprobs_run_only_for_rounds_that_ask_and_equal_the_full_forwards(engine8, monkeypatch):
    import jax

    from ninfer_jax.model import qwen3_5

    asked = []
    with_logprobs = engine8.runner._with_logprobs

    def spy(tokens, logits, rows, logprobs):
        asked.append(logprobs)
        return with_logprobs(tokens, logits, rows, logprobs)

    monkeypatch.setattr(engine8.runner, "_with_logprobs", spy)
    plain_prompt, lp_prompt = _prompts(2, seed=12)
    plain = engine8.generate(plain_prompt, GREEDY)
    assert plain.logprobs is None and asked and not any(asked)  # no prefill or round computed them
    asked.clear()
    lp_sampling = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=4)
    lp, again = engine8.generate_many([lp_prompt, plain_prompt], [lp_sampling, GREEDY])
    assert again.token_ids == plain.token_ids and again.logprobs is None  # its rows' logprobs are not reported
    assert any(asked)
    # Each reported value against the log-softmax of the whole-sequence forward at that position
    ids = lp_prompt + list(lp.token_ids)
    logp = np.asarray(jax.nn.log_softmax(qwen3_5.forward(engine8.runner.params, engine8.config, ids), axis=-1))
    assert len(lp.logprobs) == 12
    for i, (token, entry) in enumerate(zip(lp.token_ids, lp.logprobs)):
        row = logp[len(lp_prompt) - 1 + i]
        assert entry["token_id"] == token and entry["logprob"] == pytest.approx(row[token], abs=2e-4)
        want = np.argsort(-row, kind="stable")[:4]
        assert [t for t, _ in entry["top"]] == want.tolist()
        np.testing.assert_allclose([v for _, v in entry["top"]], row[want], atol=2e-4)


def test_stream_delivers_every_token_then_finishes(engine8):
    prompt = _prompts(1, seed=8)[0]
    events = list(engine8.stream(prompt, GREEDY))
    assert events[0].usage is not None and events[0].usage.cached_tokens == 0  # fixed at admission
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason == "length"
    tokens = tuple(t for e in events for t in e.token_ids)
    assert tokens == engine8.generate(prompt, GREEDY).token_ids


def test_async_stream_matches_sync(engine8):
    prompt = _prompts(1, seed=9)[0]

    async def collect():
        return tuple([t async for e in engine8.astream(prompt, GREEDY) for t in e.token_ids])

    assert asyncio.run(collect()) == engine8.generate(prompt, GREEDY).token_ids


def test_cancel_mid_prefill_frees_everything(engine8):
    long_prompt = _prompts(1, seed=10)[0] * 3  # several 64-token chunks
    done = threading.Event()
    result = {}

    def sink(ev):
        if ev.usage is not None and ev.finish_reason is None and "admitted" not in result:
            result["admitted"] = True
            engine8.cancel(rid)  # processed at the next unit boundary: after the first chunk
        if ev.finish_reason is not None:
            result["reason"], result["tokens"] = ev.finish_reason, ev.usage.completion_tokens
            done.set()

    rid = engine8.submit(long_prompt, GREEDY, sink=sink)
    assert done.wait(60)
    assert result == {"admitted": True, "reason": "cancelled", "tokens": 0}


def test_a_cancel_mid_prompt_stops_it_within_a_pass_idle_passes_included(checkpoint):
    # The scheduler keeps at most one prefill pass queued behind the one computing, so a cancel leaves at most
    # those two to the device, not the rest of a prompt the host dispatched ahead.
    prompt = np.random.default_rng(22).integers(0, ORACLE_VOCAB, 3800).tolist()
    with Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=64, idle_prefill_chunk=128,
                                max_model_len=4096, kv_capacity=64 * 64, output_window=64) as engine:
        before = engine.stats()["tokens"]["prompt"]
        events = engine.stream(prompt, GREEDY, request_id="long")
        assert next(events).finish_reason is None  # admitted: its first idle pass is dispatched
        engine.cancel("long")
        assert [ev.finish_reason for ev in events][-1] == "cancelled"
        dispatched = engine.stats()["tokens"]["prompt"] - before
        assert 128 <= dispatched <= 3 * 128, dispatched  # of 3800: the passes dispatched before the cancel landed
        assert engine.stats()["scheduler"]["idle_prefill_chunks"] >= 1
        assert engine.generate(prompt[:100], GREEDY).finish_reason == "length"  # it serves the next one
        engine.check_ledger()


def test_published_stats_answer_while_the_engine_thread_is_busy(engine8, monkeypatch):
    entered, gate, step = threading.Event(), threading.Event(), engine8.scheduler.step
    monkeypatch.setattr(engine8.scheduler, "step", lambda: (entered.set(), gate.wait(10), step())[2])
    try:
        assert entered.wait(5)  # the engine's thread is now inside a step that waits for the gate
        time.sleep(0.1)
        start = time.perf_counter()
        published = engine8.published_stats()
        assert time.perf_counter() - start < 1.0
        assert published["requests"]["running"] == 0 and published["failed"] is None
        assert published["prefix_cache"]["enabled"] and published["stats_age_s"] >= 0.1
    finally:
        gate.set()


def test_startup_compiles_each_program_once_on_its_threads_and_reports_its_progress(checkpoint):
    seen, compiled = [], []

    def heard(event, seconds, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":  # a compile, or a load from jax's cache
            compiled.append((fun_name, threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        with Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=64, max_model_len=256,
                                    kv_capacity=8 * 64, compile_threads=2,
                                    progress=lambda *event: seen.append(event)) as engine:
            stages = [stage for stage, _, _ in seen]
            loading = [e for e in seen if e[0] == "loading"]
            compiling = [e for e in seen if e[0] == "compiling"]
            assert loading[-1][1] == loading[-1][2] == engine.config.num_layers
            assert [done for _, done, _ in compiling] == list(range(1, len(compiling) + 1))
            assert compiling[-1][2] == len(compiling)
            assert stages.index("loading") < stages.index("compiling") and seen[-1] == ("ready", 1, 1)
            # Compiled ahead on the pool's threads, each program once: the warm-up's runs compiled nothing more.
            steps = {f"jit({fn.__name__})": name for name, fn in engine.runner._steps.items()}
            ours = [(steps[f], thread) for f, thread in compiled if f in steps]
            assert {thread.split("_")[0] for _, thread in ours} == {"compile"}
            at_start = collections.Counter(name for name, _ in ours)
            assert at_start == {name: n for name, n in engine.runner.compile_counts().items() if n}
            assert at_start["prefill"] == at_start["decode"] == 2 and at_start["logprobs"] == 1  # greedy, full
            compiled.clear()
            engine.generate_many([[1, 2, 3], [4, 5, 6, 7]], [GREEDY, SamplingParams(
                max_tokens=3, temperature=0.7, seed=1, logprobs=2, repetition_penalty=1.1)])
            assert [f for f, _ in compiled if f in steps] == [] and engine.stats()["compiles_since_warmup"] == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)


def test_cancel_mid_decode_frees_everything(engine8):
    prompt = _prompts(1, seed=11)[0]
    seen = []
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for ev in engine8.stream(prompt, sp, request_id="to-cancel"):
        seen.append(ev)
        if sum(len(e.token_ids) for e in seen) >= 3 and len(seen) == 4:
            assert engine8.cancel("to-cancel")
    assert seen[-1].finish_reason == "cancelled"
    assert 3 <= seen[-1].usage.completion_tokens < 200


def test_a_lane_alone_that_the_pool_cannot_extend_ends_with_bounded_completion(checkpoint):
    # 6 pages, two lanes admitted with 3 each: the junior is preempted for the senior, which then grows alone to the
    # whole pool and ends there; then the junior resumes and does the same.
    with Engine.from_pretrained(checkpoint, max_concurrency=2, prefill_chunk=64, max_model_len=512,
                                kv_capacity=6 * 64, output_window=64) as engine:
        prompts = [_prompts(1, seed=12)[0][:100], _prompts(1, seed=13)[0][:100]]
        outs = engine.generate_many(prompts, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        assert [o.finish_reason for o in outs] == ["length", "length"]
        # each fed every position of the pool's 6 pages, and its last token sampled from the last one
        assert [len(p) + o.usage.completion_tokens for p, o in zip(prompts, outs)] == [6 * 64 + 1] * 2
        stats = engine.stats()
        assert stats["requests"]["requests_preempted"] == 1 and stats["scheduler"]["pages_extended"] > 0
        engine.check_ledger()
        pages = engine.stats()["pages"]
        assert pages["active"] == 0 and pages["free"] + pages["cached"] == 6  # finished blocks stay cached


def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine8):
    with pytest.raises(PromptTooLongError, match="max_model_len is 512"):
        engine8.generate(list(range(600)), GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine8.generate([1, 2, ORACLE_VOCAB + 5], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine8.generate([], GREEDY)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine8.generate("text needs a tokenizer", GREEDY)
    for bad in ({"prompt_token_ids": [1, 2], "salt": "a"}, {"prompt": "x", "prompt_token_ids": [1]}, {},
                {"prompt_token_ids": [1, 2], "cache_salt": ""}):
        with pytest.raises(InvalidRequestError, match="prompt dict|cache_salt"):
            engine8.generate(bad, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert engine8.generate([1, 2, 3], GREEDY).usage.completion_tokens == 12


def test_truncate_prompt_tokens_keeps_the_last_tokens_before_the_length_check(engine8):
    prompt = _prompts(1, seed=21)[0] * 5  # 5 x 5..150 ids
    kept = engine8.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=40))
    alone = engine8.generate(prompt[-40:], SamplingParams(max_tokens=6, temperature=0.0))
    assert kept.token_ids == alone.token_ids and kept.usage.prompt_tokens == 40
    # -1: a prompt past max_model_len keeps what leaves room for one token
    longest = engine8.generate(list(range(600)), SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert longest.usage.prompt_tokens == 511 and longest.usage.completion_tokens == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_prompt_larger_than_the_pool_is_refused(checkpoint):
    with Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=64, max_model_len=512,
                                kv_capacity=2 * 64, warmup=False) as engine:
        with pytest.raises(PromptTooLongError, match="the KV pool holds 128 tokens"):
            engine.generate(list(range(200)), GREEDY)


def test_stop_answers_queued_requests_as_unavailable(checkpoint):
    engine = Engine.from_pretrained(checkpoint, max_concurrency=1, prefill_chunk=64, max_model_len=512,
                                    warmup=False)
    results = []
    for p in _prompts(3, seed=14):
        engine.submit(p, SamplingParams(max_tokens=100, ignore_eos=True),
                      sink=lambda ev: ev.finish_reason and results.append(ev.finish_reason))
    engine.stop()
    assert sorted(results) == ["unavailable"] * 3 or ("unavailable" in results and len(results) == 3)


def test_pallas_engine_with_its_fused_decode_kernels_matches_transformers(checkpoint, hf_greedy):
    """The engine on the Pallas kernels (interpret mode) turns on its fused kernels (the GDN decode layer, the add +
    norm, the MoE router, the attention decode's norms and KV writes, the GDN prefill's conv), as it does on a GPU;
    two concurrent greedy requests still decode exactly what transformers' generate does."""
    prompts = _prompts(2, seed=23)
    with Engine.from_pretrained(checkpoint, kernels="pallas", interpret=True, max_concurrency=2, prefill_chunk=64,
                                max_model_len=512, warmup=False) as engine:
        kernels = engine.runner.kernels
        assert kernels.fuse_gdn_decode and kernels.fuse_add_norm and kernels.fuse_moe_route
        assert kernels.fuse_attn_qkv and kernels.fuse_gdn_conv
        outs = engine.generate_many(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 6)


def test_a_dummy_load_serves_random_weights_at_a_configs_shapes(tmp_path):
    """load_format dummy: a config .json is enough (random weights, seed 0, the built-in Qwen3.5 tokenizer and a
    random vision tower when the config has one); a folder without config.json is refused by name."""
    from ninfer_jax.config import ConfigError, ModelConfig
    from ninfer_jax.model.loader import load_dummy
    from ninfer_jax.model.tiny import CONFIG_DIR

    config = CONFIG_DIR / "tiny-moe.json"
    with Engine.from_pretrained(config, load_format="dummy", max_concurrency=1, max_model_len=256,
                                kernels="reference", warmup=False) as engine:
        assert engine.config == ModelConfig.from_file(config) and engine.model_name == "tiny-moe"
        assert engine.vision is not None and engine.tokenizer.token_to_id("<|image_pad|>") == 248056
        out = engine.generate("Hello there", SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        assert len(out.token_ids) == 1
        again = load_dummy(config, "float32")[1]  # seed 0: the same weights on every load
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(engine.runner.params), jax.tree.leaves(again)))
    with pytest.raises(ConfigError, match="config.json"):
        Engine.from_pretrained(tmp_path, load_format="dummy", warmup=False)


def test_background_compile_serves_at_the_first_sizes_and_no_request_waits_on_a_compile(checkpoint, monkeypatch,
                                                                                         hf_forward_greedy):
    """background_compile: the engine serves once passes of the first size and rounds of one lane are compiled
    (the constants shrunk to the tiny engine's sizes); the rest compile on other threads meanwhile and the steps
    take them once all are; no step compiles on the engine's thread, and the tokens are the oracle's either way. Full
    garbage collections are deferred meanwhile, then the survivors frozen."""
    monkeypatch.setattr(buckets, "FIRST_PASS_TOKENS", 64)
    monkeypatch.setattr(buckets, "FIRST_LANES", 1)
    gate, compiled = threading.Event(), []
    real = ModelRunner.compile_rest

    def gated(self, *args, **kwargs):
        gate.wait(60)
        return real(self, *args, **kwargs)

    def heard(event, seconds, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append((fun_name, threading.current_thread().name))

    monkeypatch.setattr(ModelRunner, "compile_rest", gated)
    prompts, others = _prompts(3, seed=41), _prompts(3, seed=42)
    thresholds = gc.get_threshold()
    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        with Engine.from_pretrained(checkpoint, max_concurrency=4, prefill_chunk=128, max_model_len=512,
                                    kv_capacity=32 * 64, background_compile="on", compile_threads=1) as engine:
            runner = engine.runner
            assert (runner.ready.prefill, runner.ready.decode, runner.configured().decode) == ((64,), (1,), (1, 2, 4))
            outs = engine.generate_many(prompts, GREEDY)  # one lane at a time, passes of 64 tokens
            stats = engine.stats()
            assert stats["compiling_in_background"] and stats["compiles_since_warmup"] == 0
            assert stats["scheduler"]["decode_rounds"] == 3 * 11  # one lane per round
            assert gc.get_threshold()[2] == engine_module.DEFERRED_FULL_COLLECTIONS  # while it compiles
            gate.set()
            assert engine.wait_compiled(120)
            assert gc.get_threshold() == thresholds and gc.get_freeze_count() > 0
            rounds = engine.stats()["scheduler"]["decode_rounds"]
            again = engine.generate_many(others, GREEDY)  # lanes together, passes of 128
            stats = engine.stats()
            assert not stats["compiling_in_background"] and stats["compiles_since_warmup"] == 0
            assert stats["scheduler"]["decode_rounds"] - rounds < 2 * 11  # lanes share rounds
            steps = {f"jit({fn.__name__})" for fn in runner._steps.values()}
            assert not [f for f, thread in compiled if f in steps and thread == "ninfer-engine"]
            assert any(thread.startswith("compile") for f, thread in compiled if f in steps)
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    for prompt, out in zip(prompts + others, outs + again):
        assert out.token_ids == hf_forward_greedy(prompt, out.token_ids)
