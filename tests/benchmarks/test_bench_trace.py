"""The prefix-cache benchmarks (ninfer_jax.benchmarks): the trace is seeded and shaped as it promises; the
options, targets and reports say what they should (synthetic results); the restore benchmark runs on the tiny
model."""

import json
import os
import types

import jax.numpy as jnp
import pytest

from ninfer_jax import Engine
from ninfer_jax.config import ModelConfig
from ninfer_jax.frontend import ChatTemplate, load_tokenizer, write_qwen35_tokenizer_files

from ninfer_jax.benchmarks import prefix_cache, restore
from ninfer_jax.benchmarks.models import model_config
from ninfer_jax.benchmarks.prefix_cache import cache_delta, host_share, parse_args, reused_arms, targets, write_report
from ninfer_jax.benchmarks.profiling import summarize_device_trace
from ninfer_jax.benchmarks.restore import measure, probe_options, restore_markdown, restore_targets
from ninfer_jax.benchmarks.trace import DEFAULT_SHAPE, EDITED, generate_trace, turn_messages

OPENER = "<|im_start|>assistant\n<think>\n"


def reply(conv: int, turn: int) -> str:
    return f"thought-{conv}-{turn} " * 10


@pytest.fixture(scope="module")
def trace():
    return generate_trace(DEFAULT_SHAPE, seed=0)


@pytest.fixture(scope="module")
def prompts(trace):
    """prompts[c][t]: the rendered text of turn t, the replies before it being placeholders."""
    template = ChatTemplate.qwen35()
    return [[template.render(turn_messages(trace, c, [reply(c, k) for k in range(t)]), list(trace.tools)).text
             for t in range(len(turns))] for c, turns in enumerate(trace.conversations)]


def test_the_trace_is_a_function_of_its_seed(trace):
    assert generate_trace(DEFAULT_SHAPE, seed=0) == trace
    assert generate_trace(DEFAULT_SHAPE, seed=1) != trace
    assert len(trace.conversations) >= 20 and all(len(turns) >= 10 for turns in trace.conversations)


def test_reply_lengths_vary_per_turn_without_changing_the_prompts(trace):
    import dataclasses

    lengths = [turn.reply_tokens for turns in trace.conversations for turn in turns]
    low, high = DEFAULT_SHAPE.reply_tokens
    assert all(low <= n <= high for n in lengths)
    assert len(set(lengths)) > 20 and abs(sum(lengths) / len(lengths) - (low + high) / 2) < 5  # spread, mean ~64
    fixed = generate_trace(dataclasses.replace(DEFAULT_SHAPE, reply_tokens=(64, 64)), seed=0)
    assert [[t.message for t in c] for c in fixed.conversations] == [[t.message for t in c]
                                                                      for c in trace.conversations]


def test_every_conversation_starts_behind_the_same_preamble(trace, prompts):
    shared = os.path.commonprefix([p[0] for p in prompts])
    system_end = shared.find("<|im_end|>")
    assert system_end > 0 and "</tools>" in shared[:system_end] and trace.system in shared[:system_end]
    assert "<|im_start|>user\n" in shared[system_end:]  # the whole system + tools block is shared
    assert len({p[0] for p in prompts}) == len(prompts)  # and the first queries differ


def test_turn_kinds_extend_re_render_or_edit_the_history(trace, prompts):
    kinds = {turn.kind for turns in trace.conversations for turn in turns}
    assert kinds == {"start", "user", "tool", "edit"}
    for c, turns in enumerate(trace.conversations):
        assert turns[0].kind == "start" and any(turn.kind == "user" for turn in turns)
        for t in range(1, len(turns)):
            before, now = prompts[c][t - 1], prompts[c][t]
            shared = len(os.path.commonprefix([before, now]))
            if turns[t].kind == "tool":  # the reply keeps its reasoning: the prompt extends the last one
                assert now.startswith(before) and reply(c, t - 1).strip() in now
                assert len(now) > len(before) + 2000
            elif turns[t].kind == "user":  # the previous answer re-rendered without its reasoning
                assert shared == len(before) - len(OPENER) + len("<|im_start|>assistant\n")
                assert reply(c, t - 1).strip() not in now
            else:  # edit: an earlier tool result changed, deep in the history
                assert EDITED in now and EDITED not in before
                assert shared < 0.75 * len(before)
    assert sum(turn.kind == "edit" for turns in trace.conversations for turn in turns) >= 5


