"""Decode at many lanes: a wave of requests timed over the rounds in which every lane decodes, and the roofline
of such a round.

A wave submits L prompts at once. The scheduler prefills one prompt per step beside a decode round, so the lanes
admitted first decode while the last still prefill: only the rounds after the last first token and before the
first finish run all L lanes. `full_width_window` times those rounds by the token events of the lane that finishes
first (one event per round read); `round_roofline` is what such a round costs at the device's copy and matmul
rates.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import queue
import time

import jax.numpy as jnp

from ninfer_jax.benchmarks.models import gdn_ab_params, weight_parts
from ninfer_jax.model.state import PAGE, page_bytes, slot_bytes
from ninfer_jax.runtime.options import DENSE_MIXED_TOKENS, DENSE_PREFILL_CHUNK, MOE_MIXED_TOKENS, MOE_PREFILL_CHUNK

BF16_BYTES = 2


def expected_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens touch in one layer when each picks `per_token` of `num_experts` uniformly:
    E x (1 - (1 - k/E)^L)."""
    return num_experts * (1 - (1 - per_token / num_experts) ** tokens)


@dataclasses.dataclass(frozen=True)
class RoundRoofline:
    """The bytes and FLOPs of one decode round of `lanes` rows at `context` tokens each, and the seconds the
    device's copy and matmul rates give it (the larger of the two)."""

    lanes: int
    context: float
    weight_bytes: float  # non-expert weights once, the experts the round's tokens touch, lm_head, embedding rows
    kv_bytes: float  # K and V of every attention layer over each lane's context
    state_bytes: float  # each lane's GDN state read and written
    flops: float
    experts_per_layer: float  # distinct routed experts the round touches per layer (0 for a dense model)
    seconds: float
    bound: str  # "bytes" or "flops": which rate sets `seconds`

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.state_bytes

    @property
    def tok_s(self) -> float:
        return self.lanes / self.seconds


def _touched_experts(w, rows: int) -> float:
    """Distinct routed experts `rows` rows touch in a layer of WeightParts `w` (0 for a dense model)."""
    return expected_experts(w.num_experts, w.experts_per_token, rows) if w.num_experts else 0.0


def round_weight_bytes(cfg, rows: int, fp8: bool = False) -> float:
    """The weight bytes a round of `rows` rows reads: the non-expert weights once, the experts its rows touch
    (`expected_experts`: uniform routing, as random weights route), the lm_head and the rows' embeddings; fp8 as
    `round_roofline`'s."""
    w = weight_parts(cfg)
    experts = _touched_experts(w, rows)
    linears = w.mixers + w.layers * (w.ffn + experts * w.expert)
    return BF16_BYTES * (linears + w.vocab_rows + rows * w.hidden) - (linears - gdn_ab_params(cfg) if fp8 else 0)


def mtp_draft_bytes(cfg, rows: int) -> float:
    """The bf16 weight bytes one chained MTP draft step of `rows` rows reads at least: the MTP layer's fc [2H, H],
    its attention projections and FFN (a MoE's shared expert and the experts its rows touch), and the shared
    lm_head for the draft's logits."""
    w = weight_parts(cfg)
    experts = _touched_experts(w, rows)
    return BF16_BYTES * (2 * w.hidden * w.hidden + w.attention + w.ffn + experts * w.expert + w.vocab_rows)


def verify_bytes_floor(cfg, lanes: int, k: int) -> float:
    """The weight bytes a chained verify round of k + 1 rows per lane and k MTP drafts reads over a plain round's:
    where both run at their bytes roofline, their cost ratio cannot go under it."""
    return (round_weight_bytes(cfg, lanes * (k + 1)) + k * mtp_draft_bytes(cfg, lanes)) / round_weight_bytes(cfg, lanes)


