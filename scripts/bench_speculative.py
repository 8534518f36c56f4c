"""What a speculative verify round costs against a plain decode round, at the real shapes (random bf16 weights).

On one idle engine per model (MTP on), at each lane count: the runner's plain decode round back to back (how
decoding runs with speculation off: each round dispatched before the previous one is read) and read back each round,
then a verify round of k + 1 rows per lane with its MTP work (the next drafts), read back each round (as prompt
lookup's rounds run) and chained (each continuing the previous round's frontier on the device, read after the next
is dispatched: as MTP's rounds run). The projected speedup at an accept length L (tokens a lane emits per verify
round) is L x plain / chained; the issue's published lengths are 1.9 at k = 1 and 3.2 at k = 3. The bytes floor is
the weight bytes a verify round must read over a plain round's: the target's over k + 1 rows per lane
(`wide_decode.round_weight_bytes`: a MoE's rows route to experts of their own, uniformly with random weights) and k
chained MTP drafts, each reading the MTP layer and the shared lm_head (`wide_decode.verify_bytes_floor`). Where both
rounds run at their bytes roofline their cost ratio cannot go under it; a plain round off its roofline leaves room
under it. Compile time is reported apart from the rounds.

    python scripts/bench_speculative.py --models 27b,35b-a3b --out docs/benchmarks
    python scripts/bench_speculative.py --smoke          # the tiny shape on CPU, a temporary folder

With --checkpoint, a trained checkpoint's MTP drafting end to end instead: greedy decode tok/s with speculation
off and MTP at each k (its rounds chained, and read back each round), at 1 and 8 lanes, the mean accept length and
the speedup, over prompts cut from the last files of the Python standard library (the held-out tail of
`train_tiny_mtp.py`'s corpus):

    python scripts/bench_speculative.py --checkpoint DIR --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import MODELS, model_config, random_engine
from ninfer_jax.benchmarks.profiling import decode_inputs, distinct_tokens, time_rounds
from ninfer_jax.benchmarks.wide_decode import verify_bytes_floor

PUBLISHED_ACCEPT_LENGTH = {1: 1.9, 2: 2.6, 3: 3.2, 4: 3.6}  # peers' MTP on the large Qwen models (issue 30)


def verify_inputs(engine, lanes: int, k: int, position: int, ahead: int = 0):
    """`runner.verify` arguments: `lanes` lanes at `position`, each fed 1 + k tokens whose drafts the round keeps
    only if the model agrees (random weights rarely do; the kept count does not change the round's work but the
    commit's, whose cost every row's replay bounds); their pages map `ahead` positions more."""
    import numpy as np

    _, _, tables, slots, active, sampler = decode_inputs(engine, lanes, position + k + ahead)
    c = engine.runner.max_lanes
    rows = distinct_tokens((c, k + 1), engine.runner.cfg.vocab_size)
    counts = np.where(active, k + 1, 0).astype(np.int32)
    positions = np.where(active, position, 0).astype(np.int32)
    return rows, positions, counts, np.zeros(c, np.int32), tables, slots, sampler


def time_verify(engine, lanes: int, k: int, rounds: int, position: int) -> tuple[float, float]:
    """(seconds of the first call: compile and run; seconds per round after, each read back)."""
    import jax
    import numpy as np

    args = verify_inputs(engine, lanes, k, position)
    start = time.perf_counter()
    jax.block_until_ready(engine.runner.verify(*args))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(rounds):
        out = engine.runner.verify(*args)
        np.asarray(out[3])
    return first, (time.perf_counter() - start) / rounds


def time_chained(engine, lanes: int, k: int, rounds: int, position: int) -> float:
    """Seconds per verify round when each round continues the previous one's frontier on the device (MTP's chained
    rounds, `Scheduler._chainable`): dispatched before the previous is read, as the engine runs them."""
    import jax
    import numpy as np

    ahead = (rounds + 4) * (k + 1)
    tokens, positions, counts, stops, tables, slots, sampler = verify_inputs(engine, lanes, k, position, ahead)
    active = counts > 0
    fixed = dict(limits=np.where(active, position + k + ahead, 0), left=np.where(active, 1 << 30, 0))
    prev = engine.runner.verify(tokens, positions, counts, stops, tables, slots, sampler, **fixed)
    chained = dict(chained=active, frontier=None, **fixed)
    start = None
    for i in range(rounds + 1):  # the first compiles (a frontier of fewer than the engine's rows has its own shape)
        if i == 1:
            jax.block_until_ready(prev)
            start = time.perf_counter()
        chained["frontier"] = prev.frontier
        out = engine.runner.verify(tokens, positions, active.astype(np.int32), stops, tables, slots, sampler,
                                   **chained)
        np.asarray(prev.kept)
        prev = out
    np.asarray(prev.kept)
    return (time.perf_counter() - start) / rounds


def trace_verify(engine, name: str, k: int, args) -> list[dict]:
    """One lane's verify rounds of k + 1 rows under the jax profiler: its device kernels per round."""
    import jax

    from ninfer_jax.benchmarks.profiling import kernel_table

    inputs = verify_inputs(engine, 1, k, args.context)
    folder = Path(tempfile.mkdtemp(prefix=f"verify_trace_{name}_"))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(args.trace_rounds):
            out = engine.runner.verify(*inputs)
        jax.block_until_ready(out)
    rows = kernel_table(folder, args.trace_rounds, 25)
    for r in rows:
        print(f"[{name}] verify k={k}: {r['us_per_round']:9.1f} us {r['launches_per_round']:6.1f}x  {r['kernel']}",
              flush=True)
    return rows