def test_histories_grow_past_30k_tokens_behind_a_preamble_past_10k(trace, prompts, tmp_path_factory):
    tokenizer = load_tokenizer(write_qwen35_tokenizer_files(tmp_path_factory.mktemp("qwen35")))
    first = prompts[0][0]
    preamble = len(tokenizer.encode(first[: first.index("<|im_end|>")]))
    finals = [len(tokenizer.encode(p[-1])) for p in prompts]
    assert 10000 <= preamble <= 15000
    assert max(finals) > 30000 and min(finals) > 2 * preamble


# --- the run's options, targets and reports (synthetic results: no engine) --------------------------------


def test_host_heavy_sets_a_small_device_a_large_host_and_its_own_report():
    heavy = parse_args(["--host-heavy"])
    assert (heavy.kv_tokens, heavy.host_cache_mib, heavy.probe_reps, heavy.report_name) == \
        (163_840, 32_768, 0, "prefix_cache_host")
    assert heavy.max_model_len < heavy.kv_tokens < 8 * 35_000  # any prompt fits, not 8 lanes of 35k ones
    given = parse_args(["--host-heavy", "--kv-tokens", "65536", "--host-cache-mib", "0", "--report-name", "x"])
    assert (given.kv_tokens, given.host_cache_mib, given.report_name) == (65536, 0, "x")
    device = parse_args([])
    assert (device.kv_tokens, device.host_cache_mib, device.report_name) == (None, None, "prefix_cache")
    assert device.probe_reps > 0
    long = restore.parse_args([])
    assert (long.report_name, long.prefix_tokens, long.models) == ("prefix_cache_restore", 100_000, "27b,35b-a3b")
    assert restore.parse_args(["--smoke"]).prefix_tokens == 2048


def _arm(ttft: float, cached: int, throughput=None, trace_cache=None) -> dict:
    """An arm's result as run_arm returns it: four requests of 1000 prompt tokens."""
    records = [{"conversation": c, "turn": 0, "kind": "start", "finish_reason": "length", "ttft_s": ttft,
                "prompt_tokens": 1000, "cached_tokens": cached, "reusable_tokens": 900, "source": "tap",
                "restored_host_bytes": 1 << 20 if c else 0} for c in range(4)]
    return {"records": records, "throughput": throughput, "trace_cache": trace_cache or {}, "truncated": False,
            "trace_wall_s": 1.0, "compile_s": 1.0, "compiles": {"after_trace": 3}, "options": {},
            "stats": {"pages": {"capacity": 100}}}


def test_reused_arms_come_from_the_earlier_report_and_only_those_asked_for(tmp_path):
    arms = {"hpc": _arm(0.1, 950), "align": _arm(0.25, 900), "no_reuse": _arm(0.6, 0)}
    report = {"date": "d", "command": "c", "arms": {a: {k: v for k, v in r.items() if k != "records"}
                                                      for a, r in arms.items()},
              "requests": [{"arm": a, **rec} for a, r in arms.items() for rec in r["records"]]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(report))
    assert sorted(reused_arms(str(path), ["hpc"])) == ["align", "no_reuse"]
    only = reused_arms(str(path), ["hpc"], "no_reuse")
    assert list(only) == ["no_reuse"] and only["no_reuse"]["records"] == arms["no_reuse"]["records"]
    assert "an earlier run of the same trace, d: `c`" == only["no_reuse"]["reused_from"]


def test_the_throughput_target_prefers_the_pairs_measured_in_the_hpc_process():
    speeds = {"prefill_tok_s": 100.0, "decode_1lane_tok_s": 10.0, "decode_lanes_tok_s": 80.0}
    paired = {**speeds, "paired_off": {**speeds, "decode_lanes_tok_s": 81.0}}  # 1.2% loss on 8 lanes
    slower_arm = {k: v * 1.1 for k, v in speeds.items()}  # the other process ran 10% faster
    results = {"hpc": _arm(0.1, 950, throughput=paired), "no_reuse": _arm(0.6, 0, throughput=slower_arm)}
    target, measured, met = targets(results)[-1]
    assert "throughput loss" in target and met and "+1.2%" in measured and "paired" in measured
    results["hpc"]["throughput"] = speeds  # no pairs: the arms are compared
    target, measured, met = targets(results)[-1]
    assert not met and "+9.1%" in measured and "no-reuse arm" in measured


