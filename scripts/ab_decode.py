"""A/B of the engine's decode between two checkouts of this project, in alternating processes on one GPU.

Each process builds one engine (random bf16 weights at a real shape, 8 lanes, no prefix reuse), compiles the
rounds it times, then decodes `--tokens` tokens at 1 and at 8 lanes `--reps` times; the report is the median per
checkout. Alternating processes (A, B, A, B) spreads the machine's drift over both sides.

    git worktree add /tmp/base <commit>
    python scripts/ab_decode.py --a /tmp/base --b . --model 35b-a3b
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from ninfer_jax import Engine, SamplingParams
from ninfer_jax.config import ModelConfig
from ninfer_jax.model.random_init import random_params
from ninfer_jax.runtime.options import EngineOptions
root, config, tokens, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = ModelConfig.from_file(f"{root}/configs/{config}.json")
opts = EngineOptions(dtype="bfloat16", max_concurrency=8, max_model_len=33 * 1024, kernels="pallas",
                     no_prefix_reuse=True)
engine = Engine(cfg, random_params(cfg, seed=0), opts, model_name=config, warmup=False)
rng = np.random.default_rng(0)
sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
out = {}
for lanes in (1, 8):
    engine.generate_many([rng.integers(0, cfg.vocab_size, 256).tolist() for _ in range(lanes)],
                         SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # compiles its rounds
    rates = []
    for _ in range(reps):
        outs = engine.generate_many([rng.integers(0, cfg.vocab_size, 1024).tolist() for _ in range(lanes)], sp)
        span = max(o.metrics.latency_s for o in outs) - max(o.metrics.ttft_s for o in outs)
        rates.append(sum(o.usage.completion_tokens - 1 for o in outs) / span)
    out[lanes] = rates
engine.stop()
print("RESULT " + json.dumps(out))
"""

MODELS = {"27b": "qwen3.5-27b", "35b-a3b": "qwen3.5-35b-a3b"}


def run(root: str, config: str, tokens: int, reps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, root, config, str(tokens), str(reps)], capture_output=True,
                          text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", required=True, help="checkout B (the change)")
    p.add_argument("--model", default="35b-a3b", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=256, help="decoded tokens per request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="A, B pairs of processes")
    args = p.parse_args()
    rates: dict[str, dict[int, list[float]]] = {"a": {1: [], 8: []}, "b": {1: [], 8: []}}
    for _ in range(args.rounds):
        for side in ("a", "b"):
            result = run(getattr(args, side), MODELS[args.model], args.tokens, args.reps)
            for lanes, values in result.items():
                rates[side][lanes] += values
            print(f"{side}: " + ", ".join(f"{lanes} lanes {statistics.median(v):.1f} tok/s"
                                          for lanes, v in result.items()), flush=True)
    for lanes in (1, 8):
        a, b = statistics.median(rates["a"][lanes]), statistics.median(rates["b"][lanes])
        print(f"{lanes} lanes: A {a:.1f} tok/s, B {b:.1f} tok/s, B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
