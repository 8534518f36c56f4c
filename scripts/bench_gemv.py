"""Time the split-K matrix-vector kernel (`pallas_kernels/gemv.py`) against XLA on the one-lane decode projections.

On the H200 (one call of the device tool, about 3 minutes for the 35B-A3B shapes):
    PYTHONUNBUFFERED=1 python3 scripts/bench_gemv.py --out $OUT            # --shapes all adds the 27B's
On a CPU, `--smoke` runs it at tiny shapes in interpret mode to test this script.

Shapes come from the model configs (configs/qwen3.5-*.json): per model the GDN in-projection, the out-projections
(GDN out_proj and attention o_proj share [value_dim, H] at both models), the attention qkv projection, the dense
MLP's (27B) and the LM head, each with its number of layers. One row x [1, K] bf16 against `layers` distinct
random bf16 weights [K, N] (together far larger than the 50 MB L2, so every call reads HBM), inside one jitted
function. Each layer gets its own x array and every output is returned: nothing is dead code, nothing is shared
between the projections (XLA's dot merger would fuse dots sharing an operand), and no glue kernel sits between
them (chaining x through a slice of each output would add a kernel per layer and let XLA shrink the sum over the
partials to that slice).

Variants, side by side in one process:
  xla_one_row    jnp.dot(x, w, preferred_element_type=bf16): cuBLAS, or XLA's multiply + reduce rewrite below
                 ~10M weight elements
  xla_two_rows   the engine's workaround below that size (`qwen3_5._dot`): the row duplicated behind an
                 optimization barrier, a two-row matmul, row 0 kept
  ours_parts     the kernel alone with partial=True (float32 partial sums [S, 1, N] returned as they are): what a
                 consumer kernel that sums the partials would pay
  ours           partial=False: the kernel and XLA's sum over the splits in float32, rounded to bf16 (one split:
                 the kernel writes bf16 itself)
The sweep times ours_parts over a grid of configs (deduplicated by the blocks they actually run: the column
block halves until it divides N, splits clamp to K // block_k), then ours for the fastest few and the best
one-split config. Before timing, every variant's outputs must match xla_one_row's within 2e-2 of their largest
magnitude, all layers; a mismatch is an error row and is not timed.

Timing: median of 5 repeats, each >= 50 ms of back-to-back calls, then block_until_ready; us per projection =
call time / layers; GB/s = K*N*2 weight bytes / that; % of the device copy rate measured here (a 2 GiB f32
copy, read + write, best of 3); speedups = xla_two_rows's time / this time (> 1: faster than the workaround) and
the same against the variant the engine runs at that shape today (two rows below ~10M weight elements, else one).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_jax.config import ModelConfig  # noqa: E402
from pallas_kernels import gemv  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = {"35b": "qwen3.5-35b-a3b", "27b": "qwen3.5-27b"}
XLA_GEMV_REWRITE_ELEMENTS = 10_000_000  # qwen3_5._XLA_GEMV_REWRITE_ELEMENTS: below it the engine takes two rows
MISMATCH_TOL = 2e-2  # of the largest output magnitude: a few bf16 ulps

RESULTS: dict = {"rows": [], "errors": [], "shapes": [], "ceilings": {}}
ARGS = None
T_START = time.time()


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s] " + " ".join(str(x) for x in a), flush=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int
    layers: int
    sweep: str  # "full" or "short" (fewer configs)

    @property
    def weight_bytes(self) -> int:
        return self.k * self.n * 2

    @property
    def engine_path(self) -> str:
        """What `qwen3_5._dot` runs for one row today."""
        return "xla_two_rows" if (self.n + 1) * self.k < XLA_GEMV_REWRITE_ELEMENTS else "xla_one_row"


def model_shapes(tag: str, sweep: str) -> list[Shape]:
    """The one-row projections of a model, from its config (the layouts in ninfer_jax/model/params.py)."""
    cfg = ModelConfig.from_file(os.path.join(ROOT, "configs", f"{MODELS[tag]}.json"))
    h, gdn, attn = cfg.hidden_size, len(cfg.gdn_layers), len(cfg.attn_layers)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = [Shape(f"in_proj_{tag}", h, cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads, gdn, sweep)]
    if cfg.value_dim == hq * d:  # GDN out_proj and attention o_proj: one shape, every layer
        shapes.append(Shape(f"out_proj_{tag}", cfg.value_dim, h, gdn + attn, sweep))
    else:
        shapes += [Shape(f"out_proj_{tag}", cfg.value_dim, h, gdn, sweep),
                   Shape(f"o_proj_{tag}", hq * d, h, attn, sweep)]
    shapes.append(Shape(f"qkv_{tag}", h, hq * 2 * d + 2 * hkv * d, attn, sweep))
    if not cfg.is_moe:  # the routed and shared experts have their own kernels (moe.py)
        inter = cfg.intermediate_size
        shapes += [Shape(f"gate_up_{tag}", h, 2 * inter, cfg.num_layers, sweep),
                   Shape(f"down_{tag}", inter, h, cfg.num_layers, sweep)]
    shapes.append(Shape(f"lm_head_{tag}", h, cfg.vocab_size, 1, sweep))
    return shapes


def all_shapes() -> list[Shape]:
    if ARGS.smoke:
        return [Shape("tiny_out", 256, 64, 3, "full"), Shape("tiny_odd_n", 128, 192, 2, "short")]
    # The 35B-A3B's out_proj first: the motivating case (cuBLAS at 59% of the copy rate)
    shapes = sorted(model_shapes("35b", "full"), key=lambda s: s.name != "out_proj_35b")
    shapes += model_shapes("27b", "short")
    picked = []
    for want in ARGS.shapes.split(","):
        picked += [s for s in shapes if want in ("all", s.name) or s.name.endswith("_" + want)]
    return list(dict.fromkeys(picked))


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------


def _cfg(block_n=128, block_k=64, splits=8, num_warps=None, num_stages=4):
    # Unless a warp count is the knob under test, keep ~128 f32 tile elements per thread (a [64, 128] tile on 2
    # warps, as the MoE matrix-vector kernels run).
    warps = num_warps or max(2, block_n * block_k // (128 * 32))
    return gemv.GemvConfig(block_n=block_n, block_k=block_k, splits=splits, num_warps=warps, num_stages=num_stages)


def sweep_configs(kind: str) -> list[gemv.GemvConfig]:
    if ARGS.smoke:
        return [_cfg(block_n=32, block_k=32, splits=4), _cfg(block_n=64, block_k=32, splits=1),
                _cfg(block_n=128, block_k=16, splits=8, num_warps=1)]
    if kind == "short":
        return [_cfg(), _cfg(splits=4), _cfg(splits=16), _cfg(block_n=64, splits=16), _cfg(block_n=256),
                _cfg(block_k=128), _cfg(block_n=64, block_k=128), _cfg(num_warps=4)]
    configs = [_cfg(block_n=bn, splits=s) for bn in (64, 128, 256) for s in (1, 2, 4, 8, 16)]  # 15
    configs += [_cfg(block_k=32), _cfg(block_k=32, splits=16), _cfg(block_k=128), _cfg(block_k=128, splits=4),
                _cfg(block_n=64, block_k=128), _cfg(block_n=256, block_k=32)]
    configs += [_cfg(num_warps=1), _cfg(num_warps=4), _cfg(block_n=64, splits=16, num_warps=1),
                _cfg(block_n=64, splits=16, num_warps=4)]
    configs += [_cfg(num_stages=2), _cfg(num_stages=3)]
    return configs  # 27


def effective(shape: Shape, cfg: gemv.GemvConfig):
    """The config as it runs at this shape (blocks and splits clamped), or None when it cannot run."""
    try:
        plan = gemv._plan(shape.k, shape.n, cfg)
    except ValueError:
        return None
    return dataclasses.replace(cfg, block_n=plan.block_n, block_k=plan.block_k, splits=plan.splits)


def label(cfg: gemv.GemvConfig) -> str:
    return f"n{cfg.block_n}k{cfg.block_k}s{cfg.splits}w{cfg.num_warps}st{cfg.num_stages}"


# ------------------------------------------------------------------------------------------------
# Variants, checks and timing
# ------------------------------------------------------------------------------------------------


def xla_one_row(x, w):
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def xla_two_rows(x, w):
    two = jax.lax.optimization_barrier(jnp.concatenate([x, x]))
    return jnp.dot(two, w, preferred_element_type=x.dtype)[:1]


def ours(cfg, partial):
    return functools.partial(gemv.gemv, config=cfg, partial=partial, interpret=ARGS.smoke)


def over_layers(proj):
    """One jitted call applying proj to each layer's (x, w): every output returned, so none is dead code."""
    return jax.jit(lambda xs, ws: tuple(proj(x, w) for x, w in zip(xs, ws)))