def round_roofline(cfg, lanes: int, context: float, tflops: float, tbps: float, fp8: bool = False) -> RoundRoofline:
    """The roofline of a decode round of `lanes` rows, each reading `context` tokens of KV, at `tflops` TFLOP/s
    and `tbps` TB/s (`models.measure_ceilings`); fp8: the linears the FP8 packs quantize at one byte (their block
    scales add 1/4096 and are left out), the rest bf16. FLOPs: 2 x active params per row, plus 4 x head_dim x
    heads x context per row and attention layer (scores and values)."""
    w = weight_parts(cfg)
    experts = _touched_experts(w, lanes)
    weights = round_weight_bytes(cfg, lanes, fp8)
    kv = lanes * context * page_bytes(cfg, jnp.bfloat16) / PAGE
    state = 2 * lanes * slot_bytes(cfg, jnp.bfloat16)
    attention = len(cfg.attn_layers) * 4 * cfg.head_dim * cfg.num_attention_heads * context * lanes
    flops = 2 * w.active * lanes + attention
    by_bytes, by_flops = (weights + kv + state) / (tbps * 1e12), flops / (tflops * 1e12)
    return RoundRoofline(lanes, context, weights, kv, state, flops, experts, max(by_bytes, by_flops),
                         "bytes" if by_bytes >= by_flops else "flops")