def sweep_rows_kernel(name: str, lanes_list, ks, reps: int = 50) -> list[dict]:
    """`gdn_rows_layer` alone at the model's GDN shapes: the verify (read) and commit (write) forms of k + 1 rows
    per lane at each Dv block width and warp count, beside k + 1 one-row decode kernels (`gdn_decode_layer`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ninfer_jax.benchmarks.models import model_config
    from pallas_kernels.gdn_decode_layer import GdnDecodeLayerConfig, gdn_decode_layer, gdn_rows_layer

    cfg = model_config(name)
    hv, dk, dv, hk = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                      cfg.linear_num_key_heads)
    width = cfg.conv_dim + hv * dv + 2 * hv
    rng = np.random.default_rng(0)
    out = []

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))
        start = time.perf_counter()
        for _ in range(reps):
            r = fn(*a)
        jax.block_until_ready(r)
        return (time.perf_counter() - start) / reps * 1e6

    for lanes in lanes_list:
        slots = 2 * lanes
        hist = jnp.asarray(rng.standard_normal((slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)), jnp.bfloat16)
        conv_w = jnp.asarray(rng.standard_normal((cfg.linear_conv_kernel_dim, cfg.conv_dim)) * 0.3, jnp.bfloat16)
        a_log, dt_bias = jnp.zeros(hv, jnp.float32), jnp.zeros(hv, jnp.float32)
        norm_w, slot_ids = jnp.ones(dv, jnp.bfloat16), jnp.arange(lanes, dtype=jnp.int32)
        pool = jnp.zeros((slots, hv, dk, dv), jnp.float32)
        kw = dict(num_key_heads=hk, eps=cfg.rms_norm_eps, interpret=jax.default_backend() == "cpu")
        one = jnp.asarray(rng.standard_normal((lanes, width)), jnp.bfloat16)
        decode = jax.jit(lambda pr, p: gdn_decode_layer(pr, jnp.ones(lanes, bool), hist, conv_w, a_log, dt_bias,
                                                         norm_w, p, slot_ids, **kw)[:2], donate_argnums=1)
        pool_box = [pool]

        def run_decode():
            y, pool_box[0] = decode(one, pool_box[0])
            return y

        base_us = timed(run_decode)
        for k in ks:
            t = k + 1
            proj = jnp.asarray(rng.standard_normal((lanes, t, width)), jnp.bfloat16)
            rows = jnp.full(lanes, t, jnp.int32)
            for block_v in (16, 32, 64, 128):
                for warps in (4, 8):
                    config = GdnDecodeLayerConfig(num_warps=warps, block_v=block_v, min_programs=0)
                    verify = jax.jit(lambda pr, p, c=config: gdn_rows_layer(pr, rows, hist, conv_w, a_log, dt_bias,
                                                                            norm_w, p, slot_ids, write_state=False,
                                                                            config=c, **kw)[0])
                    commit = jax.jit(lambda pr, p, c=config: gdn_rows_layer(pr, rows, hist, conv_w, a_log, dt_bias,
                                                                            norm_w, p, slot_ids, write_state=True,
                                                                            config=c, **kw)[2], donate_argnums=1)
                    try:
                        verify_us = timed(verify, proj, pool_box[0])

                        def run_commit():
                            pool_box[0] = commit(proj, pool_box[0])
                            return pool_box[0]

                        commit_us = timed(run_commit)
                    except Exception as e:  # a config Triton cannot compile
                        print(f"[{name}] rows kernel {lanes} lanes T={t} block_v {block_v} warps {warps}: "
                              f"{type(e).__name__}", flush=True)
                        continue
                    entry = dict(lanes=lanes, rows=t, block_v=block_v, warps=warps, verify_us=verify_us,
                                 commit_us=commit_us, decode_rows_us=t * base_us)
                    out.append(entry)
                    print(f"[{name}] rows kernel {lanes} lanes T={t} block_v {block_v} warps {warps}: verify "
                          f"{verify_us:.1f} us, commit {commit_us:.1f} us; {t} decode kernels {t * base_us:.1f} us",
                          flush=True)
    return out


def bench_model(name: str, args) -> dict:
    lanes_list = [int(x) for x in args.lanes.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    engine, init_s = random_engine(name, max_concurrency=max(lanes_list), max_model_len=args.context + 1024,
                                   no_prefix_reuse=True, speculative="mtp", num_speculative_tokens=max(ks),
                                   kernels=args.kernels)
    rows, result, cfg = [], {"init_s": init_s, "rounds": []}, model_config(name)
    try:
        for lanes in lanes_list:
            time_rounds(engine, lanes, 2, True, args.context)  # compiles the plain round
            pipelined = time_rounds(engine, lanes, args.rounds, False, args.context)
            read_each = time_rounds(engine, lanes, args.rounds, True, args.context)
            for k in ks:
                compile_s, verify = time_verify(engine, lanes, k, args.rounds, args.context)
                chained = time_chained(engine, lanes, k, args.rounds, args.context)
                length = PUBLISHED_ACCEPT_LENGTH[k]
                floor = verify_bytes_floor(cfg, lanes, k)
                entry = {"lanes": lanes, "k": k, "plain_ms": pipelined * 1e3, "plain_read_each_ms": read_each * 1e3,
                         "verify_ms": verify * 1e3, "chained_ms": chained * 1e3, "cost": chained / pipelined,
                         "cost_read_each": verify / pipelined, "bytes_floor": floor, "accept_length": length,
                         "speedup": length * pipelined / chained, "first_call_s": compile_s}
                result["rounds"].append(entry)
                rows.append([name, lanes, k, report.fmt(entry["plain_ms"]), report.fmt(entry["plain_read_each_ms"]),
                             report.fmt(entry["verify_ms"]), report.fmt(entry["chained_ms"]),
                             f"{entry['cost']:.2f}x", f"{floor:.2f}x", length, f"{entry['speedup']:.2f}x",
                             report.fmt(compile_s)])
                print(f"[{name}] {lanes} lanes k={k}: plain {pipelined * 1e3:.2f} ms ({read_each * 1e3:.2f} read "
                      f"each), verify {verify * 1e3:.2f} ms read each, {chained * 1e3:.2f} ms chained = "
                      f"{entry['cost']:.2f}x; at accept length {length}: {entry['speedup']:.2f}x", flush=True)
        if args.sweep_rows_kernel:
            result["rows_kernel"] = sweep_rows_kernel(name, lanes_list, ks)
        if args.trace_rounds:
            result["verify_kernels_1lane"] = trace_verify(engine, name, ks[-1], args)
    finally:
        engine.stop()
    result["table"] = rows
    return result


def heldout_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens: the starts of the trained checkpoint's last corpus files."""
    from ninfer_jax.model.tiny import stdlib_sources

    prompts = []
    for path in reversed(stdlib_sources()):
        ids = tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= tokens:
            prompts.append(list(ids[:tokens]))
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"fewer than {count} standard library files of {tokens} tokens")


