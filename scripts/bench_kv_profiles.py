"""KV storage profiles (spec §3.1) at a real model shape with random weights, every profile in one process.

Per profile, beside the bf16 KV pools on the same weights:
  * accuracy: a 2048-token prompt prefilled through the paged pools in one pass, every position's logits
    against the bf16 pools' (RMS and largest error, greedy-token agreement);
  * capacity: the tokens the Device pool holds at kv_capacity "auto" and an 8 GiB Host tier holds;
  * decode: the runner's round back to back at 1 and 8 lanes, every lane at a --context position (default
    65536), as tokens/s (the pages hold whatever the pool holds: the kernels read every byte regardless);
  * Host restore: a --restore-tokens prefix demoted to the Host and resumed (`benchmarks.restore.measure`):
    bytes restored per second against the pinned device_put ceiling.
Compile seconds are reported apart from every timing. Writes kv_profiles.{json,md} (or --report-name).

    python scripts/bench_kv_profiles.py --model 27b --out docs/benchmarks
    python scripts/bench_kv_profiles.py --smoke          # the tiny checkpoint on CPU, a temporary folder
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report, restore

PROFILES = ("bfloat16", "int8", "fp8", "k8v4", "nvfp4")
HOST_GIB = 8
PROMPT = 2048


def accuracy(params, cfg, kc, profiles, act_dtype) -> dict:
    """profile -> logit RMS / max error and greedy agreement over PROMPT positions against the bf16 pools."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ninfer_jax.model import init_device_state, logits, prefill

    @functools.partial(jax.jit, static_argnames=("profile",))
    def run(params, tokens, profile):  # params as an argument: closed over, jit would embed them as constants
        pages = jnp.arange(PROMPT // 64, dtype=jnp.int32)
        state = init_device_state(cfg, PROMPT // 64, 1, act_dtype, act_dtype, profile)
        no_taps = jnp.full((1,), -1, jnp.int32)
        hidden, _ = prefill(params, cfg, kc, tokens, jnp.int32(PROMPT), jnp.int32(0), pages, jnp.int32(0), state,
                            no_taps, no_taps)
        return logits(params, hidden)

    @jax.jit
    def compare(ref, got):
        err = got - ref
        top2 = jax.lax.top_k(ref, 2)[0]
        return {"rms": jnp.sqrt(jnp.mean(err * err)), "max": jnp.max(jnp.abs(err)),
                "ref_rms": jnp.sqrt(jnp.mean(ref * ref)),
                "agree": jnp.mean(jnp.argmax(got, -1) == jnp.argmax(ref, -1)),
                "margin_p50": jnp.median(top2[:, 0] - top2[:, 1])}

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, PROMPT), jnp.int32)
    start = time.perf_counter()
    ref = jax.block_until_ready(run(params, tokens, "bfloat16"))
    out = {"bfloat16": {"compile_and_run_s": time.perf_counter() - start}}
    for profile in profiles:
        if profile == "bfloat16":
            continue
        start = time.perf_counter()
        got = jax.block_until_ready(run(params, tokens, profile))
        row = {k: float(v) for k, v in compare(ref, got).items()}
        out[profile] = {**row, "compile_and_run_s": time.perf_counter() - start}
        del got
        print(f"[accuracy {profile}] logits vs bf16 KV over {PROMPT} positions: RMS {row['rms']:.4f} (logits' RMS "
              f"{row['ref_rms']:.3f}), max {row['max']:.3f}, greedy agreement {row['agree']:.2%} (bf16 top-2 margin "
              f"p50 {row['margin_p50']:.3f})", flush=True)
    del ref
    return out