def wave_tokens(cfg, lanes: int, context: int, rounds: int, pass_tokens: int | None = None) -> int:
    """Tokens each lane of a wave asks so that about `rounds` rounds run all `lanes` lanes: a lane decodes one token
    a step from its first token on, and the last lane's prompt ends (lanes - 1) x its passes later (one pass a step,
    ceil(context / pass_tokens) each). pass_tokens: a prompt's pass while other lanes decode (the engine's
    `mixed_prefill_tokens`, or its prefill chunk where steps do not mix); None: a GPU engine's default, the mixed
    pass. 4 spare: 3 more rounds when admission keeps pace, fewer when a prompt arrives after the passes before it
    ran."""
    pass_tokens = pass_tokens or default_pass_tokens(cfg)
    return (lanes - 1) * -(-context // pass_tokens) + rounds + 4


def default_pass_tokens(cfg, prefill_chunk: int | None = None) -> int:
    """A GPU engine's pass beside decoding lanes, before it starts: its mixed pass, at most `prefill_chunk` (on a
    CPU, which does not mix, this undercounts the pass and so asks more tokens than needed, never fewer)."""
    chunk = prefill_chunk or (MOE_PREFILL_CHUNK if cfg.is_moe else DENSE_PREFILL_CHUNK)
    return min(MOE_MIXED_TOKENS if cfg.is_moe else DENSE_MIXED_TOKENS, chunk)


def engine_pass_tokens(engine) -> int:
    """`wave_tokens`' pass_tokens of a running engine."""
    return engine.options.mixed_prefill_tokens or engine.options.prefill_chunk


@dataclasses.dataclass(frozen=True)
class DecodeWindow:
    """The full-width rounds of a wave: `rounds` rounds of `lanes` rows in `seconds`; each lane had emitted
    `start_tokens` tokens on average when the window opened and `end_tokens` when it closed. `every_lane`: each
    lane emitted exactly one token per round read inside the window (a round that lacked a lane would show)."""

    lanes: int
    rounds: int
    seconds: float
    start_tokens: float
    end_tokens: float
    every_lane: bool

    @property
    def tok_s(self) -> float:
        return self.lanes * self.rounds / self.seconds

    @property
    def ms_per_round(self) -> float:
        return self.seconds / self.rounds * 1e3


def full_width_window(events: list[list[tuple[float, int]]]) -> DecodeWindow | None:
    """The rounds in which every lane decodes, from each lane's token events (time, tokens > 0), in order.

    The window is timed by the reads of the lane that finishes first (without speculation each of its token events
    is one round read). It opens at its second read after the last lane's first token: a round is read one step
    after its dispatch, and the rounds read until then were dispatched before that token was read, so they lack
    that lane. It closes at the first lane's last token. None when fewer than two reads lie between, or a lane has
    no token (the first lane finished too early: give each lane more tokens than there are lanes).

    `every_lane` checks that each lane has an event in each timed read, by order rather than by closeness in time
    (a loaded host can stall between two lanes' events of one read longer than between two reads): the engine's
    thread emits a read's events one after another, each lane at the same place in every read, so a lane emitted
    before the first lane has one event in each interval (previous read, read], one emitted after it one in each
    [read, next read)."""
    if not all(events):
        return None
    last_first = max(lane[0][0] for lane in events)
    first_done = min(events, key=lambda lane: lane[-1][0])
    reads = [(t, n) for t, n in first_done if t > last_first][1:]
    if len(reads) < 2:
        return None
    start, end = reads[0][0], reads[-1][0]
    rounds = sum(n for _, n in reads[1:])
    times = [t for t, _ in reads]

    def in_every_read(lane: list[tuple[float, int]]) -> bool:
        at = [t for t, _ in lane]
        before = all(bisect.bisect_right(at, b) > bisect.bisect_right(at, a) for a, b in itertools.pairwise(times))
        after = all(bisect.bisect_left(at, b) > bisect.bisect_left(at, a)
                    for a, b in itertools.pairwise([*times[1:], float("inf")]))
        return before or after

    def mean_emitted(until: float) -> float:
        return sum(n for lane in events for t, n in lane if t <= until) / len(events)

    return DecodeWindow(len(events), rounds, end - start, mean_emitted(start), mean_emitted(end),
                        all(in_every_read(lane) for lane in events))


@dataclasses.dataclass(frozen=True)
class Wave:
    """A wave's token events per lane (perf_counter seconds, tokens), its wall seconds (submission to its last
    event), the programs it compiled, the worker's seconds by phase (`Scheduler.stats` "seconds_*") per decode
    round it ran, and each lane's finish reason."""

    events: list[list[tuple[float, int]]]
    seconds: float
    compiles: int
    ms_per_round_by_phase: dict[str, float]
    finish_reasons: list[str]

    def window(self) -> DecodeWindow | None:
        return full_width_window(self.events)


def run_wave(engine, prompts: list[list[int]], sampling) -> Wave:
    """Submits every prompt, records each lane's token events as the engine emits them, and cancels the rest once
    the first lane finishes (its last token closes the full-width window; the narrower rounds after it are not
    timed). Raises RuntimeError when a request ends in an error."""
    before = engine.stats()
    events: list[list[tuple[float, int]]] = [[] for _ in prompts]
    finished: queue.SimpleQueue = queue.SimpleQueue()

    def sink(lane: int):
        def record(event) -> None:  # on the engine's thread: a timestamp at emission, not at our read
            if event.token_ids:
                events[lane].append((time.perf_counter(), len(event.token_ids)))
            if event.finish_reason is not None:
                finished.put((lane, event))
        return record

    start = time.perf_counter()
    ids = [engine.submit(p, sampling, sink=sink(i)) for i, p in enumerate(prompts)]
    reasons: list[str | None] = [None] * len(prompts)
    for _ in prompts:
        lane, event = finished.get()
        if event.finish_reason == "error":
            raise RuntimeError(f"a wave request failed: {event.error}")
        if not any(reasons):
            for other, rid in enumerate(ids):
                if other != lane:
                    engine.cancel(rid)
        reasons[lane] = event.finish_reason
    seconds = time.perf_counter() - start
    after = engine.stats()
    rounds = max(1, after["scheduler"].get("decode_rounds", 0) - before["scheduler"].get("decode_rounds", 0))
    phases = {k.removeprefix("seconds_"): (v - before["scheduler"].get(k, 0)) / rounds * 1e3
              for k, v in after["scheduler"].items() if k.startswith("seconds_")}
    return Wave(events, seconds, after["compiles_since_warmup"] - before["compiles_since_warmup"], phases, reasons)
