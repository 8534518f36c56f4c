"""Correctness at width: 64 lanes serving distinct and repeated prompts, greedy and seeded sampling, some cancelled
mid-way, then a second wave that resumes them from the Host tier while more requests wait than there are lanes.
Every output equals the same request run alone on an engine without a prefix cache; admission stays FIFO and waits
for pages when they run out; the ledgers close."""

import threading

import numpy as np
import pytest

from ninfer_jax import Engine, SamplingParams
from cache_support import settle_host, tokens

LANES = 64
COMMON = dict(prefill_chunk=64, max_model_len=320, output_window=16)
# 136 pages for 64 lanes of one to three pages each: admission waits for pages at times (§9.5). 32 MiB of Host
# (256 slabs) hold the first wave's blocks and snapshots. Compiling a round for every power of two up to 64 lanes
# would take most of the test's time on a CPU, so every round runs all 64 rows (batch_invariant): the scheduler and
# the cache do the same work either way, and tests/runtime covers the round sizes.
WIDE = {**COMMON, "max_concurrency": LANES, "kv_capacity": 136 * 64, "host_cache_mib": 32, "warmup": False,
        "batch_invariant": True}


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny-dense", "text", seed=41)


def _sampling(i: int) -> SamplingParams:
    if i % 3 == 2:  # seeded sampling: the same tokens alone or among others
        return SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
    return SamplingParams(max_tokens=4 + i % 4, temperature=0.0, ignore_eos=True)


def _serve(engine, prompts, samplings, cancel_after):
    """Submits every request in order; cancels request i once it has cancel_after[i] tokens. Returns (outputs,
    the order in which requests were admitted)."""
    done = threading.Event()
    outputs, admitted, lock = {}, [], threading.Lock()

    def sink_for(i):
        got = []

        def sink(event):
            with lock:
                if event.usage is not None and i not in admitted and event.finish_reason is None:
                    admitted.append(i)
                got.extend(event.token_ids)
                if i in cancel_after and len(got) >= cancel_after[i] and event.finish_reason is None:
                    engine.cancel(f"w{i}")
                if event.finish_reason is not None:
                    outputs[i] = (tuple(got), event.finish_reason)
                    if len(outputs) == len(prompts):
                        done.set()
        return sink

    for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
        engine.submit(prompt, sampling, request_id=f"w{i}", sink=sink_for(i))
    assert done.wait(120)
    return [outputs[i] for i in range(len(prompts))], admitted


def test_sixty_four_lanes_equal_one_at_a_time_with_cancels_host_restores_and_prefetch(checkpoint):
    rng = np.random.default_rng(5)
    distinct = [tokens(int(n), 100 + k) for k, n in enumerate(rng.integers(40, 180, 40))]
    prompts = distinct + [distinct[k] for k in rng.integers(0, 40, LANES - 40)]  # 24 repeats, some while prefilling
    samplings = [_sampling(i) for i in range(LANES)]
    cancel_after = {i: 2 for i in range(3, LANES, 9)}
    with Engine.from_pretrained(checkpoint, max_concurrency=1, no_prefix_reuse=True, warmup=False,
                                **COMMON) as alone, Engine.from_pretrained(checkpoint, **WIDE) as wide:
        outputs, admitted = _serve(wide, prompts, samplings, cancel_after)
        assert admitted == sorted(admitted)  # FIFO: no request overtakes a blocked head (§6.3)
        assert wide.stats()["scheduler"]["admission_blocked"] > 0  # heads waited for pages at times
        reference = {}
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
            key = (tuple(prompt), sampling)
            if key not in reference:
                reference[key] = alone.generate(prompt, sampling).token_ids
            got, reason = outputs[i]
            if i in cancel_after:
                assert reason == "cancelled" and got == reference[key][:len(got)], i
            else:
                assert (got, reason) == (reference[key], "length"), i
        settle_host(wide, warmed=False)

        # Second wave, every Device copy dropped: 32 short new prompts that decode long, then one next turn of each
        # distinct prompt, the longest last. The 8 turns past the 64 lanes wait, and the head prefetches its Host
        # path while the lanes decode; admissions restore the rest.
        wide.demote_device_cache()
        before = wide.stats()["prefix_cache"]
        firsts = {tuple(p): i for i, p in reversed(list(enumerate(prompts)))}
        turns = [tokens(20, 400 + k) for k in range(32)] + sorted(
            (list(p) + list(reference[(p, samplings[i])]) + tokens(9, 300 + i) for p, i in firsts.items()), key=len)
        greedy = [SamplingParams(max_tokens=16 if k < 32 else 3 + k % 4, temperature=0.0, ignore_eos=True)
                  for k in range(len(turns))]
        second, admitted = _serve(wide, turns, greedy, {})
        assert admitted == sorted(admitted)
        after = wide.stats()["prefix_cache"]
        assert after["restored_images"] > before["restored_images"] and after["prefetches"] > before["prefetches"]
        assert all(reason == "length" for _, reason in second)
        for turn, sampling, (got, _) in list(zip(turns, greedy, second))[32:]:  # the first wave checked fresh prompts
            assert got == alone.generate(turn, sampling).token_ids
        settle_host(wide, warmed=False)
