"""Device time of one decode round under variants of its pieces, side by side in one process (interleaved).

  default        the engine as it is
  one_row_dot    a one-row projection handed to XLA as a vector x matrix dot (the engine before session 10):
                 XLA's GPU compiler strength-reduces it into multiply + reduce
  shared_apart   the MoE shared expert as the model's own matmuls (before session 10), not rows of the expert
                 kernels
  gdn_fused      the GDN decode between its projections as one kernel (KernelConfig.fuse_gdn_decode)
  moe_gemv_*     the narrow-decode MoE kernels (moe.MoeConfig gemv_* fields) with other tiles

Random bf16 weights at the real shapes, Pallas kernels, one idle engine; rounds at position 1024 dispatched back
to back (as profile_decode.py), each variant's programs compiled first, then all variants timed in turn,
`--repeats` times; medians. Before the timing, each variant runs one round from the same copy of the state: its
greedy tokens and their log-probabilities are checked against the first variant's. Each variant's host time to dispatch one round on an idle GPU is taken too (the
worker dispatches a round while the previous one runs, so a round costs the larger of the two). A profiler trace
of the first variant's one-lane round gives its largest kernels; `--host-costs` times what a jitted call's host
side pays for its arguments (the model's parameter and state pytrees) and for its number of kernels.

    python scripts/decode_round_probe.py --models 35b-a3b,27b --out $OUT/decode_round_probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

from bench_engine import MODELS, ROOT
from profile_decode import _decode_inputs, kernel_table, time_rounds

MOE_GEMV = {  # MoeConfig fields replaced for rows <= gemv_max_rows
    "moe_gemv_splits16": dict(gemv_splits=16, gemv_down_splits=4),
    "moe_gemv_block_n64": dict(gemv_block_n=64, gemv_down_block_n=64),
    "moe_gemv_block_k128": dict(gemv_block_k=128, gemv_down_block_k=128, gemv_splits=4, gemv_down_splits=1),
    "moe_gemv_warps8": dict(gemv_num_warps=8),
    "moe_gemv_warps2_splits16": dict(gemv_num_warps=2, gemv_splits=16, gemv_down_splits=4),
}
VARIANTS = ("default", "one_row_dot", "shared_apart", "gdn_fused", *MOE_GEMV)


def _one_row_dot(x, w):
    import jax.numpy as jnp

    return jnp.dot(x, w, preferred_element_type=x.dtype)


def _moe_shared_apart(p, x, cfg, kc):
    import jax

    from ninfer_jax.model import ops, qwen3_5

    ids, weights = qwen3_5.moe_route_ref(x, p.router, cfg.num_experts_per_tok)
    routed = ops.moe_experts(kc, x, ids, weights, p.gate_up, p.down).astype(x.dtype)
    return routed + qwen3_5.mlp(p.shared, x) * jax.nn.sigmoid(qwen3_5._dot(x, p.shared_gate))


@dataclasses.dataclass
class _Patch:
    """Module attributes a variant replaces while its programs are traced (each variant has its own jit)."""

    dot: object = None
    moe_layer: object = None
    moe: dict | None = None

    def __enter__(self):
        from ninfer_jax.model import qwen3_5
        from pallas_kernels import moe

        self.saved = qwen3_5._dot, qwen3_5.moe, moe.default_config
        if self.dot is not None:
            qwen3_5._dot = self.dot
        if self.moe_layer is not None:
            qwen3_5.moe = self.moe_layer
        if self.moe is not None:
            base, fields = moe.default_config, self.moe

            def config(rows, num_experts):
                cfg = base(rows, num_experts)
                return dataclasses.replace(cfg, **fields) if rows <= cfg.gemv_max_rows else cfg

            moe.default_config = config

    def __exit__(self, *exc):
        from ninfer_jax.model import qwen3_5
        from pallas_kernels import moe

        qwen3_5._dot, qwen3_5.moe, moe.default_config = self.saved


def _patch(variant: str) -> _Patch:
    if variant == "one_row_dot":
        return _Patch(dot=_one_row_dot)
    if variant == "shared_apart":
        return _Patch(moe_layer=_moe_shared_apart)
    return _Patch(moe=MOE_GEMV.get(variant))


def host_ms(call, calls: int) -> float:
    """Median host time (ms) of `call()` on an idle GPU: its return, not its completion (each call's results
    are waited for before the next)."""
    import time

    import jax

    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        out = call()
        seconds.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return statistics.median(seconds) * 1e3


def dispatch_ms(engine, lanes: int, calls: int = 20) -> float:
    """Median host time (ms) to dispatch one decode round of `lanes` lanes."""
    args = _decode_inputs(engine, lanes, 1024)
    return host_ms(lambda: engine.runner.decode(*args), calls)


def agreement(engine, variants, steps, kernels, lanes: int) -> dict:
    """Each variant's round from one copy of the state: its greedy tokens and their log-probabilities against the
    first variant's (the variants must compute the same model on the device, up to rounding)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    runner = engine.runner
    start = jax.tree.map(jnp.copy, runner.state)
    outs = {}
    for v in variants:
        runner.state = jax.tree.map(jnp.copy, start)
        runner._steps["decode"], runner.kernels = steps[v], kernels[v]
        tokens, chosen, _ = runner.decode(*_decode_inputs(engine, lanes, 1024))
        outs[v] = np.asarray(tokens)[:lanes], np.asarray(chosen)[:lanes]
    runner.state = start
    base_tokens, base_logprobs = outs[variants[0]]
    return {v: {"lanes": lanes, "same_tokens": int((t == base_tokens).sum()),
                "max_logprob_diff": float(np.abs(lp - base_logprobs).max())} for v, (t, lp) in outs.items()}


