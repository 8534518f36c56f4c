"""Device time of one decode round under variants of its pieces, side by side in one process (interleaved).

  default        the engine as it is
  one_row_dot    a one-row projection handed to XLA as a vector x matrix dot (the engine before session 10):
                 XLA's GPU compiler strength-reduces it into multiply + reduce
  shared_apart   the MoE shared expert as the model's own matmuls (before session 10), not rows of the expert
                 kernels
  gdn_unfused    the GDN decode as XLA kernels around the delta-rule kernel (KernelConfig.fuse_gdn_decode off, the
                 engine before session 11; session 11's reports call the fused form, then the variant, gdn_fused)
  norm_unfused   each residual add + RMSNorm as XLA's kernels (KernelConfig.fuse_add_norm off; before session 11)
  attn_qkv_unfused the attention decode's q/k norms, RoPE and KV writes as XLA's kernels (KernelConfig.fuse_attn_qkv
                 off; before session 13. Session 13's run timed the other way round, as attn_qkv_fused)
  route_unfused  the MoE router after its logits as XLA's kernels, a sort for its top-k (KernelConfig.fuse_moe_route
                 off; before session 12. Session 12's first run timed the other way round, as route_fused)
  shared_gate_apart  the MoE shared expert's gate as XLA's kernels (before session 12), not inside the router kernel
  router_logits_f32  the router's logits from float32 copies of its operands (before session 12): XLA converted
                 and transposed the router weights every round
  two_rows_cut   a one-row output projection's duplicate row cut off before the add + norm kernel (before session
                 12): a copy kernel
  route_warps*, norm_warps*  the router or the add + norm kernel on other warps
  attn_min_pages*  paged decode attention with another floor of pages per split (DecodeConfig.min_pages_per_split;
                 1 is before session 12)
  gdn_layer_*    the fused GDN decode kernel with other warps or column blocks
  gdn_whole_heads  the GDN decode kernels with one program per (lane, head) whatever the lanes (before session
                 11: one lane ran 32 programs)
  moe_gemv_*     the narrow-decode MoE kernels (moe.MoeConfig gemv_* fields) with other tiles
  a+b            two variants at once (say gdn_unfused+gdn_whole_heads)

Random bf16 weights at the real shapes, Pallas kernels, one idle engine; rounds at position 1024 dispatched back
to back (as profile_decode.py), each variant's programs compiled first, then all variants timed in turn,
`--repeats` times; medians. Before the timing, each variant runs one round from the same copy of the state: its
greedy tokens, their log-probabilities and its top-20 log-probabilities are checked against the first variant's
(with random weights any change in a float32 sum's order moves them by 0.1-0.3, a broken kernel by whole nats).
Each variant's host time to dispatch one round on an idle GPU is taken too (the worker dispatches a round while
the previous one runs, so a round costs the larger of the two). A profiler trace of the first variant's one-lane
round (or of each of `--trace-variants`) gives its largest kernels; `--host-costs` times what a jitted call's host
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

# MoeConfig fields replaced for rows <= gemv_max_rows, each spelled out from the tiles before session 11 (8 and 2
# splits on 4 warps) so a name stays true when the defaults move
_SESSION10_GEMV = dict(gemv_splits=8, gemv_down_splits=2, gemv_num_warps=4)
MOE_GEMV = {name: _SESSION10_GEMV | fields for name, fields in {
    "moe_gemv_splits8": {},
    "moe_gemv_splits16": dict(gemv_splits=16, gemv_down_splits=4),
    "moe_gemv_block_n64": dict(gemv_block_n=64, gemv_down_block_n=64),
    "moe_gemv_block_k128": dict(gemv_block_k=128, gemv_down_block_k=128, gemv_splits=4, gemv_down_splits=1),
    "moe_gemv_warps8": dict(gemv_num_warps=8),
    "moe_gemv_warps2_splits16": dict(gemv_num_warps=2, gemv_splits=16, gemv_down_splits=4),
    "moe_gemv_stages2": dict(gemv_num_stages=2),
    "moe_gemv_stages1": dict(gemv_num_stages=1),
    "moe_gemv_bk32_splits16": dict(gemv_block_k=32, gemv_splits=16, gemv_down_block_k=32, gemv_down_splits=4),
    "moe_gemv_w2_s16_n64": dict(gemv_num_warps=2, gemv_splits=16, gemv_down_splits=4, gemv_block_n=64,
                                gemv_down_block_n=64),
    "moe_gemv_w2_s32": dict(gemv_num_warps=2, gemv_splits=32, gemv_down_splits=8),
    "moe_gemv_w2_s16_d8": dict(gemv_num_warps=2, gemv_splits=16, gemv_down_splits=8),
    "moe_gemv_w1_s16": dict(gemv_num_warps=1, gemv_splits=16, gemv_down_splits=4),
    "moe_gemv_w2_s16_d2": dict(gemv_num_warps=2, gemv_splits=16, gemv_down_splits=2),
    "moe_gemv_w2_s16_d1": dict(gemv_num_warps=2, gemv_splits=16, gemv_down_splits=1),
}.items()}
GDN_LAYER = {  # gdn_decode_layer.GdnDecodeLayerConfig fields replaced
    "gdn_layer_warps4": dict(num_warps=4),
    "gdn_layer_warps2": dict(num_warps=2),
    "gdn_layer_bv16": dict(min_programs=256),  # one lane: 16-column blocks, 256 programs
    "gdn_layer_bv64": dict(min_programs=64),  # one lane: 64-column blocks, 64 programs
}
ROUTE_WARPS = {"route_warps1": 1, "route_warps2": 2, "route_warps8": 8}  # moe_route.RouteConfig.num_warps
NORM_WARPS = {"norm_warps1": 1, "norm_warps2": 2, "norm_warps8": 8}  # rms_norm.AddNormConfig.num_warps
ATTN_MIN_PAGES = {f"attn_min_pages{n}": n for n in (1, 2, 4, 8, 16, 32)}  # DecodeConfig.min_pages_per_split
# "a+b" combines two
VARIANTS = ("default", "one_row_dot", "shared_apart", "gdn_unfused", "gdn_whole_heads", "norm_unfused",
            "attn_qkv_unfused", "route_unfused", "shared_gate_apart", "router_logits_f32", "two_rows_cut", *MOE_GEMV,
            *GDN_LAYER, *ROUTE_WARPS, *NORM_WARPS, *ATTN_MIN_PAGES)


def _one_row_dot(x, w, *, to_norm=False):  # qwen3_5._dot's signature: one row is one row whoever takes it
    import jax.numpy as jnp

    return jnp.dot(x, w, preferred_element_type=x.dtype)


def _moe_shared_apart(p, x, cfg, kc):
    import jax

    from ninfer_jax.model import ops, qwen3_5

    ids, weights, gate = ops.moe_route(kc, x, p.router, cfg.num_experts_per_tok, p.shared_gate)
    routed = ops.moe_experts(kc, x, ids, weights, p.gate_up, p.down).astype(x.dtype)
    return routed + qwen3_5.mlp(p.shared, x)[: x.shape[0]] * gate[:, None].astype(x.dtype)


def _shared_gate_apart(moe_route):
    def route(kc, x, router_w, top_k, shared_gate_w):
        from pallas_kernels import reference as ref

        ids, weights, _ = moe_route(kc, x, router_w, top_k)
        return ids, weights, ref.shared_expert_gate(x, shared_gate_w)

    return route


def _router_logits_f32(x, router_w):
    import jax.numpy as jnp

    return jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32).T)


def _dot_cut(dot):
    def cut(x, w, *, to_norm=False):
        return dot(x, w)

    return cut


def _clear_kernel_traces():
    """The kernels' entry points are jits of their own: their traces are cached by argument shapes and static
    arguments, which do not see a patched module default, so a cached trace would hand back another variant's
    kernels."""
    from pallas_kernels import gdn_decode, gdn_decode_layer, moe, moe_route, paged_attention, rms_norm

    for fn in (moe.moe_experts, gdn_decode.gdn_decode, gdn_decode_layer.gdn_decode_layer, moe_route.route,
               rms_norm.add_rms_norm, paged_attention.paged_decode_attention):
        fn.clear_cache()


@dataclasses.dataclass
class _Patch:
    """Module attributes a variant replaces while its programs are traced (each variant has its own jit)."""

    replace: list  # (module, attribute name, value)

    def __enter__(self):
        self.saved = [(m, a, getattr(m, a)) for m, a, _ in self.replace]
        for m, a, v in self.replace:
            setattr(m, a, v)
        _clear_kernel_traces()

    def __exit__(self, *exc):
        for m, a, v in self.saved:
            setattr(m, a, v)
        _clear_kernel_traces()


def _patch(variant: str) -> _Patch:
    from ninfer_jax.model import ops, qwen3_5
    from pallas_kernels import gdn_decode, gdn_decode_layer, moe, moe_route, paged_attention, rms_norm
    from pallas_kernels import reference as ref

    parts = variant.split("+")
    replace = []
    if "one_row_dot" in parts:
        replace.append((qwen3_5, "_dot", _one_row_dot))
    if "two_rows_cut" in parts:
        replace.append((qwen3_5, "_dot", _dot_cut(qwen3_5._dot)))
    if "shared_apart" in parts:
        replace.append((qwen3_5, "moe", _moe_shared_apart))
    if "shared_gate_apart" in parts:
        replace.append((ops, "moe_route", _shared_gate_apart(ops.moe_route)))
    if "router_logits_f32" in parts:
        replace.append((ref, "moe_router_logits", _router_logits_f32))
    for p in parts:
        if p in ATTN_MIN_PAGES:
            replace.append((paged_attention, "DEFAULT_DECODE_CONFIG", dataclasses.replace(
                paged_attention.DEFAULT_DECODE_CONFIG, min_pages_per_split=ATTN_MIN_PAGES[p])))
    for table, module in ((ROUTE_WARPS, moe_route), (NORM_WARPS, rms_norm)):
        for p in parts:
            if p in table:
                replace.append((module, "DEFAULT_CONFIG", dataclasses.replace(module.DEFAULT_CONFIG,
                                                                              num_warps=table[p])))
    if "gdn_whole_heads" in parts:
        replace += [(gdn_decode, "DEFAULT_CONFIG", dataclasses.replace(gdn_decode.DEFAULT_CONFIG, min_programs=0)),
                    (gdn_decode_layer, "DEFAULT_CONFIG",
                     dataclasses.replace(gdn_decode_layer.DEFAULT_CONFIG, min_programs=0))]
    layer_fields = {k: v for p in parts if p in GDN_LAYER for k, v in GDN_LAYER[p].items()}
    if layer_fields:
        replace.append((gdn_decode_layer, "DEFAULT_CONFIG", dataclasses.replace(gdn_decode_layer.DEFAULT_CONFIG,
                                                                                **layer_fields)))
    fields = {k: v for p in parts if p in MOE_GEMV for k, v in MOE_GEMV[p].items()}
    if fields:
        base = moe.default_config

        def config(rows, num_experts):
            cfg = base(rows, num_experts)
            return dataclasses.replace(cfg, **fields) if rows <= cfg.gemv_max_rows else cfg

        replace.append((moe, "default_config", config))
    return _Patch(replace)


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
        tokens, chosen, (_, top) = runner.decode(*_decode_inputs(engine, lanes, 1024), logprobs=True)
        outs[v] = np.asarray(tokens)[:lanes], np.asarray(chosen)[:lanes], np.asarray(top)[:lanes]
    runner.state = start
    base_tokens, base_logprobs, base_top = outs[variants[0]]
    # Random weights give nearly flat logits, where rounding alone can swap the greedy token; the top-20
    # log-probabilities (sorted values, whatever their ids) say whether the distributions agree.
    return {v: {"lanes": lanes, "same_tokens": int((t == base_tokens).sum()),
                "max_logprob_diff": float(np.abs(lp - base_logprobs).max()),
                "max_top20_logprob_diff": float(np.abs(top - base_top).max())} for v, (t, lp, top) in outs.items()}


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
    from ninfer_jax.runtime.device import runner as runner_module
    from ninfer_jax.runtime.options import EngineOptions

    cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS[name]}.json")
    opts = EngineOptions(dtype="bfloat16", max_concurrency=8, prefill_chunk=2048, max_model_len=args.max_model_len,
                         kv_capacity=65536, kernels=args.kernels, no_prefix_reuse=True,
                         interpret=jax.default_backend() == "cpu")  # a CPU smoke run interprets the kernels
    engine = Engine(cfg, random_params(cfg, seed=0), opts, model_name=name, warmup=False)
    runner = engine.runner
    lanes_list = [int(n) for n in args.lanes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    steps, kernels = {}, {}
    engine_kernels = runner.kernels  # the loop below swaps runner.kernels: each variant starts from the engine's
    for v in variants:  # each variant traces and compiles its own decode programs, untimed
        steps[v] = runner_module.jit_decode_step()
        kc, parts = engine_kernels, v.split("+")
        kernels[v] = dataclasses.replace(kc, fuse_gdn_decode=kc.fuse_gdn_decode and "gdn_unfused" not in parts,
                                         fuse_add_norm=kc.fuse_add_norm and "norm_unfused" not in parts,
                                         fuse_moe_route=kc.fuse_moe_route and "route_unfused" not in parts,
                                         fuse_attn_qkv=kc.fuse_attn_qkv and "attn_qkv_unfused" not in parts)
        runner._steps["decode"], runner.kernels = steps[v], kernels[v]
        with _patch(v):
            for lanes in lanes_list:
                jax.block_until_ready(runner.decode(*_decode_inputs(engine, lanes, 1024)))
    check = agreement(engine, variants, steps, kernels, max(lanes_list))
    for v, row in check.items():
        print(f"[{name}] {v} against {variants[0]}: {row['same_tokens']}/{row['lanes']} greedy tokens equal, "
              f"chosen log-probabilities within {row['max_logprob_diff']:.2e}, top-20 log-probabilities within "
              f"{row['max_top20_logprob_diff']:.2e}", flush=True)
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
    traced = [v for v in (args.trace_variants or variants[0]).split(",") if v]
    for v in traced:
        runner._steps["decode"], runner.kernels = steps[v], kernels[v]
        trace_dir = Path(args.trace_dir) / name / v
        decode_args = _decode_inputs(engine, 1, 1024)
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(args.trace_rounds):
                out = runner.decode(*decode_args)
            jax.block_until_ready(out)
        table = kernel_table(trace_dir, args.trace_rounds, args.top)
        result["kernels_1lane" if v == variants[0] else f"kernels_1lane_{v}"] = table
        for r in table:
            print(f"[{name}] {v} {r['us_per_round']:9.1f} us {r['launches_per_round']:6.1f}x  {r['kernel']}",
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
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="the engine's; it sets the page tables' width, so paged decode attention's splits")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-variants", default="", help="variants whose one-lane round is traced (default: the first)")
    ap.add_argument("--trace-rounds", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/ninfer_round_trace")
    ap.add_argument("--host-costs", action="store_true", help="also time a call's host side by what it is handed")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    unknown = {p for v in args.variants.split(",") for p in v.split("+")} - set(VARIANTS) - {""}
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