def seconds_per_call(fn, args, reps, min_time):
    """Times of `reps` repeats (seconds per call), each >= min_time of back-to-back calls. fn is warm."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    n = max(1, min(10_000, math.ceil(min_time / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return times


def as_rows(outs) -> np.ndarray:
    """[layers, N] float32 of a variant's outputs (partial sums summed on the host)."""
    rows = [np.asarray(o.astype(jnp.float32)) for o in outs]
    return np.stack([r.sum(axis=0)[0] if r.ndim == 3 else r[0] for r in rows])


def measure(shape: Shape, variant: str, cfg, fn, args, want, timings):
    """Compile and run fn once, check it against `want` (xla_one_row's outputs, None: this is it), time it, and
    record a row. Returns (seconds per projection, outputs [layers, N] float32), or None after an error."""
    info = dict(shape=shape.name, K=shape.k, N=shape.n, layers=shape.layers, variant=variant,
                config=label(cfg) if cfg else None)
    if ARGS.deadline and time.time() - T_START > ARGS.deadline:
        log(f"  skip {variant} {info['config'] or ''}: past the deadline")
        RESULTS["errors"].append({**info, "error": "skipped: past --deadline"})
        return None
    try:
        t0 = time.perf_counter()
        got = as_rows(fn(*args))
        first_s = time.perf_counter() - t0
        if want is not None:
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            if not err <= MISMATCH_TOL:  # NaN fails too
                raise AssertionError(f"mismatch vs xla_one_row: max abs diff {err:.3g} of max |y| > {MISMATCH_TOL}")
        t = statistics.median(seconds_per_call(fn, args, ARGS.reps, ARGS.min_time)) / shape.layers
    except Exception as e:  # one broken variant must not cost the others their numbers
        log(f"  !! {variant} {info['config'] or ''}: {type(e).__name__}: {str(e)[:800]}")
        if not isinstance(e, AssertionError):
            log(traceback.format_exc(limit=3))
        RESULTS["errors"].append({**info, "error": f"{type(e).__name__}: {e}"[:2000]})
        return None
    copy = RESULTS["ceilings"].get("copy_gbps")
    gbps = shape.weight_bytes / t / 1e9
    two_rows, engine = timings.get("xla_two_rows"), timings.get(shape.engine_path)
    row = dict(info, us=t * 1e6, gbps=gbps, pct_copy=100 * gbps / copy if copy else None,
               speedup_vs_two_rows=two_rows / t if two_rows else None,
               speedup_vs_engine=engine / t if engine else None, compile_and_first_s=first_s)
    RESULTS["rows"].append(row)
    timings[variant if cfg is None else (variant, cfg)] = t
    log(f"  {variant:12s} {info['config'] or '':22s} {t * 1e6:9.2f} us  {gbps:7.0f} GB/s"
        + (f"  {row['pct_copy']:5.1f}% copy" if copy else "")
        + (f"  x{row['speedup_vs_two_rows']:.2f} vs two rows" if two_rows else "")
        + f"  (compile+first {first_s:.1f}s)")
    return t, got