def profile_engine(params, cfg, profile: str, args, save) -> dict:
    """Capacity, decode rounds and a Host restore on one engine of `profile`; `save(row)` after each part, so a
    run cut short keeps what it measured."""
    from ninfer_jax import Engine
    from ninfer_jax.benchmarks.profiling import time_rounds
    from ninfer_jax.model.state import PAGE
    from ninfer_jax.runtime.options import EngineOptions

    opts = EngineOptions(dtype=args.dtype, kernels=args.kernels, interpret=args.interpret, kv_dtype=profile,
                         max_concurrency=args.lanes, max_model_len=args.max_model_len, prefill_chunk=args.chunk,
                         kv_capacity=args.kv_capacity, host_cache_mib=args.host_mib)
    start = time.perf_counter()
    engine = Engine(cfg, params, opts, model_name=args.model, warmup=False)
    row = {"profile": profile, "engine_s": time.perf_counter() - start, "kv": engine.stats()["kv"]}
    try:
        cache = engine.stats()["prefix_cache"]
        slabs = cache["host_cache_bytes"] // cache["host_slab_bytes"]
        row.update(host_cache_bytes=cache["host_cache_bytes"], host_slab_bytes=cache["host_slab_bytes"],
                   host_tokens=slabs * PAGE)
        print(f"[{profile}] {row['kv']['bytes_per_token']} B/token; Device pool {row['kv']['capacity_tokens']} tokens; "
              f"Host tier {cache['host_cache_bytes'] / 2**30:.1f} GiB = {slabs} slabs of {cache['host_slab_bytes']} B "
              f"= {row['host_tokens']} tokens", flush=True)
        for lanes in (1, args.lanes):
            start = time.perf_counter()
            time_rounds(engine, lanes, 1, sync=False, position=args.context)  # compiles this round size
            compile_s = time.perf_counter() - start
            s = min(time_rounds(engine, lanes, args.rounds, sync=False, position=args.context) for _ in range(3))
            row[f"decode_{lanes}lane"] = {"ms_per_round": s * 1e3, "tok_s": lanes / s, "compile_s": compile_s}
            print(f"[{profile}] decode {lanes} lanes at {args.context}: {s * 1e3:.2f} ms/round = {lanes / s:.1f} "
                  f"tok/s (compile {compile_s:.1f} s)", flush=True)
            save(row)
        if args.restore_tokens:
            measured = restore.measure(engine, args.restore_tokens, args.restore_reps, profile)
            row["restore"] = {k: measured[k] for k in ("restored_bytes", "restore_s", "restore_gbs", "ceiling_gbs",
                                                       "restore_vs_ceiling", "resume_ttft_s", "recompute_s")}
    finally:
        engine.stop()
        del engine
        gc.collect()
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="27b")
    p.add_argument("--profiles", default=",".join(PROFILES), help="KV profiles, each beside bfloat16")
    p.add_argument("--kernels", help="pallas (default) or reference (the default with --smoke)")
    p.add_argument("--context", type=int, help="decode position of every lane (default 65536; 1024 with --smoke)")
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10, help="decode rounds per timing (best of 3)")
    p.add_argument("--restore-tokens", type=int, help="the Host restore's prefix (default 16384; 0: none)")
    p.add_argument("--restore-reps", type=int, default=2)
    p.add_argument("--deadline", type=float, default=0, help="seconds for the run: a profile starts only with "
                   "--profile-s of them left (0: none)")
    p.add_argument("--profile-s", type=float, default=90)
    p.add_argument("--accuracy-from", metavar="JSON", help="take the accuracy rows of an earlier run's report")
    p.add_argument("--smoke", action="store_true", help="the built-in tiny checkpoint on CPU")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    p.add_argument("--report-name", default="kv_profiles")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    smoke = args.smoke
    args.context = args.context or (1024 if smoke else 65536)
    args.restore_tokens = (1024 if smoke else 16384) if args.restore_tokens is None else args.restore_tokens
    args.chunk = 256 if smoke else 2048
    args.kernels = args.kernels or ("reference" if smoke else "pallas")
    args.dtype = "float32" if smoke else "bfloat16"
    # the decode position, and the restore's warm-up and prefix with two chunks to spare (restore.probe_options)
    longest = max(args.restore_tokens, restore.WARM_BLOCKS * restore.BLOCK) + 2 * args.chunk
    args.max_model_len = -(-max(args.context + 1024, longest) // 1024) * 1024
    args.kv_capacity = 2 * args.lanes * args.max_model_len if smoke else "auto"
    args.host_mib = 256 if smoke else HOST_GIB * 1024
    return args


def main(argv=None) -> int:
    import jax

    from ninfer_jax.benchmarks import models
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime.options import EngineOptions
    from ninfer_jax.runtime.startup import kernel_config, resolve_options

    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="kv_profiles-")) if args.smoke
                                          else report.DOCS)
    cfg = models.tiny_checkpoint_config() if args.smoke else models.model_config(args.model)
    params = random_params(cfg, seed=0, dtype=jax.numpy.dtype(args.dtype))
    jax.block_until_ready(params)
    print(f"[{args.model}] random weights in {time.perf_counter() - t0:.1f} s", flush=True)
    profiles = [p for p in args.profiles.split(",") if p]
    args.interpret = args.kernels == "pallas" and jax.default_backend() == "cpu"  # as models.random_engine
    kc = kernel_config(resolve_options(EngineOptions(dtype=args.dtype, kernels=args.kernels, interpret=args.interpret,
                                                     max_concurrency=1, max_model_len=4096), cfg))
    meta = report.run_meta(report.command_line(["scripts/bench_kv_profiles.py", *args.argv]),
                           device=str(jax.devices()[0].device_kind), model=args.model, context=args.context,
                           lanes=args.lanes, restore_tokens=args.restore_tokens, host_gib=args.host_mib / 1024)
    if args.accuracy_from:  # the decode kernels changed, not the prefill that accuracy runs
        acc = json.loads(Path(args.accuracy_from).read_text())["accuracy"]
    else:
        acc = accuracy(params, cfg, kc, profiles, params.embed.dtype)
    data = {**meta, "accuracy": acc, "rows": []}
    for profile in profiles:
        left = args.deadline - (time.perf_counter() - t0)
        if args.deadline and left < args.profile_s:
            data["rows"].append({"profile": profile, "error": f"not run: {left:.0f} s left before --deadline"})
            continue
        def save(row):  # what ran survives a later part's or profile's failure
            report.write_json(out, args.report_name, {**data, "rows": [*data["rows"], row]})

        data["rows"].append(profile_engine(params, cfg, profile, args, save))
        report.write_json(out, args.report_name, data)
    report.write_report(out, args.report_name, data, markdown(data))
    print(f"report: {out / (args.report_name + '.md')} ({time.perf_counter() - t0:.0f} s)")
    return 0