def test_host_heavy_targets_are_the_ttft_ratios_5x_no_reuse_and_3x_align_as_vllm_ships_it():
    results = {"hpc": _arm(0.1, 950), "align": _arm(0.25, 900), "align_device": _arm(0.28, 400),
               "no_reuse": _arm(0.6, 0)}
    heavy = targets(results, host_heavy=True)
    assert [(t.split(">= ")[-1], met) for t, _, met in heavy] == \
        [("5x better than no reuse", True), ("3x better than align without a Host tier, as vLLM ships it", False),
         ("HPC TTFT p50 against align with this engine's Host tier (no target)", None)]
    assert "2.50x" in heavy[2][1] and "2.80x" in heavy[1][1]
    device = targets(results)  # no throughput probes ran: no throughput row
    assert [met for _, _, met in device] == [True, True, None, True]
    assert "1.5x better than align" in device[1][0] and "90%" in device[3][0]


def test_align_device_is_reported_beside_the_targets_without_a_host_tier(tmp_path, monkeypatch):
    assert parse_args([]).arms == "hpc,align,no_reuse"  # each run's comparisons by default
    assert parse_args(["--host-heavy"]).arms == "hpc,align_device,no_reuse"
    results = {"hpc": _arm(0.1, 950), "align": _arm(0.25, 900), "align_device": _arm(0.5, 400),
               "no_reuse": _arm(0.6, 0)}
    rows = targets(results)  # the Device-tier run: align_device beside its targets
    assert [met for _, _, met in rows[:3]] == [True, True, None]
    assert "without a Host tier" in rows[2][0] and "5.00x" in rows[2][1]
    write_report(results, parse_args(["--host-heavy", "--arms", "hpc,align_device"]), tmp_path, "c", "d")
    assert "| HPC TTFT p50 >= 3x better than align without a Host tier, as vLLM ships it | 0.500 s / 0.100 s" \
        " = 5.00x (over the 4 requests both arms completed) | met |" in (tmp_path / "prefix_cache.md").read_text()
    # --host-cache-mib sizes the cache arms' Host tier; align_device keeps none
    built = {}
    fake = types.SimpleNamespace(tokenizer=None)
    monkeypatch.setattr(prefix_cache, "random_engine",
                        lambda model, args, options, tokenizer=None: (built.update(options), fake)[1])
    for arm in ("align", "align_device"):
        prefix_cache.build_engine(arm, parse_args(["--smoke", "--host-cache-mib", "64"]))
        assert (built["cache_policy"], built["host_cache_mib"]) == ("align", 64 if arm == "align" else 0)
    # ... but the cache arms' slots and taps (their Host-tier defaults), so it shares their compiled programs
    assert (built["device_snapshot_slots"], built["max_new_taps"]) == (parse_args(["--smoke"]).max_concurrency + 1, 8)


def test_the_host_section_counts_restored_and_prefetched_blocks(tmp_path):
    before = {"reuse_tokens": 100, "restored_blocks": 1, "host_restored_bytes": 10, "host_cache_bytes": 1 << 30}
    after = {"reuse_tokens": 740, "restored_blocks": 6, "prefetches": 2, "prefetched_blocks": 4,
             "host_restored_bytes": 4 << 30, "host_restore_seconds": 0.1, "host_cache_bytes": 1 << 30,
             "host_tier": True, "host_pinned": True}
    trace = cache_delta(before, after)
    assert (trace["reuse_tokens"], trace["restored_blocks"], trace["host_cache_bytes"]) == (640, 5, 1 << 30)
    assert host_share(trace) == 9 * 64 / 640
    results = {"hpc": _arm(0.1, 950, trace_cache=trace), "no_reuse": _arm(0.6, 0)}
    write_report(results, parse_args(["--host-heavy", "--smoke"]), tmp_path, "c", "d")
    assert json.loads((tmp_path / "prefix_cache_host.json").read_text())["kv_tokens"] == 2048
    text = (tmp_path / "prefix_cache.md").read_text()  # the Host-heavy run's section of the page
    assert "- command: `c`" in text and "Host-heavy" in text and "## Host tier over the trace" in text
    assert "| hpc | 3 of 4 | 640 | 90.0% | 5 / 0 / 0 | 4.29 | 0.10 | 42.9 | 2 batches, 4 blocks |" in text