def run_shape(shape: Shape):
    log(f"\n=== {shape.name}: x [1, {shape.k}] @ w [{shape.k}, {shape.n}] bf16 x {shape.layers} layers "
        f"({shape.weight_bytes / 2**20:.1f} MiB each; the engine runs {shape.engine_path}) ===")
    RESULTS["shapes"].append({**dataclasses.asdict(shape), "engine_path": shape.engine_path,
                              "weight_mib": shape.weight_bytes / 2**20})
    keys = jax.random.split(jax.random.key(shape.k * 7 + shape.n), 2 * shape.layers)
    scale = shape.k**-0.5  # outputs of order one
    xs = tuple(jax.random.normal(keys[i], (1, shape.k), jnp.bfloat16) for i in range(shape.layers))
    ws = tuple((jax.random.normal(keys[shape.layers + i], (shape.k, shape.n), jnp.float32) * scale)
               .astype(jnp.bfloat16) for i in range(shape.layers))
    jax.block_until_ready(ws)
    args = (xs, ws)
    timings: dict = {}

    # Order matters: xla_one_row's outputs are the reference, xla_two_rows's time is the ratios' base.
    reference = measure(shape, "xla_one_row", None, over_layers(xla_one_row), args, None, timings)
    if reference is None:
        return
    want = reference[1]
    measure(shape, "xla_two_rows", None, over_layers(xla_two_rows), args, want, timings)

    configs = {}
    for cfg in sweep_configs(shape.sweep):
        eff = effective(shape, cfg)
        if eff is not None:
            configs.setdefault(eff, cfg)  # dedup: configs that run the same blocks
    log(f"  {len(configs)} distinct configs")
    kernel_only = {}
    for eff in configs:
        result = measure(shape, "ours_parts", eff, over_layers(ours(eff, True)), args, want, timings)
        if result is not None:
            kernel_only[eff] = result[0]
    ranked = sorted(kernel_only, key=kernel_only.get)
    finals = ranked[: ARGS.top]
    one_split = [c for c in ranked if c.splits == 1][:1]
    for eff in finals + [c for c in one_split if c not in finals]:
        measure(shape, "ours", eff, over_layers(ours(eff, False)), args, want, timings)
    del xs, ws, args