def markdown(data: dict) -> list[str]:
    """The page: one row per profile ("-" where a part did not run; the reason in the last column)."""
    acc, rows, lanes = data["accuracy"], data["rows"], data["lanes"]
    base = next((r for r in rows if r.get("profile") == "bfloat16" and "decode_1lane" in r), None)
    lines = report.header(f"KV storage profiles, {data['model']} (random weights)", data,
                          f"decode: the runner's round back to back, every lane at position {data['context']}; "
                          f"accuracy: {PROMPT}-token prompt, every position's logits against the bf16 KV pools; "
                          f"Host restore: a {data['restore_tokens']}-token prefix demoted and resumed; "
                          f"Host tier {data['host_gib']:.0f} GiB")

    def decode(r, key):
        if key not in r:
            return "-"
        ratio = f" ({r[key]['tok_s'] / base[key]['tok_s']:.2f}x)" if base else ""
        return f"{r[key]['tok_s']:.1f}{ratio}"

    def compile_s(r):  # the decode rounds' first calls, apart from their timings
        return " + ".join(f"{r[k]['compile_s']:.0f}" for k in ("decode_1lane", f"decode_{lanes}lane") if k in r) or "-"

    table = []
    for r in rows:
        a, kv, rs = acc.get(r["profile"], {}), r.get("kv", {}), r.get("restore")
        table.append([r["profile"], kv.get("bytes_per_token", "-"), kv.get("capacity_tokens", "-"),
                      r.get("host_tokens", "-"), decode(r, "decode_1lane"), decode(r, f"decode_{lanes}lane"),
                      f"{rs['restore_gbs']:.1f} / {rs['ceiling_gbs']:.1f}" if rs else "-",
                      report.fmt(a["rms"]) if "rms" in a else "-", report.fmt(a["max"]) if "max" in a else "-",
                      f"{a['agree']:.2%}" if "agree" in a else "-", compile_s(r), r.get("error", "")])
    return lines + report.table(
        ["profile", "B/token", "Device tokens", f"Host {data['host_gib']:.0f} GiB tokens", "decode 1 lane tok/s",
         f"decode {lanes} lanes tok/s", "restore GB/s (ceiling)", "logit RMS err", "logit max err", "greedy agree",
         "decode compile s", "note"], table) + [""]


if __name__ == "__main__":
    sys.exit(main())
