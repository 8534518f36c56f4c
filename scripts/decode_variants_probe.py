"""Decode tokens/s of one engine under three round layouts, side by side in one process (A/B/C, repeated).

  rows_topk2   the default: a round runs its active lanes padded to a power of two, and the logprobs' top-20
               runs in two stages on the GPU (sampling.grouped_top_k)
  rows_topk    the same rounds, lax.top_k for the logprobs
  full_topk    every round runs all max_concurrency rows and lax.top_k: the engine before both changes
               (full-width rounds are also what EngineOptions.batch_invariant gives)

Random bf16 weights at the real shapes, Pallas kernels, 8 lanes, 1024-token prompts; decode tokens/s is
measured as in bench_engine.py (after the last first token until the last finish). Each layout's programs
compile in an untimed warm-up first.

    python scripts/decode_variants_probe.py --models 35b-a3b,27b --out $OUT/decode_variants_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

from bench_engine import MODELS, ROOT

VARIANTS = {"rows_topk2": (None, None), "rows_topk": (None, 0), "full_topk": ("full", 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="35b-a3b")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from ninfer_jax import Engine, SamplingParams
    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime.options import EngineOptions

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "command": " ".join(["python"] + sys.argv), "models": {}}
    for name in args.models.split(","):
        cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS[name]}.json")
        params = random_params(cfg, seed=0)
        opts = EngineOptions(dtype="bfloat16", max_concurrency=8, prefill_chunk=2048, max_model_len=4096,
                             kernels="pallas", no_prefix_reuse=True)
        engine = Engine(cfg, params, opts, model_name=name, warmup=False)
        runner = engine.runner
        defaults = (runner.decode_sizes, runner.top_k_groups)
        rng = np.random.default_rng(0)
        # Logprobs asked for: since session 14 only such rounds run the top-20 these variants are about
        decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True, logprobs=20)

        def use(variant):
            sizes, groups = VARIANTS[variant]
            runner.decode_sizes = (runner.max_lanes,) if sizes == "full" else defaults[0]
            runner.top_k_groups = defaults[1] if groups is None else groups

        def tok_s(lanes):
            outs = engine.generate_many([rng.integers(0, cfg.vocab_size, 1024).tolist() for _ in range(lanes)],
                                        decode)
            span = max(o.metrics.latency_s for o in outs) - max(o.metrics.ttft_s for o in outs)
            return sum(o.usage.completion_tokens - 1 for o in outs) / span

        t = time.perf_counter()
        for variant in VARIANTS:  # compile every layout's programs, untimed
            use(variant)
            tok_s(8), tok_s(1)
        print(f"[{name}] warm-up {time.perf_counter() - t:.1f} s", flush=True)
        runs = {v: {1: [], 8: []} for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                use(variant)
                for lanes in (1, 8):
                    runs[variant][lanes].append(tok_s(lanes))
        rows = {}
        for variant, by_lanes in runs.items():
            rows[variant] = {f"decode_{n}lane_tok_s": statistics.median(v) for n, v in by_lanes.items()}
            rows[variant]["runs"] = {str(n): v for n, v in by_lanes.items()}
            print(f"[{name}] {variant}: 1 lane {rows[variant]['decode_1lane_tok_s']:.1f} tok/s, 8 lanes "
                  f"{rows[variant]['decode_8lane_tok_s']:.1f} tok/s (runs {by_lanes})", flush=True)
        report["models"][name] = rows
        report["models"][name]["compiles_since_warmup"] = engine.stats()["compiles_since_warmup"]
        engine.stop()
        del engine, runner, params
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