def measure_copy_ceiling():
    elems = (1 << 20) if ARGS.smoke else (1 << 29)  # 2 GiB of f32
    x = jax.random.normal(jax.random.key(3), (elems,), jnp.float32)
    fn = jax.jit(lambda y: y * 1.0001)
    jax.block_until_ready(fn(x))
    best = min(seconds_per_call(fn, (x,), 3, ARGS.min_time))  # a ceiling is the best the device does
    gbps = 2 * x.nbytes / best / 1e9
    RESULTS["ceilings"]["copy_gbps"] = gbps
    log(f"device copy {x.nbytes / 2**30:.2f} GiB (read + write): {best * 1e3:.3f} ms, {gbps:.0f} GB/s")


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def _fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def write_report(command: str, quiet=True):
    os.makedirs(ARGS.out, exist_ok=True)
    RESULTS["meta"] = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "interpret": ARGS.smoke,
        "reps": ARGS.reps,
        "min_time_s": ARGS.min_time,
    }
    with open(os.path.join(ARGS.out, "gemv.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    m, copy = RESULTS["meta"], RESULTS["ceilings"].get("copy_gbps")
    lines = ["# Split-K matrix-vector kernel vs XLA, one decode row (bf16)", "",
             f"- command: `{m['command']}`",
             f"- date: {m['date']}; device: {m['device']}; jax {m['jax']}"
             + (" (interpret mode)" if ARGS.smoke else ""),
             f"- device copy (2 GiB f32, read + write, best of 3): {_fmt(copy)} GB/s",
             "- us: per projection (one call over all layers / layers), median of "
             f"{m['reps']} repeats; speedup: xla_two_rows's (or the engine's path's) time / this time",
             "- ours_parts: the kernel alone (float32 partials out); ours: plus XLA's sum over the splits to bf16",
             ""]
    cols = ["variant", "config", "us", "gbps", "pct_copy", "speedup_vs_two_rows", "speedup_vs_engine"]
    for s in RESULTS["shapes"]:
        rows = [r for r in RESULTS["rows"] if r["shape"] == s["name"]]
        if not rows:
            continue
        pick = [r for r in rows if r["variant"].startswith("xla")]
        for variant in ("ours", "ours_parts"):
            pick += sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["us"])[:5]
        lines += [f"## {s['name']}: [1, {s['k']}] @ [{s['k']}, {s['n']}] x {s['layers']} layers "
                  f"({s['weight_mib']:.1f} MiB each; engine today: {s['engine_path']})", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in pick]
        lines.append("")
    if RESULTS["errors"]:
        lines += ["## Errors", ""] + [f"- {e.get('shape')} {e.get('variant')} {e.get('config') or ''}: "
                                      f"{e['error'][:300]}" for e in RESULTS["errors"]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(ARGS.out, "gemv.md"), "w") as f:
        f.write(text)
    if not quiet:
        log("\n" + text)


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, one repeat (CPU)")
    p.add_argument("--shapes", default="35b",
                   help="comma-separated shape names, or a model tag (35b, 27b), or all (default: 35b)")
    p.add_argument("--top", type=int, default=4, help="configs (fastest kernel-only) timed as ours too")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds of calls per repeat")
    p.add_argument("--deadline", type=float, default=0, help="skip measurements after this many seconds (0: none)")
    ARGS = p.parse_args()
    if ARGS.smoke:
        ARGS.reps, ARGS.min_time = 1, 0.0
    command = "python3 scripts/bench_gemv.py " + " ".join(sys.argv[1:])
    log(f"devices: {jax.devices()}; jax {jax.__version__}")
    if not ARGS.smoke:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw",
                              "--format=csv"], capture_output=True, text=True)
        log(smi.stdout.strip())
    shapes = all_shapes()
    log("shapes: " + ", ".join(f"{s.name} ({s.k}x{s.n}, {s.layers} layers)" for s in shapes))
    measure_copy_ceiling()
    for shape in shapes:
        run_shape(shape)
        write_report(command)  # keep what we have if the run is cut short
    log(f"total {time.time() - T_START:.0f}s")
    write_report(command, quiet=False)


if __name__ == "__main__":
    main()