def bench_checkpoint(path: str, args) -> tuple[dict, list]:
    """Greedy decoding of a trained checkpoint with speculation off and MTP at each k, at each lane count: with the
    per-round choice (`adaptive_speculation="on"`) and with every round verifying, on chained rounds. Each lane count
    runs twice on one engine; the second run is timed (the choice has measured its width by then)."""
    from ninfer_jax import Engine, SamplingParams

    lanes_list, ks = [int(x) for x in args.lanes.split(",")], [int(x) for x in args.k.split(",")]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    result, rows, plain = {"runs": []}, [], {}
    for k, adaptive in [(0, "off")] + [(k, a) for k in ks for a in ("on", "off")]:
        spec = dict(speculative="mtp", num_speculative_tokens=k, adaptive_speculation=adaptive) if k else {}
        engine = Engine.from_pretrained(path, kernels=args.kernels, max_concurrency=max(lanes_list),
                                        no_prefix_reuse=True, background_compile="off", **spec)
        try:
            prompts = heldout_prompts(engine.tokenizer, max(lanes_list), 256)
            engine.generate_many(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # first-use work
            for lanes in lanes_list:
                engine.generate_many(prompts[:lanes], sampling)  # the choice measures this width
                before = engine.stats()["speculative"] or {}
                start = time.perf_counter()
                outs = engine.generate_many(prompts[:lanes], sampling)
                seconds = time.perf_counter() - start
                decode = max(o.metrics.latency_s - o.metrics.ttft_s for o in outs)
                rate = sum(len(o.token_ids) - 1 for o in outs) / decode
                after = engine.stats()["speculative"] or {}
                hist_before = before.get("accept_length_histogram", {})
                hist = {n: c - hist_before.get(n, 0) for n, c in after.get("accept_length_histogram", {}).items()}
                rounds = sum(hist.values())
                length = sum(n * c for n, c in hist.items()) / rounds if rounds else 1.0
                if not k:
                    plain[lanes] = (rate, [o.token_ids for o in outs])
                same = [o.token_ids for o in outs] == plain[lanes][1]
                choice = after.get("adaptive") or {}
                entry = {"k": k, "lanes": lanes, "adaptive": adaptive == "on" and bool(k), "decode_tok_s": rate,
                         "seconds": seconds, "verify_rounds": rounds, "accept_length": length,
                         "speedup": rate / plain[lanes][0], "tokens_equal_plain": same, "choice": choice}
                result["runs"].append(entry)
                label = "off" if not k else f"mtp k={k}, " + ("per-round choice" if adaptive == "on" else
                                                              "every round verifies")
                rows.append([label, lanes, f"{rate:.1f}", rounds, f"{length:.2f}", f"{entry['speedup']:.2f}x",
                             "yes" if same else "NO"])
                print(f"[checkpoint] {label} {lanes} lanes: {rate:.1f} tok/s, {rounds} verify rounds, accept length "
                      f"{length:.2f}, {entry['speedup']:.2f}x, tokens equal plain: {same}, choice {choice}", flush=True)
        finally:
            engine.stop()
    return result, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="27b,35b-a3b", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--lanes", default="1,8")
    p.add_argument("--k", default="1,3", help="draft tokens per lane and round")
    p.add_argument("--context", type=int, default=1024, help="tokens before the round")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--sweep-rows-kernel", action="store_true", help="time the GDN rows kernel's configs alone")
    p.add_argument("--trace-rounds", type=int, default=0, help="trace this many one-lane verify rounds (largest k)")
    p.add_argument("--kernels", default="pallas", choices=("pallas", "reference"))
    p.add_argument("--out", default=None, help="report folder (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the reference kernels (a CPU check)")
    p.add_argument("--checkpoint", default=None, help="a trained checkpoint: its MTP drafting end to end")
    p.add_argument("--tokens", type=int, default=128, help="--checkpoint: tokens each request generates")
    args = p.parse_args()
    if args.checkpoint:
        meta = report.run_meta()
        result, rows = bench_checkpoint(args.checkpoint, args)
        lines = report.header("Speculative decoding with a trained checkpoint's MTP layer", meta,
                              f"checkpoint {args.checkpoint}, greedy, {args.tokens} tokens a request, prompts of 256 "
                              f"tokens from the standard library's last files, kernels {args.kernels}")
        lines += report.table(["speculation", "lanes", "decode tok/s", "verify rounds", "mean accept length",
                               "speedup", "tokens equal off"], rows)
        page = report.write_report(args.out or tempfile.mkdtemp(prefix="bench_mtp_"), "speculative_trained",
                                   {**meta, **result}, lines)
        print(f"report: {page}", flush=True)
        return 0
    if args.smoke:
        args.models, args.context, args.rounds, args.kernels = "tiny-dense", 128, 2, "reference"
    out = args.out or tempfile.mkdtemp(prefix="bench_speculative_")
    meta = report.run_meta()
    data = {**meta, "models": {}}
    rows = []
    for name in args.models.split(","):
        data["models"][name] = bench_model(name, args)
        rows += data["models"][name]["table"]
    lines = report.header("Speculative decoding: a verify round against a plain round", meta,
                          f"context {args.context} tokens, {args.rounds} rounds each, random bf16 weights, "
                          f"kernels {args.kernels}")
    lines += report.table(["model", "lanes", "k", "plain ms (back to back)", "plain ms (read each)",
                           "verify ms (read each)", "verify ms (chained)", "chained / plain", "bytes floor",
                           "accept length",
                           "projected speedup", "verify first call s"], rows)
    lines += ["", "Targets (issue 30): verify / plain <= 1.1 at k = 1 and <= 1.3 at k = 3 (a MoE's: at most its bytes "
              "floor); projected speedup >= 1.73 (k = 1: 1.9 / 1.1; the issue's 1.8 is past the bytes floor's 1.78) "
              "and >= 2.3 (k = 3) for the 27B at 1 lane; at 8 lanes no slower than plain.", ""]
    page = report.write_report(out, "speculative", data, lines)
    print(f"report: {page}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
