"""The serving benchmark's workloads (the same requests for a seed, ShareGPT's published means, vLLM's bounds) and
its client's measures against a live server."""

import asyncio

import numpy as np
import pytest

from ninfer_jax.benchmarks import serving
from server_support import LiveServer, ScriptedEngine


def test_the_workloads_repeat_for_a_seed_and_keep_sharegpts_means_within_the_bounds():
    first, again = serving.workload("sharegpt", 2000, seed=3), serving.workload("sharegpt", 2000, seed=3)
    assert first == again and first != serving.workload("sharegpt", 2000, seed=4)
    inputs = np.array([len(r.prompt) for r in first])
    outputs = np.array([r.output_tokens for r in first])
    assert inputs.min() >= 4 and outputs.min() >= 4 and inputs.max() <= 1024 and (inputs + outputs).max() <= 2048
    # the bounds cut the long tail, so the means land a little below the published 161 and 338
    assert 120 < inputs.mean() < 162 and 250 < outputs.mean() < 338
    assert len({tuple(r.prompt[:8]) for r in first}) == 2000  # no two share a prefix
    fixed = serving.workload("fixed", 3)
    assert [(len(r.prompt), r.output_tokens) for r in fixed] == [(1024, 1024)] * 3
    with pytest.raises(ValueError, match="workload must be"):
        serving.workload("alpaca", 1)


class _Preempting(ScriptedEngine):
    """Counts a preemption for each request, as the engine's stats would."""

    def _prepare(self, prompt):
        self.counters["requests_preempted"] += 1
        return super()._prepare(prompt)


def test_a_level_counts_every_token_and_measures_ttft_before_tpot():
    engine = _Preempting(token_delay=0.01)
    engine.counters["requests_preempted"] = 4  # before the level: not its own
    engine.default_text = "one two three four five six seven eight nine ten " * 4
    requests = [serving.BenchRequest(list(range(1000, 1000 + n)), 6) for n in (5, 9, 17, 30, 41)]
    with LiveServer(engine) as live:
        level = asyncio.run(serving.run_level(live.url, engine.model_name, requests, concurrency=2))
    assert level["requests"] == 5 and level["errors"] == 0 and level["output_tokens"] == 30
    assert level["input_tokens"] == 5 + 9 + 17 + 30 + 41 and level["preemptions"] == 5
    assert level["output_tok_s"] * level["wall_s"] == pytest.approx(30, rel=0.01)
    assert 10 <= level["tpot_p50_ms"] <= level["tpot_p99_ms"] < 200  # about the engine's 10 ms between tokens
    # every prompt went as its token ids (two at a time: in whichever order they arrived)
    assert level["ttft_p50_ms"] is not None and sorted(p.num_tokens for p in engine.prompts) == [5, 9, 17, 30, 41]
