"""Time the decode step's sampling tail at the Qwen3.5 vocabulary: is lax.top_k worth replacing?

Every decode round ends in `sampling.sample`: argmax (greedy), log_softmax, and the top-20 logprobs
through `lax.top_k` over the 248,320-token vocabulary; the full sampler (temperature > 0) also argsorts
the whole row. The 35B-A3B decode profile showed sort kernels for this (docs/benchmarks/decode_profile.md).
This probe times, at the top level of one jit each (a top-k inside a loop can force a full sort and
mislead), for B = 1 and 8 rows of float32 logits:

  sample_greedy   sampling.sample(full=False) + token_logprobs (lax.top_k): what a greedy round ran when this
                  probe was written (every round computed the top-20; since session 14 only rounds that ask do)
  sample_full     sampling.sample(full=True) + token_logprobs (lax.top_k), with any sampled lane
  top_k           lax.top_k(logp, 20) alone
  top_k_2stage    sampling.grouped_top_k with G groups: top-20 of each group, then of the G*20 candidates (same
                  values and ids; what the GPU runs since this probe)
  argmax_lsm      argmax + log_softmax alone (the floor under sample_greedy)

  python scripts/sampler_topk_probe.py --out $OUT/sampler_topk_probe.json     # on the GPU
  python scripts/sampler_topk_probe.py --vocab 4096 --reps 3                   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_jax.runtime.sampling import MAX_LOGPROBS, grouped_top_k, sample, token_logprobs  # noqa: E402


def sample_with_logprobs(logits, inputs, full: bool, k: int):
    tokens = sample(logits, inputs, full=full)
    return tokens, token_logprobs(logits, tokens, num_logprobs=k)


def timed(fn, args, reps: int) -> float:
    """Median seconds per call over `reps` calls of 20 back-to-back dispatches each."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(20)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--groups", default="64,256,1024")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    k = MAX_LOGPROBS
    results = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "vocab": args.vocab,
                        "k": k, "command": " ".join(["python"] + sys.argv)}, "rows": {}}
    for b in (int(r) for r in args.rows.split(",")):
        rng = np.random.default_rng(b)
        logits = jnp.asarray(rng.standard_normal((b, args.vocab), np.float32) * 3)
        logp = jax.nn.log_softmax(logits, axis=-1)
        inputs = (jnp.full((b,), 0.7, jnp.float32), jnp.full((b,), 40, jnp.int32), jnp.full((b,), 0.9, jnp.float32),
                  jnp.arange(b, dtype=jnp.int32), jnp.zeros((b,), jnp.int32))
        fns = {
            "sample_greedy": (jax.jit(lambda x, i: sample_with_logprobs(x, i, False, k)), (logits, inputs)),
            "sample_full": (jax.jit(lambda x, i: sample_with_logprobs(x, i, True, k)), (logits, inputs)),
            "argmax_lsm": (jax.jit(lambda x: (jnp.argmax(x, -1), jax.nn.log_softmax(x, -1))), (logits,)),
            "top_k": (jax.jit(lambda x: jax.lax.top_k(x, k)), (logp,)),
        }
        want_v, want_i = map(np.asarray, fns["top_k"][0](logp))
        for g in (int(v) for v in args.groups.split(",")):
            fn = jax.jit(lambda x, g=g: grouped_top_k(x, k, g))
            got_v, got_i = map(np.asarray, fn(logp))
            if not (np.array_equal(got_v, want_v) and np.array_equal(got_i, want_i)):
                raise AssertionError(f"two-stage top-k with {g} groups differs from lax.top_k")
            fns[f"top_k_2stage_g{g}"] = (fn, (logp,))
        row = {}
        for name, (fn, a) in fns.items():
            row[name] = timed(fn, a, args.reps)
            print(f"B={b} {name}: {row[name] * 1e3:.4f} ms", flush=True)
        results["rows"][str(b)] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