def host_costs(engine) -> dict:
    """Host ms of one call (idle GPU) of jitted functions that take what the decode step takes, and of one with
    1200 unfused kernels: what the call's arguments and its kernel count cost before the device starts."""
    import jax
    import jax.numpy as jnp

    runner = engine.runner
    x = jnp.ones((8, 64), jnp.int32)

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))  # compiled first
        return host_ms(lambda: fn(*a), 30)

    def chain(y):  # barriers keep XLA from fusing: one kernel per step
        for i in range(1200):
            y = jax.lax.optimization_barrier(jnp.sin(y) * (1.0 + i * 1e-6))
        return y

    costs = {
        "one_array_ms": median_ms(jax.jit(lambda a: a + 1), x),
        "params_ms": median_ms(jax.jit(lambda p, a: a + 1), runner.params, x),
        "params_and_state_ms": median_ms(jax.jit(lambda p, s, a: a + 1), runner.params, runner.state, x),
        "kernels_1200_ms": median_ms(jax.jit(chain), jnp.ones((1, 2048), jnp.float32)),
        "param_leaves": len(jax.tree.leaves(runner.params)),
        "state_leaves": len(jax.tree.leaves(runner.state)),
    }
    print("host costs: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in costs.items()), flush=True)
    return costs


def probe(name: str, args) -> dict:
    import jax

    from ninfer_jax import Engine
    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime import runner as runner_module
    from ninfer_jax.runtime.options import EngineOptions

    cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS[name]}.json")
    opts = EngineOptions(dtype="bfloat16", max_concurrency=8, prefill_chunk=2048, max_model_len=8192,
                         kv_capacity=65536, kernels=args.kernels, no_prefix_reuse=True)
    engine = Engine(cfg, random_params(cfg, seed=0), opts, model_name=name, warmup=False)
    runner = engine.runner
    lanes_list = [int(n) for n in args.lanes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    steps, kernels = {}, {}
    for v in variants:  # each variant traces and compiles its own decode programs, untimed
        steps[v] = jax.jit(runner_module._own(runner_module._decode_step),
                           static_argnames=("cfg", "kc", "full", "top_k_groups"), donate_argnames=("state",))
        kernels[v] = dataclasses.replace(engine.runner.kernels, fuse_gdn_decode=v == "gdn_fused")
        runner._steps["decode"], runner.kernels = steps[v], kernels[v]
        with _patch(v):
            for lanes in lanes_list:
                jax.block_until_ready(runner.decode(*_decode_inputs(engine, lanes, 1024)))
    check = agreement(engine, variants, steps, kernels, max(lanes_list))
    for v, row in check.items():
        print(f"[{name}] {v} against {variants[0]}: {row['same_tokens']}/{row['lanes']} greedy tokens equal, "
              f"chosen log-probabilities within {row['max_logprob_diff']:.2e}", flush=True)
    runs = {v: {n: [] for n in lanes_list} for v in variants}
    dispatch = {v: {n: [] for n in lanes_list} for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            runner._steps["decode"], runner.kernels = steps[v], kernels[v]
            for lanes in lanes_list:
                runs[v][lanes].append(time_rounds(engine, lanes, args.rounds, sync=False) * 1e3)
                dispatch[v][lanes].append(dispatch_ms(engine, lanes))
    result = {"model": name, "variants": {}}
    for v in variants:
        row = {f"{n}lane_ms": statistics.median(t) for n, t in runs[v].items()} | {"agreement": check[v]}
        row |= {f"{n}lane_dispatch_ms": statistics.median(t) for n, t in dispatch[v].items()}
        row["runs_ms"] = {str(n): t for n, t in runs[v].items()}
        result["variants"][v] = row
        print(f"[{name}] {v}: " + ", ".join(f"{n} lanes {row[f'{n}lane_ms']:.3f} ms back to back, "
                                            f"{row[f'{n}lane_dispatch_ms']:.3f} ms to dispatch" for n in lanes_list)
              + f" (runs {runs[v]})", flush=True)
    if args.host_costs:
        result["host_costs"] = host_costs(engine)
    runner._steps["decode"], runner.kernels = steps[variants[0]], kernels[variants[0]]
    trace_dir = Path(args.trace_dir) / name
    decode_args = _decode_inputs(engine, 1, 1024)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.trace_rounds):
            out = runner.decode(*decode_args)
        jax.block_until_ready(out)
    result["kernels_1lane"] = kernel_table(trace_dir, args.trace_rounds, args.top)
    for r in result["kernels_1lane"]:
        print(f"[{name}] {variants[0]} {r['us_per_round']:9.1f} us {r['launches_per_round']:6.1f}x  {r['kernel']}",
              flush=True)
    engine.stop()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="35b-a3b")
    ap.add_argument("--kernels", default="pallas")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"first is traced; from {', '.join(VARIANTS)}")
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-rounds", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/ninfer_round_trace")
    ap.add_argument("--host-costs", action="store_true", help="also time a call's host side by what it is handed")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS) - {""}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    import jax

    rows = [probe(m, args) for m in args.models.split(",")]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "command": "python3 scripts/decode_round_probe.py " + " ".join(sys.argv[1:]), "models": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