def test_the_restore_probe_sizes_its_host_tier_for_the_prefix():
    cfg = model_config("27b")
    o = probe_options(cfg, jnp.bfloat16, 100_000, 2048)
    kv = 100_032 * 64 * 1024  # 1563 blocks of 64 KiB per token
    assert kv < o["host_cache_mib"] << 20 < kv + (8 << 30)
    assert o["max_model_len"] >= 100_032 + 2048 and o["kv_capacity"] >= 2 * o["max_model_len"]
    assert o["max_concurrency"] == 1


def test_the_restore_report_states_its_targets_and_failures():
    row = {"model": "27b", "prefix_tokens": 100_032, "restored_bytes": 6.6e9, "restore_s": 0.15, "restore_gbs": 44.0,
           "ceiling_gbs": 50.0, "batch_ceiling_gbs": 48.0, "batch_slabs": 64, "restore_vs_ceiling": 0.88,
           "recompute_s": 18.0, "recompute_vs_restore": 120.0, "resume_ttft_s": 0.3, "cold_vs_resume_ttft": 60.0,
           "recompute_compiles": 0, "host_pinned": True, "host_slab_bytes": 4 << 20, "compile_s": 12.0,
           "options": {"max_model_len": 103424, "kv_capacity": 206848, "host_cache_mib": 10000},
           "rounds": [{"cached_tokens": 100_032, "source": "tap", "restored_blocks": 1563, "restored_images": 1,
                       "restored_bytes": 6.6e9, "restore_s": 0.15, "restore_gbs": 44.0, "ttft_s": 0.3,
                       "compiles": 0}]}
    rows = [row, {"model": "35b-a3b", "error": "no time left before --deadline"}]
    assert restore_targets(rows) == [("27b: Host restore >= 80% of the pinned device_put ceiling",
                                      "44.0 / 50.0 GB/s = 88%", True)]
    text = "\n".join(restore_markdown(rows, {"command": "c", "date": "d", "device": "H200", "jax": "j",
                                             "kernels": "pallas", "reps": 3}))
    assert "- command: `c`" in text and "device: H200" in text
    assert "| 27b | 100032 | 6.600 | 0.1500 | 44.0 | 50.0 (48.0) | 88% | 18.00 | 120x | 0.300 | 60x | 0 | 12.0 |" \
        in text
    assert "| 35b-a3b | not measured: no time left before --deadline |" in text
    # a recompute that compiled timed the compile: the report quotes no ratio from it
    compiled = {**row, "recompute_compiles": 2, "recompute_vs_restore": None, "cold_vs_resume_ttft": None}
    text = "\n".join(restore_markdown([compiled], {"command": "c", "date": "d", "kernels": "pallas", "reps": 3}))
    assert "| 18.00 | - (the recompute compiled) | 0.300 | - (the recompute compiled) | 2 | 12.0 |" in text


def test_the_restore_probe_resumes_a_demoted_prefix_from_the_host(checkpoint_factory):
    """The probe end to end on the tiny model (the CPU's GB/s mean nothing; the path and its checks do)."""
    directory = checkpoint_factory("tiny-dense", "text", seed=3)
    options = probe_options(ModelConfig.from_file(directory / "config.json"), jnp.float32, 1024, 256)
    engine = Engine.from_pretrained(directory, kernels="reference", warmup=False, **options)
    try:
        row = measure(engine, 1024, 2, "tiny")
    finally:
        engine.stop()
    assert row["prefix_tokens"] == 1024 and row["recompute_compiles"] == 0
    for r in row["rounds"]:
        assert r["cached_tokens"] >= 1024 and r["source"] == "tap" and r["compiles"] == 0
        assert r["restored_blocks"] == 16 and r["restored_images"] == 1 and r["demoted_pages"] >= 16
    assert row["restored_bytes"] == row["rounds"][0]["record_restored_bytes"] > 0


def test_the_device_trace_summary_counts_only_device_events(tmp_path):
    import gzip

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "python"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
              {"ph": "X", "pid": 1, "tid": 8, "name": "MemcpyD2H", "ts": 0.0, "dur": 1700.0},
              {"ph": "X", "pid": 1, "tid": 8, "name": "MemcpyD2H", "ts": 1000.0, "dur": 300.0},
              {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.12", "ts": 100.0, "dur": 500.0},
              {"ph": "X", "pid": 2, "tid": 1, "name": "$worker.py step", "ts": 0.0, "dur": 9000.0}]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = summarize_device_trace(path)
    assert summary["busy_us"] == 2500.0 and summary["events"] == 3
    assert summary["top"] == [{"name": "MemcpyD2H", "us": 2000.0, "count": 2},
                              {"name": "fusion.12", "us": 500.0, "count": 1}]
    # per device line: overlapping copies merged (1700 us, not 2000), an unnamed line named by its process
    assert summary["threads"] == [
        {"name": "/device:GPU:0/8", "events": 2, "busy_us": 1700.0, "span_us": 1700.0},
        {"name": "Stream #7", "events": 1, "busy_us": 500.0, "span_us": 500.0}]


def test_the_host_event_table_leaves_out_device_events_and_python_frames(tmp_path):
    import gzip

    from ninfer_jax.benchmarks.profiling import host_event_table

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.12", "ts": 0.0, "dur": 500.0},
              {"ph": "X", "pid": 3, "tid": 1, "name": "PjitFunction(decode_step)", "ts": 0.0, "dur": 2000.0},
              {"ph": "X", "pid": 3, "tid": 1, "name": "PjitFunction(decode_step)", "ts": 5000.0, "dur": 1000.0},
              {"ph": "X", "pid": 3, "tid": 1, "name": "ThunkExecutor::Execute", "ts": 10.0, "dur": 400.0},
              {"ph": "X", "pid": 3, "tid": 1, "name": "$runner.py:431 _decode_packed", "ts": 0.0, "dur": 9000.0}]
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert host_event_table(tmp_path, rounds=2, top=5) == [
        {"event": "PjitFunction(decode_step)", "us_per_round": 1500.0, "per_round": 1.0},
        {"event": "ThunkExecutor::Execute", "us_per_round": 200.0, "per_round": 0.5}]


def test_a_deadline_too_short_for_the_first_arm_is_refused_before_any_work(tmp_path):
    from ninfer_jax.benchmarks.prefix_cache import main

    with pytest.raises(SystemExit, match="--deadline 170 s is too short for 1 arm"):
        main(["--arms", "hpc", "--deadline", "170", "--probe-reserve", "140", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="give more than 230 s"):  # 100 + 30 for the first arm, 100 for the second
        main(["--arms", "hpc,align", "--deadline", "200", "--probe-reserve", "100", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # no report of a run that measured nothing


def test_the_smoke_claim_judges_only_the_arms_that_were_asked_for():
    def arm(cached):
        return {"records": [{"finish_reason": "stop", "conversation": 0, "turn": 0, "ttft_s": 0.1,
                             "prompt_tokens": 100, "cached_tokens": cached, "reusable_tokens": 100}]}

    assert prefix_cache.smoke_check({"hpc": arm(80)}) == 0  # --arms hpc
    assert prefix_cache.smoke_check({"hpc": arm(80), "no_reuse": arm(0)}) == 0
    assert prefix_cache.smoke_check({"hpc": arm(80), "no_reuse": arm(5)}) == 1  # no reuse served cached tokens
    assert prefix_cache.smoke_check({"hpc": arm(80), "no_reuse": {"error": "crashed"}}) == 1  # asked for, no records
    assert prefix_cache.smoke_check({"hpc": arm(10)}) == 1


def test_an_arm_that_ran_no_request_fails_the_run_and_says_why(tmp_path, monkeypatch, capsys):
    """A deadline that ends inside the engine's warm-up leaves an arm with no request: the page says that no probe
    ran either, and the run exits 1 naming the seconds the engine took to be ready."""
    empty = {**_arm(0.1, 0), "records": [], "truncated": True, "init_s": 12.0, "compile_s": 248.0}
    monkeypatch.setattr(prefix_cache, "run_child", lambda *a, **k: dict(empty))
    assert prefix_cache.main(["--arms", "hpc", "--probe-reps", "0", "--out", str(tmp_path)]) == 1
    assert "FAILED hpc: no request ran; its engine was ready after 260 s" in capsys.readouterr().out
    text = (tmp_path / "prefix_cache.md").read_text()
    assert "hpc: the deadline cut the trace before its first request, and no probe ran" in text
