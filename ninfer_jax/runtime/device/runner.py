"""ModelRunner: owns the params and the DeviceState, and runs the jitted prefill and decode steps.

Each step donates the DeviceState and returns it; `_swap` is the one place that assigns it back, checking
that the pools kept their shapes. Step shapes come from a bounded set (`device/buckets.py`: prefill pass lengths,
decode rounds of 1, 2, 4, ... C lanes; a greedy and a full sampler), all compiled by `warmup()`, with the
log-probabilities' program for each round size (`_logprobs_step`, dispatched only when a request asks) and the
logit processing's (`_process_step`: penalties, logit_bias, min_tokens, grammar masks; it samples a step's rows
again from its logits, dispatched only when a request of the step asks, so other steps keep their programs);
`compile_count()` lets tests prove that serving never compiles again. Each step's host inputs arrive packed in
one int32 array (`pack_prefill_inputs`, `pack_decode_inputs`).

Host tier transfers (spec §6.5, §7.6; `enable_host_transfers`) jit the programs of `device/transfer.py`; a
batch of pages is split into the compiled power-of-two sizes (`buckets.split_transfer`), so transfers compile once
and never move a padding row.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import mtp, qwen3_5, vision
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import Params
from ninfer_jax.model.spmd import conv_order, kv_order
from ninfer_jax.model.state import PAGE, DeviceState, init_device_state
from ninfer_jax.runtime.device import transfer
from ninfer_jax.runtime.device.buckets import StepSizes, fit, idle_chunk_sizes, pow2_buckets, prefill_buckets
from ninfer_jax.runtime.device.compiling import AheadOfTime
from ninfer_jax.runtime.device.sharding import ParallelLayout
from ninfer_jax.runtime.device.transfer import WORD_BYTES
from ninfer_jax.runtime.sampling import (
    MAX_LOGIT_BIAS, TOP_K_GROUPS, SamplerState, count_tokens, mask_words, process_logits, sample, set_lane_row,
    token_logprobs,
)
from ninfer_jax.runtime.speculative import accept_drafts

log = logging.getLogger("ninfer_jax.runner")

# The most lanes a verify round takes: past them a round's k + 1 rows per lane stop riding on the weights' read for
# free, so wider rounds decode plainly. Not measured yet on the H200 (docs/STATUS.md).
SPECULATIVE_MAX_LANES = 16


# A step's host inputs travel packed into one int32 array (floats bit-cast): one host-to-device copy per step
# instead of a dozen. Each copy costs host time and a trip through the GIL, and a decode round computes for
# only a few milliseconds.


SAMPLER_COLUMNS = 6  # the SamplerInputs arrays; the fifth (index 4) is the step


def _sampler_columns(sampler) -> list[np.ndarray]:
    """The SamplerInputs arrays ([B] each) as int32 columns."""
    temperature, top_k, top_p, seed, step, min_p = sampler
    return [np.asarray(temperature, np.float32).view(np.int32), np.asarray(top_k, np.int32),
            np.asarray(top_p, np.float32).view(np.int32), np.asarray(seed, np.uint32).view(np.int32),
            np.asarray(step, np.int32), np.asarray(min_p, np.float32).view(np.int32)]


def _sampler_from_columns(col):
    """The inverse of _sampler_columns, inside a step."""
    as_f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    return (as_f32(col[0]), col[1], as_f32(col[2]), jax.lax.bitcast_convert_type(col[3], jnp.uint32), col[4],
            as_f32(col[5]))


# n_valid, base, slot, the lane's sampler values, its lane, resumed (MTP rows)
PREFILL_SCALARS = 3 + SAMPLER_COLUMNS + 2
PREFILL_ROWS = 5  # per token: its id, its three MRoPE positions, its media row (-1: the token's own embedding)


def pack_prefill_inputs(tokens, size: int, base: int, slot: int, sampler, tap_positions, tap_slots, page_table,
                        max_taps: int, lane: int = 0, resumed: bool = False, rope_positions=None,
                        media_rows=None) -> np.ndarray:
    """One lane's prefill inputs as int32 [PREFILL_ROWS size + PREFILL_SCALARS + 2 max_taps + len(page_table)],
    written once into a new array: the tokens padded to the bucket `size` (n_valid = len(tokens)), their MRoPE
    positions ([3, n]; None: base, base + 1, ...) and media rows ([n]: the row of the encoder's output that replaces
    a token's embedding, -1 for none; None: all -1), the lane's sampler values, the taps padded to max_taps
    (position -1: none), the page table."""
    n, taps = len(tokens), len(tap_positions)
    if taps > max_taps or len(tap_slots) != taps:
        raise ValueError(f"{taps} tap positions and {len(tap_slots)} tap slots for {max_taps} tap places")
    at = PREFILL_ROWS * size + PREFILL_SCALARS  # the taps' start
    packed = np.zeros(at + 2 * max_taps + len(page_table), np.int32)
    rows = packed[:PREFILL_ROWS * size].reshape(PREFILL_ROWS, size)
    rows[0, :n] = tokens
    rows[1:4] = base + np.arange(size)  # padding rows too: they rotate somewhere harmless
    if rope_positions is not None:
        rows[1:4, :n] = rope_positions
    rows[4] = -1
    if media_rows is not None:
        rows[4, :n] = media_rows
    packed[PREFILL_ROWS * size:at] = [n, base, slot, *(c[0] for c in _sampler_columns(sampler)), lane, resumed]
    packed[at:at + max_taps] = -1
    packed[at:at + taps] = tap_positions
    packed[at + max_taps:at + max_taps + taps] = tap_slots
    packed[at + 2 * max_taps:] = page_table
    return packed


def _unpack_prefill_inputs(params, layout, packed, media):
    """A pass's packed inputs -> (its embeddings [T, H] (the media rows' where a token names one), `qwen3_5.prefill`'s
    context, the lane's sampler inputs, the raw scalars)."""
    size, taps = layout  # static: the bucket's token count and the tap capacity
    rows = packed[:PREFILL_ROWS * size].reshape(PREFILL_ROWS, size)
    tokens, rope_positions, media_rows = rows[0], rows[1:4], rows[4]
    at = PREFILL_ROWS * size
    scalars = packed[at:at + PREFILL_SCALARS]
    sampler = _sampler_from_columns([scalars[3 + i][None] for i in range(SAMPLER_COLUMNS)])
    embeds = jnp.where((media_rows >= 0)[:, None], media[jnp.clip(media_rows, 0)].astype(params.embed.dtype),
                       params.embed[tokens])
    ctx = dict(n_valid=scalars[0], base=scalars[1], slot=scalars[2], rope_positions=rope_positions,
               tap_positions=packed[at + PREFILL_SCALARS:at + PREFILL_SCALARS + taps],
               tap_slots=packed[at + PREFILL_SCALARS + taps:at + PREFILL_SCALARS + 2 * taps],
               page_table=packed[at + PREFILL_SCALARS + 2 * taps:])
    return tokens, embeds, ctx, sampler, scalars


def _sample_last(params, hidden, n_valid, sampler, full):
    """A pass's next token from its last real row: (token [1], that row's logits [1, V]), and the row [1, H]."""
    last = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, axis=0)  # [1, H]
    logits = qwen3_5.logits(params, last)
    return (sample(logits, sampler, full=full), logits), last


def _prefill_step(params, cfg, kc, full, layout, state, packed, media, carry=None):
    """One prefill chunk of one lane -> ((its next token [1], the last row's logits [1, V]), state, with MTP (carry:
    the lanes' last target hidden [C, H]) the new carry, and the chunk's final-normed hidden rows [T, H] (for
    `_scores_step`; dropped unless asked for: the buffer exists at the step's end anyway). MTP also writes the
    chunk's MTP rows. media [R, H]: the image encoder's output rows (`ModelRunner.enable_vision`), read where a token
    names one."""
    tokens, embeds, ctx, sampler, scalars = _unpack_prefill_inputs(params, layout, packed, media)
    n_valid, base, page_table, rope_positions = ctx["n_valid"], ctx["base"], ctx["page_table"], ctx["rope_positions"]
    hidden, state = qwen3_5.prefill(params, cfg, kc, tokens, n_valid, base, page_table, ctx["slot"], state,
                                    ctx["tap_positions"], ctx["tap_slots"], rope_positions=rope_positions,
                                    inputs_embeds=embeds)
    out, last = _sample_last(params, hidden, n_valid, sampler, full)
    if carry is None:
        return out, state, hidden
    lane, resumed = scalars[3 + SAMPLER_COLUMNS], scalars[4 + SAMPLER_COLUMNS] != 0
    pages = mtp.mtp_prefill_rows(params, cfg, kc, hidden, tokens, n_valid, base, page_table, carry[lane], resumed,
                                 *state.mtp_pages, rope_positions)
    return out, state.with_mtp_pages(*pages), carry.at[lane].set(last[0].astype(carry.dtype)), hidden


# Rows of a pass scored at a time (`_scores_step`): their float32 logits are SCORE_ROWS x vocabulary (254 MB at 256
# rows of Qwen3.5's 248k), where a 32k-token pass's at once would be 32 GB.
SCORE_ROWS = 256


def _scores_step(params, hidden, targets, top_k_groups):
    """A pass's final-normed hidden rows [T, H] and each row's next prompt token targets [T] -> each row's logprob of
    its target [T] and its top MAX_LOGPROBS (ids [T, n], logprobs [T, n]): prompt logprobs, SCORE_ROWS rows at a
    time."""
    t = hidden.shape[0]
    rows = min(t, SCORE_ROWS)
    pad = -t % rows
    blocks = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, rows, hidden.shape[1])

    def score(xs):
        x, y = xs
        chosen, (ids, lps) = token_logprobs(qwen3_5.logits(params, x), y, top_k_groups=top_k_groups)
        return chosen, ids, lps

    chosen, ids, lps = jax.lax.map(score, (blocks, jnp.pad(targets, (0, pad)).reshape(-1, rows)))
    return chosen.reshape(-1)[:t], ids.reshape(t + pad, -1)[:t], lps.reshape(t + pad, -1)[:t]


# tokens, positions, slots, active, use_prev, lane, then the sampler columns, then the rope shift
DECODE_COLUMNS = 6 + SAMPLER_COLUMNS + 1


def pack_decode_inputs(lanes, size: int, tokens, positions, page_tables, slots, use_prev, sampler,
                       rope_shift=None) -> np.ndarray:
    """A decode round's rows as int32 [size, DECODE_COLUMNS + max_pages]: row i is lane lanes[i] (its entries of
    the [C] lane arrays; rope_shift: each lane's MRoPE delta, None for zeros), then padding rows up to the bucket
    `size`, inactive and marked lane C (past every lane, so the step drops their outputs). A padding row takes the
    state slot of a lane not in the round: the GDN step writes every row's slot back (an inactive row's
    unchanged), so slots must be distinct."""
    lanes = np.asarray(lanes, np.int64)
    n, c = len(lanes), len(tokens)
    lane_columns = [np.asarray(col, np.int32) for col in (tokens, positions, slots, np.ones(c), use_prev, np.arange(c))]
    columns = lane_columns + _sampler_columns(sampler) + [np.zeros(c, np.int32) if rope_shift is None
                                                          else np.asarray(rope_shift, np.int32)]
    packed = np.zeros((size, DECODE_COLUMNS + page_tables.shape[1]), np.int32)
    packed[:n, :DECODE_COLUMNS] = np.stack([col[lanes] for col in columns], axis=1)
    packed[:n, DECODE_COLUMNS:] = np.asarray(page_tables)[lanes]
    if size > n:
        packed[n:, 5] = c
        packed[n:, 2] = np.asarray(slots, np.int32)[np.setdiff1d(np.arange(c), lanes)[:size - n]]
    return packed


def _round_inputs(packed, prev_tokens):
    """A round's packed rows -> (tokens [R], `qwen3_5.decode`'s context, each row's lane, the sampler inputs). A lane
    whose previous round is still in flight takes its token from that round's output on the device."""
    col = [packed[:, i] for i in range(DECODE_COLUMNS)]
    tokens, use_prev, lanes = col[0], col[4] != 0, col[5]
    tokens = jnp.where(use_prev, prev_tokens.at[lanes].get(mode="fill", fill_value=0), tokens)
    ctx = dict(positions=col[1], slots=col[2], active=col[3] != 0, page_tables=packed[:, DECODE_COLUMNS:],
               rope_shift=col[DECODE_COLUMNS - 1])
    return tokens, ctx, lanes, _sampler_from_columns(col[6:6 + SAMPLER_COLUMNS])


def _round_out(params, hidden, sampler, lanes, full, width: int):
    """A round's final hidden rows -> (tokens by lane [width], zero for lanes not in the round; logits by row)."""
    logits = qwen3_5.logits(params, hidden)
    return _rows_to_lanes(sample(logits, sampler, full=full), lanes, width), logits


def _mixed_step(params, cfg, kc, full, layout, state, packed, media, round_packed, prev_tokens):
    """One lane's prefill chunk and a decode round over other lanes in one pass (`qwen3_5.mixed`) -> (the chunk's
    (next token [1], logits [1, V]), the round's (tokens by lane [C], logits by row [rows, V])), state). The inputs
    are `_prefill_step`'s (no MTP) and `_decode_step`'s; full: either may sample (the full sampler takes a greedy
    row's argmax)."""
    _, embeds, p_ctx, p_sampler, _ = _unpack_prefill_inputs(params, layout, packed, media)
    tokens, d_ctx, lanes, sampler = _round_inputs(round_packed, prev_tokens)
    hidden, state = qwen3_5.mixed(params, cfg, kc, embeds, p_ctx, tokens, d_ctx, state)
    t = embeds.shape[0]
    chunk, _ = _sample_last(params, hidden[:t], p_ctx["n_valid"], p_sampler, full)
    return (chunk, _round_out(params, hidden[t:], sampler, lanes, full, prev_tokens.shape[0])), state


def _rows_to_lanes(x, rows, width: int):
    """A step's per-row output x [R, ...] indexed by lane instead: [width, ...], row i at rows[i]; rows at width or
    past it (padding) are dropped, lanes no row names are zero."""
    return jnp.zeros((width,) + x.shape[1:], x.dtype).at[rows].set(x, mode="drop")


def _decode_step(params, cfg, kc, full, state, packed, prev_tokens):
    """One decode round over a bucket of rows (active lanes first, then padding) -> ((tokens indexed by lane [C]
    like prev_tokens, zero for lanes not in the round; logits by row [rows, V]), state)."""
    tokens, c, lanes, sampler = _round_inputs(packed, prev_tokens)
    hidden, state = qwen3_5.decode(params, cfg, kc, tokens, c["positions"], c["page_tables"], c["slots"], c["active"],
                                   state, c["rope_shift"])
    return _round_out(params, hidden, sampler, lanes, full, prev_tokens.shape[0]), state


# position, slot, count (rows fed), stops (the engine's stop tokens end it), lane; then the sampler columns; then
# (from _V_LIMITS) the positions the lane may feed below (its pages, and the context: MTP drafts write no key past
# them); then the rope shift; then whether the lane continues the previous round's frontier on the device, the
# tokens it may still emit, and its phase; then the request's own stop ids (-1: none)
LANE_STOPS = 4
_V_LIMITS = 5 + SAMPLER_COLUMNS
_V_ROPE, _V_CHAINED, _V_LEFT, _V_PHASE, _V_STOPS = range(_V_LIMITS + 1, _V_LIMITS + 6)
VERIFY_COLUMNS = _V_STOPS + LANE_STOPS
# A lane's phase in verify rounds: it decodes (LIVE); it stopped on an engine stop token it has not fed, which its
# next round feeds alone, as a plain round in flight does (CLOSING); or it runs no more rounds (DONE).
LIVE, CLOSING, DONE = 0, 1, 2
# A verify round's frontier by lane, int32 [C, T + FRONTIER_COLUMNS]: the T tokens a next round feeds (the token
# after the kept drafts, then the next drafts), then its position, sampler step, tokens left and phase.
FRONTIER_COLUMNS = 4


def pack_verify_inputs(lanes, size: int, tokens, positions, counts, stops, page_tables, slots, sampler,
                       limits=None, rope_shift=None, chained=None, left=None, phase=None,
                       lane_stops=None) -> np.ndarray:
    """A verify round's rows as int32 [size, T + VERIFY_COLUMNS + max_pages]: row i is lane lanes[i] (tokens [C, T],
    the rest [C] lane arrays), then padding rows of count 0 marked lane C, each on the state slot of a lane not in
    the round (the GDN commit writes every row's slot back, so slots must be distinct). A `chained` lane takes its
    tokens, position, count, sampler step, tokens left and phase from the previous round's frontier instead.
    lane_stops: [C, LANE_STOPS] each lane's own stop ids, -1 for none."""
    lanes = np.asarray(lanes, np.int64)
    n, (c, t) = len(lanes), np.shape(tokens)
    zeros = np.zeros(c, np.int32)
    columns = [np.asarray(col, np.int32) for col in (positions, slots, counts, stops, np.arange(c))]
    columns += _sampler_columns(sampler)
    columns += [zeros if x is None else np.asarray(x, np.int32) for x in (limits, rope_shift, chained, left, phase)]
    own = np.full((c, LANE_STOPS), -1, np.int32) if lane_stops is None else np.asarray(lane_stops, np.int32)
    columns += list(own.T)
    packed = np.zeros((size, t + VERIFY_COLUMNS + page_tables.shape[1]), np.int32)
    packed[:n, :t] = np.asarray(tokens, np.int32)[lanes]
    packed[:n, t:t + VERIFY_COLUMNS] = np.stack([col[lanes] for col in columns], axis=1)
    packed[:n, t + VERIFY_COLUMNS:] = np.asarray(page_tables)[lanes]
    if size > n:
        packed[n:, t + 4] = c
        packed[n:, t + 1] = np.asarray(slots, np.int32)[np.setdiff1d(np.arange(c), lanes)[:size - n]]
    return packed


def _verify_rows(packed, t: int, frontier):
    """A verify round's packed rows -> (tokens [R, T], positions, counts, sampler, limits, phase, tokens left); a
    chained row's from `frontier`, its count from its phase, tokens left and limit: LIVE feeds up to T rows,
    CLOSING its last token alone, DONE nothing."""
    col = [packed[:, t + i] for i in range(VERIFY_COLUMNS)]
    chained, lanes, limits = col[_V_CHAINED] != 0, col[4], col[_V_LIMITS]
    front = frontier.at[lanes].get(mode="fill", fill_value=0)
    pick = lambda own, j: jnp.where(chained, front[:, t + j], own)  # noqa: E731
    tokens = jnp.where(chained[:, None], front[:, :t], packed[:, :t])
    positions, step, left, phase = pick(col[0], 0), pick(col[9], 1), pick(col[_V_LEFT], 2), pick(col[_V_PHASE], 3)
    room = limits - positions
    count = jnp.where(phase == LIVE, jnp.clip(jnp.minimum(jnp.minimum(left, room), t), 0),
                      jnp.where(phase == CLOSING, (room > 0).astype(jnp.int32), 0))
    counts = jnp.where(chained, count, col[2])
    sampler = _sampler_from_columns(col[5:9] + [step] + col[10:_V_LIMITS])  # column 9 is the step
    return tokens, positions, counts, sampler, limits, phase, left


def _verify_frontier(tokens, positions, counts, sampler, phase, left, emitted, kept, ends, drafts):
    """Each row's frontier after a verify round ([R, T + FRONTIER_COLUMNS]): a LIVE row that fed advances past its
    kept drafts to the token after them and the next drafts (zeros without MTP) and turns CLOSING on an engine stop,
    DONE with no tokens left; a CLOSING row that fed is DONE; a row that fed nothing keeps its frontier."""
    rows = jnp.arange(tokens.shape[0])
    fed, live = counts > 0, phase == LIVE
    emitted_n = jnp.where(live & fed, kept + 1, 0)
    left = left - emitted_n
    after = jnp.where(live, jnp.where(ends, CLOSING, jnp.where(left <= 0, DONE, LIVE)), DONE)
    phase = jnp.where(fed, after, phase)
    advanced = jnp.concatenate([emitted[rows, kept][:, None], drafts], axis=1)
    tokens = jnp.where((live & fed)[:, None], advanced, tokens)
    positions = positions + jnp.where(fed, jnp.where(live, kept + 1, 1), 0)
    return jnp.concatenate([tokens, jnp.stack([positions, sampler[4] + emitted_n, left, phase], axis=1)], axis=1)


def _verify_step(params, cfg, kc, full, layout, state, packed, stop_mask, frontier, carry=None):
    """One verify round (`qwen3_5.verify`, `speculative.accept_drafts`, `qwen3_5.commit_verified`) over a bucket of
    lanes -> ((emitted tokens [C T], lane l's row t at l T + t; drafts kept by lane [C]; the rows' logits [R T, V];
    rows fed by lane [C]; the frontier by lane), state). layout: static (T, C). `frontier`: the previous round's,
    which chained rows continue. With MTP (carry: the lanes' last target hidden [C, H]) the outputs add the next
    round's drafts by lane [C, T - 1], and the new carry follows the state."""
    t, width = layout
    slots, stops, lanes = packed[:, t + 1], packed[:, t + 3] != 0, packed[:, t + 4]
    tokens, positions, counts, sampler, limits, phase, left = _verify_rows(packed, t, frontier)
    page_tables, rope_shift = packed[:, t + VERIFY_COLUMNS:], packed[:, t + _V_ROPE]
    hidden, state, replay = qwen3_5.verify(params, cfg, kc, tokens, positions, page_tables, slots, counts, state,
                                           rope_shift)
    logits = qwen3_5.logits(params, hidden).reshape(tokens.shape[0], t, -1)
    lane_stops = packed[:, t + _V_STOPS:t + VERIFY_COLUMNS]
    emitted, kept, ends = accept_drafts(logits, tokens, counts, sampler, stop_mask, stops, lane_stops, full=full)
    state = qwen3_5.commit_verified(params, cfg, kc, state, replay, slots, kept, counts > 0)
    fed_lanes = jnp.where(counts > 0, lanes, width)  # a row that fed nothing writes no lane's carry
    drafts = jnp.zeros((tokens.shape[0], t - 1), jnp.int32)
    if carry is not None:
        drafts, k_mtp, v_mtp, last = mtp.mtp_verify_rows(params, cfg, kc, hidden, tokens, emitted, kept, counts,
                                                         positions, page_tables, limits,
                                                         carry.at[lanes].get(mode="fill", fill_value=0),
                                                         *state.mtp_pages, rope_shift)
        state = state.with_mtp_pages(k_mtp, v_mtp)
        carry = carry.at[fed_lanes].set(last.astype(carry.dtype), mode="drop")
    rows_front = _verify_frontier(tokens, positions, counts, sampler, phase, left, emitted, kept, ends, drafts)
    out = (_rows_to_lanes(emitted, lanes, width).reshape(-1), _rows_to_lanes(kept, lanes, width),
           logits.reshape(-1, logits.shape[-1]), _rows_to_lanes(counts, lanes, width),
           _rows_to_lanes(rows_front, lanes, width))  # emitted: lane l's row t at l T + t
    if carry is None:
        return out, state
    return (*out, _rows_to_lanes(drafts, lanes, width)), state, carry


class VerifyOut(NamedTuple):
    """A verify round's outputs by lane, on the device: emitted tokens [C T] (lane l's row t at l T + t) with their
    chosen logprobs and top (None unless asked for), drafts kept [C], rows fed [C], the frontier a chained round
    continues, and with MTP the next round's drafts [C, T - 1]."""

    emitted: jax.Array
    chosen: jax.Array | None
    top: tuple | None
    kept: jax.Array
    fed: jax.Array
    frontier: jax.Array
    drafts: jax.Array | None


def _encode_step(vparams, vcfg, attention, media, table, patches, taps, tap_weights, pos, n_valid, rows):
    """One image (uint8 patches and the processor's normalisation table: `vision.pixels_from_bytes`) through the
    vision tower (`vision.padded_tower`), its tokens written to media rows `rows` ([bucket / merge^2]; an
    out-of-range row drops a padding token)."""
    pixels = vision.pixels_from_bytes(table, patches, vcfg.temporal_patch_size)
    out = vision.padded_tower(vparams, vcfg, pixels, taps, tap_weights, pos, n_valid, attention)
    return media.at[rows].set(out.astype(media.dtype), mode="drop")


def _logprobs_step(logits, tokens, rows, top_k_groups):
    """`token_logprobs` of a step's rows, indexed like `tokens` ([W]): row i of logits chose tokens[rows[i]];
    rows at W or past it are padding, dropped. Entries no row names are zero."""
    out = token_logprobs(logits, tokens.at[rows].get(mode="fill", fill_value=0), top_k_groups=top_k_groups)
    return jax.tree.map(lambda x: _rows_to_lanes(x, rows, tokens.shape[0]), out)


def jit_encode_step():
    """The image encode step jitted as the runner jits it (scripts/bench_vision.py times this form)."""
    return jax.jit(_own(_encode_step), static_argnames=("vcfg", "attention"), donate_argnames=("media",))


def jit_decode_step():
    """The decode step jitted as the runner jits it (the decode profiler builds variants of it the same way)."""
    return jax.jit(_own(_decode_step), static_argnames=("cfg", "kc", "full"), donate_argnames=("state",))


# The row's lane, its sampler columns, then the lane whose SamplerState row it uses (C: none, neutral); then the
# allowed-token mask's words.
PROCESS_COLUMNS = 2 + SAMPLER_COLUMNS


def _process_step(logits, sampler_state, extras, width):
    """Samples a step's rows again from their processed logits (`process_logits`) with the full sampler, and counts
    the tokens in the SamplerState. extras [R, PROCESS_COLUMNS + W] int32: each row's lane (C or past: padding),
    its sampler columns, its SamplerState lane, its allowed tokens. Returns (tokens by lane [width], or by row
    [R] when width is 0; the SamplerState)."""
    lanes, sampler = extras[:, 0], _sampler_from_columns([extras[:, 1 + i] for i in range(SAMPLER_COLUMNS)])
    state_lanes = extras[:, PROCESS_COLUMNS - 1]
    processed = process_logits(logits, sampler_state, state_lanes, sampler[4], extras[:, PROCESS_COLUMNS:])
    tokens = sample(processed, sampler, full=True)
    sampler_state = count_tokens(sampler_state, state_lanes, tokens)
    return (_rows_to_lanes(tokens, lanes, width) if width else tokens), sampler_state


# The cache's copies and transfers take and donate only the pools they write (the KV pools, or the GDN
# state pools): a jitted call's dispatch cost grows with the number of buffers it is handed.


def _copy_slot(ssm, conv, src, dst):
    """State slot src -> dst (a resume loading a snapshot into its lane): one D2D copy per GDN layer."""
    return tuple(s.at[dst].set(s[src]) for s in ssm), tuple(c.at[dst].set(c[src]) for c in conv)


def _copy_page(k_pages, v_pages, src, dst, length):
    """The first `length` positions of page src -> page dst (a tail copy-on-write), every plane of every attention
    layer (a quantized page's rows keep their bytes)."""
    keep = (jnp.arange(PAGE) < length)[:, None, None]

    def one(pages):
        return pages.at[dst].set(jnp.where(keep, pages[src], pages[dst]))

    return jax.tree.map(one, k_pages), jax.tree.map(one, v_pages)


def _own(fn):
    """A new function object wrapping fn: jax keys its compile cache on the function, so each runner
    wrapping its own copy gets compile counts of its own."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


# Backend compiles (or loads from jax's persistent cache) by (thread ident, jitted function's name), heard through
# jax.monitoring: what tells a compile on the engine's thread, which a request waits on, from one on the warm-up's.
_COMPILES: collections.Counter = collections.Counter()
_listening = threading.Lock()
_registered = False


def _heard(event: str, seconds: float, fun_name: str | None = None, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[threading.get_ident(), fun_name] += 1


def _listen_for_compiles() -> None:
    """Registers `_heard` once per process."""
    global _registered
    with _listening:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_heard)
            _registered = True


class _Stopped(Exception):
    """The engine stopped while `compile_rest` was lowering."""


def _shape_of(x):
    """An array's shape and dtype (a step lowers from it as from the array); anything else as it is."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type) if isinstance(x, jax.Array) else x


class ModelRunner:
    """Runs the model's jitted steps on the engine's preallocated DeviceState (the only mutator)."""

    def __init__(self, cfg: ModelConfig, params: Params, kernels: KernelConfig, *, num_pages: int,
                 num_slots: int, max_model_len: int, prefill_chunk: int, max_lanes: int, max_taps: int,
                 kv_dtype, conv_dtype, batch_invariant: bool = False, idle_prefill_chunk: int | None = None,
                 kv_profile: str = "auto", speculative_tokens: int = 0, stop_ids=(), mtp: bool = False,
                 mixed_tokens: int = 0, layout: ParallelLayout | None = None, prompt_logprobs: bool = True):
        """layout: the mesh the params and pools are laid out on (tensor parallel); None: the first device.
        prompt_logprobs: whether each pass size's `_scores_step` is compiled (and `prefill` takes score_targets)."""
        self.layout = layout
        self.prompt_logprobs = prompt_logprobs
        if layout is not None:
            params = layout.place_params(params, cfg)
            kernels = dataclasses.replace(kernels, spmd=layout.spmd)
        self.cfg, self.params, self.kernels = cfg, params, kernels
        self.max_pages = -(-max_model_len // PAGE)
        self.buckets = prefill_buckets(prefill_chunk)
        # Longer passes for a prompt no decode waits on, compiled for the greedy sampler only (the scheduler gives
        # them a prompt's last tokens only when its request samples greedily): two programs, not four.
        self.idle_sizes = idle_chunk_sizes(prefill_chunk, idle_prefill_chunk or prefill_chunk)
        self.max_lanes, self.max_taps = max_lanes, max_taps
        # A round runs its active lanes padded to the next size; batch_invariant: always all lanes.
        self.decode_sizes = (max_lanes,) if batch_invariant else pow2_buckets(max_lanes)
        # A pass of this many tokens rides in one step with a decode round (`mixed`), a program per round size and
        # sampler; 0: passes and rounds are separate steps.
        self.mixed_tokens = mixed_tokens
        self.mixed_sizes = self.decode_sizes if mixed_tokens else ()
        # Verify rounds (speculative decoding) feed k + 1 rows per lane, for up to SPECULATIVE_MAX_LANES lanes.
        self.verify_rows = speculative_tokens + 1 if speculative_tokens else 0
        self.verify_sizes = pow2_buckets(min(max_lanes, SPECULATIVE_MAX_LANES)) if speculative_tokens else ()
        stop_mask = np.zeros(cfg.vocab_size, bool)
        stop_mask[[i for i in stop_ids if 0 <= i < cfg.vocab_size]] = True
        self._stop_mask = jnp.asarray(stop_mask)
        # The logprobs' top-20 over the vocabulary: lax.top_k sorts on the GPU, a two-stage top-k does not.
        self.top_k_groups = TOP_K_GROUPS if jax.devices()[0].platform == "gpu" else 0
        # On a mesh of more devices than KV heads whose attention splits, the KV pools hold a copy of a KV head per
        # device; the Host keeps the canonical heads, so a slab and the cache file are the same at any size.
        self.kv_order = kv_order(kernels.spmd, params, cfg)
        kv_heads = None if self.kv_order is None else len(self.kv_order)

        def init():
            return init_device_state(cfg, num_pages, num_slots, kv_dtype, conv_dtype, kv_profile, mtp=mtp,
                                     kv_heads=kv_heads)

        if layout is None:
            self.state = init()
        else:  # zeros made in place on each device: a pool larger than one device never lands whole on one
            specs = layout.state_specs(jax.eval_shape(init), cfg)
            self.state = jax.jit(init, out_shardings=layout.shardings(specs))()
        # MTP drafting: each lane's last target hidden (the MTP row of a position needs it and the next token, which
        # the next step feeds), written by the prefill and verify steps; None without MTP.
        self.mtp_carry = jnp.zeros((max_lanes, cfg.hidden_size), params.embed.dtype) if mtp else None
        self.kv_profile = kv_profile
        self._recording = False  # the warm-up's recording pass: steps return shapes (`_swap`)
        self._layout_checked: set = set()
        # Penalty statistics and logit biases per lane, read and written only by the processing variants.
        self.sampler_state = SamplerState.empty(max_lanes, cfg.vocab_size)
        self._sampler_layout = [(a.shape, a.dtype) for a in jax.tree.leaves(self.sampler_state)]
        self.mask_words = mask_words(cfg.vocab_size)
        self._no_prev = jnp.zeros(max_lanes, jnp.int32)
        self._no_frontier = jnp.zeros((max_lanes, self.verify_rows + FRONTIER_COLUMNS), jnp.int32)
        if layout is not None:  # on the mesh from the start, as the steps return them: one program per step
            self.sampler_state, self._no_prev, self._no_frontier, self._stop_mask, self.mtp_carry = layout.replicate(
                (self.sampler_state, self._no_prev, self._no_frontier, self._stop_mask, self.mtp_carry))
        # Jitted per runner, so compile counts belong to this engine. jit sits exactly on the steps.
        self._prefill_rows = np.zeros(1, np.int32)  # a prefill's one row of logits is entry 0 of its tokens
        self._steps = {
            "prefill": jax.jit(_own(_prefill_step), static_argnames=("cfg", "kc", "full", "layout"),
                               donate_argnames=("state", "carry")),
            "process": jax.jit(_own(_process_step), static_argnames=("width",), donate_argnames=("sampler_state",)),
            "sampler_lane": jax.jit(_own(set_lane_row), donate_argnames=("state",)),
            "decode": jit_decode_step(),
            "mixed": jax.jit(_own(_mixed_step), static_argnames=("cfg", "kc", "full", "layout"),
                             donate_argnames=("state",)),
            "verify": jax.jit(_own(_verify_step), static_argnames=("cfg", "kc", "full", "layout"),
                              donate_argnames=("state", "carry")),
            "logprobs": jax.jit(_own(_logprobs_step), static_argnames=("top_k_groups",)),
            "scores": jax.jit(_own(_scores_step), static_argnames=("top_k_groups",)),
            "encode": jit_encode_step(),
            "copy_slot": jax.jit(_own(_copy_slot), donate_argnames=("ssm", "conv")),
            "copy_page": jax.jit(_own(_copy_page), donate_argnames=("k_pages", "v_pages")),
        }
        self.transfer_sizes: tuple[int, ...] = ()  # page batch buckets, set by enable_host_transfers
        _listen_for_compiles()
        self.image_rows = self.row_bytes = 0
        # The image encoder's output rows that prefill reads at image placeholders (enable_vision); one unused row
        # without a vision tower, so every prefill program has the same inputs.
        self.vision, self.patch_buckets = None, ()
        self.media = self._placed(jnp.zeros((1, cfg.hidden_size), params.embed.dtype))
        # The sizes the steps may use now: all of them, except while `compile_rest` compiles the rest (written by
        # `warmup` and `compile_rest` only, each time as a whole).
        self.ready = self.configured()

    def configured(self) -> StepSizes:
        """Every size the steps are configured for."""
        return StepSizes(self.buckets, self.idle_sizes, self.decode_sizes, self.mixed_sizes, self.verify_sizes,
                         self.patch_buckets)

    @property
    def compiling(self) -> bool:
        """Whether some configured size is not ready yet (`compile_rest` has not ended)."""
        return self.ready != self.configured()

    def _sampler(self, full: bool) -> bool:
        """The `full` static of a step: the full sampler where asked, or where the greedy programs are not ready."""
        return full or not self.ready.greedy

    def _placed(self, x):
        """x replicated over the mesh (tensor parallel), else as it is."""
        return x if self.layout is None else self.layout.replicate(x)

    def enable_vision(self, vparams, vcfg, media_rows: int, patches: tuple[int, int]) -> None:
        """Adds the vision tower: a buffer of `media_rows` encoder output rows and an encode program per patch
        bucket over `patches` (the fewest and most of one image). Call before `warmup()`."""
        self.vision = (vparams, vcfg)
        self.patch_buckets = vision.patch_buckets(vcfg, patches[1], min_patches=patches[0])
        # Flash attention where cuDNN runs it (a GPU, bf16): XLA's materialises [heads, bucket, bucket] logits
        gpu_bf16 = jax.devices()[0].platform == "gpu" and vparams.patch_w.dtype == jnp.bfloat16
        self.vision_attention = "cudnn" if gpu_bf16 else "xla"
        self.media = self._placed(jnp.zeros((media_rows, self.cfg.hidden_size), self.params.embed.dtype))
        self.ready = self.configured()

    def encode_image(self, patches: np.ndarray, table: np.ndarray, grid, rows: np.ndarray) -> None:
        """Encodes one image (uint8 patches [t h w, 3, P, P], the normalisation table [3, 256], its grid) into media
        rows `rows` (one per token), dispatched, not waited for: the prefill that reads them follows it."""
        vparams, vcfg = self.vision
        n = len(patches)
        bucket = fit(n, self.ready.patches, "an image of {} patches")
        padded = np.zeros((bucket, *patches.shape[1:]), np.uint8)
        padded[:n] = patches
        metadata = vision.padded_metadata(vcfg, tuple(int(v) for v in grid), bucket)
        out_rows = np.full(bucket // vcfg.spatial_merge_size**2, self.media.shape[0], np.int32)
        out_rows[:len(rows)] = rows
        self._swap_media(self._steps["encode"](vparams, vcfg, self.vision_attention, self.media,
                                               np.asarray(table, np.float32), padded, *metadata, out_rows))

    def _swap_media(self, media) -> None:
        """The one place the media rows are written back."""
        assert media.shape == self.media.shape and media.dtype == self.media.dtype
        if not self._recording:  # as `_swap`
            self.media = media

    def enable_host_transfers(self, row_bytes: int, image_rows: int, max_batch: int = 64) -> None:
        """Adds the Host tier's transfer ops: page batches of rows of `row_bytes` (one slab each, at least one
        page bundle), and state images of `image_rows` such rows. Call before `warmup()`."""
        if row_bytes % WORD_BYTES:
            raise ValueError(f"transfer rows of {row_bytes} B are not a whole number of {WORD_BYTES}-byte words")
        self.row_bytes, self.image_rows = row_bytes, image_rows
        self.transfer_sizes = pow2_buckets(max(1, min(max_batch, self.state.num_pages)))
        device = jax.devices()[0]
        kinds = {m.kind for m in device.addressable_memories()}
        # The gathers' output lands in pinned host memory where the backend has it (DESIGN.md "Host tier"); from a
        # mesh, every shard's bytes of a row gathered (one slab holds them all).
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host") if self.layout is None \
            else self.layout.sharding(jax.sharding.PartitionSpec(), "pinned_host")
        host = {"out_shardings": pinned} if "pinned_host" in kinds else {}
        # On a mesh whose GDN mixers split, the conv pool's channels are in the devices' order; the Host keeps the
        # canonical one, so a slab and the cache file are the same at any size.
        order = conv_order(self.kernels.spmd, self.params, self.cfg)  # a constant of the programs, not an argument

        def gather_pages(k_pages, v_pages, pages):
            return transfer.gather_pages(k_pages, v_pages, pages, kv_order=self.kv_order)

        def scatter_pages(k_pages, v_pages, pages, rows):
            return transfer.scatter_pages(k_pages, v_pages, pages, rows, kv_order=self.kv_order)

        def gather_slot(ssm, conv, slot):
            return transfer.gather_slot(ssm, conv, slot, rows=image_rows, row_words=row_bytes // WORD_BYTES,
                                        conv_order=order)

        def scatter_slot(ssm_pools, conv_pools, slot, rows):
            return transfer.scatter_slot(ssm_pools, conv_pools, slot, rows, conv_order=order)

        self._steps.update({
            "gather_pages": jax.jit(gather_pages, **host),
            "scatter_pages": jax.jit(scatter_pages, donate_argnames=("k_pages", "v_pages")),
            "gather_slot": jax.jit(gather_slot, **host),
            "scatter_slot": jax.jit(scatter_slot, donate_argnames=("ssm_pools", "conv_pools")),
        })

    # --- the one place the donated state is written back ----------------------------------------
    def _swap(self, new_state: DeviceState, program=None) -> None:
        """Takes a step's returned state. `program` names a compiled program of the hot steps (prefill, decode),
        whose outputs keep one layout from call to call: its layout is checked on its first call only (walking
        every pool on every round costs host time the round does not have). A layout includes the pools'
        shardings. A recorded warm-up call returns shapes only (`compiling.AheadOfTime`): the pools stay, so the
        calls after it lower with their shardings, as the replay does (the sampler state, MTP carry and media rows
        likewise)."""
        if program is None or program not in self._layout_checked:
            assert self._same_layout(new_state), "a step changed the DeviceState layout"
            self._layout_checked.add(program)
        if not self._recording:
            self.state = new_state

    def _same_layout(self, new_state: DeviceState) -> bool:
        """new_state's pools have the shapes and dtypes of the state's, and on a mesh their shardings."""
        old, new = jax.tree.leaves(self.state), jax.tree.leaves(new_state)
        if [(a.shape, a.dtype) for a in old] != [(a.shape, a.dtype) for a in new]:
            return False
        return self.layout is None or self._recording or all(
            a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(old, new))

    def _swap_sampler(self, new_state: SamplerState) -> None:
        """The one place the SamplerState is written back."""
        layout = [(a.shape, a.dtype) for a in jax.tree.leaves(new_state)]
        assert layout == self._sampler_layout, "a step changed the SamplerState layout"
        if not self._recording:  # as `_swap`
            self.sampler_state = new_state

    def bucket(self, n: int) -> int:
        """The compiled prefill length for a chunk of n tokens."""
        ready = self.ready
        return fit(n, ready.prefill + ready.idle, "prefill chunk of {} tokens")

    # --- steps -----------------------------------------------------------------------------------
    def prefill(self, tokens: np.ndarray, base: int, page_table: np.ndarray, slot: int, sampler,
                tap_positions=None, tap_slots=None, *, full: bool = False, logprobs: bool = False,
                lane: int | None = None, allowed: np.ndarray | None = None, resumed: bool = False,
                rope_positions=None, media_rows=None, score_targets: np.ndarray | None = None):
        """Prefill len(tokens) <= largest bucket tokens of one lane; returns (next token [1], chosen logprob [1],
        (top ids [1, 20], top logprobs [1, 20]), scores), the middle two None unless `logprobs`, scores None unless
        `score_targets` (int32 [len(tokens)]: each token's next one) asks for `_scores_step`'s (on the device).

        page_table is the lane's [max_pages] row; tap_positions/tap_slots (<= max_taps each) name the
        64-aligned positions whose state is also written to snapshot slots (in-kernel taps). With `allowed` (the
        lane's packed allowed tokens, int32 [mask_words]; all bits set for none), the token is sampled from the
        logits processed with lane `lane`'s SamplerState row, which counts it. With MTP, `lane` holds the lane's
        carry and `resumed` marks its first pass after a cache hit (`mtp.mtp_prefill_rows`). rope_positions [3, n]
        and media_rows [n]: a prompt with images (`pack_prefill_inputs`).
        """
        size = self.bucket(len(tokens))
        packed, extras = self._pass_inputs(size, tokens, base, page_table, slot, sampler, tap_positions, tap_slots,
                                           lane, allowed, resumed, rope_positions, media_rows)
        targets = None
        if score_targets is not None:
            if not self.prompt_logprobs:
                raise ValueError("prompt logprobs are off in this runner: their programs were not compiled")
            targets = np.zeros(size, np.int32)
            targets[:len(score_targets)] = score_targets
        return self._prefill_packed(packed, size, full, logprobs, extras, targets)

    def _pass_inputs(self, size: int, tokens, base, page_table, slot, sampler, tap_positions=None, tap_slots=None,
                     lane=None, allowed=None, resumed=False, rope_positions=None, media_rows=None):
        """`prefill`'s arguments -> (the packed inputs at `size` tokens, the processing row or None)."""
        no_taps = tap_positions is None
        packed = pack_prefill_inputs(tokens, size, base, slot, sampler, () if no_taps else tap_positions,
                                     () if no_taps else tap_slots, page_table, self.max_taps, lane or 0, resumed,
                                     rope_positions, media_rows)
        extras = None
        if allowed is not None:
            extras = np.concatenate([[lane], *(c[:1] for c in _sampler_columns(sampler)), [lane], allowed])
            extras = extras.astype(np.int32)
        return packed, extras

    # The packed arrays go to the steps as numpy: jit's own transfer of them is cheaper than an eager
    # jnp.asarray (docs/kernels_notes.md, the decode round's host side). Each is new and never written again, so
    # the step may read it later (on CPU jax can alias a numpy buffer).
    def _prefill_packed(self, packed: np.ndarray, size: int, full: bool, logprobs: bool, extras=None, targets=None):
        """extras: the processing row [PROCESS_COLUMNS + W] of `_process_step`, or None; targets: int32 [size], the
        tokens `_scores_step` scores the pass's rows on, or None."""
        full = self._sampler(full and extras is None)  # the step's own token is replaced: its cheapest will do
        (tokens, logits), state, *carry, hidden = self._steps["prefill"](self.params, self.cfg, self.kernels, full,
                                                                         (size, self.max_taps), self.state, packed,
                                                                         self.media, self.mtp_carry)
        self._swap(state, ("prefill", size, full))
        if carry and not self._recording:  # as `_swap`
            self.mtp_carry = carry[0]
        scores = None
        if targets is not None:
            scores = self._steps["scores"](self.params, hidden, self._placed(jnp.asarray(targets)), self.top_k_groups)
            for x in scores:
                x.copy_to_host_async()
        return (*self._pass_outputs((tokens, logits), logprobs, extras), scores)

    def _pass_outputs(self, out, logprobs: bool, extras):
        """A pass's (token, logits) -> `prefill`'s outputs: sampled again from processed logits with `extras`."""
        tokens, logits = out
        if extras is not None:
            tokens = self._process(logits, extras[None], 0)
        return self._with_logprobs(tokens, logits, self._prefill_rows, logprobs)

    def _process(self, logits, extras: np.ndarray, width: int):
        """A step's tokens sampled again from its processed logits (`_process_step`)."""
        tokens, sampler_state = self._steps["process"](logits, self.sampler_state, extras, width)
        self._swap_sampler(sampler_state)
        return tokens

    def _with_logprobs(self, tokens, logits, rows: np.ndarray, logprobs: bool):
        """(tokens, chosen, top) of a step: the logprobs' program (a log-softmax and a top-20 over the vocabulary
        per row) dispatched behind it only when asked for."""
        out = (tokens, None, None) if not logprobs else \
            (tokens, *self._steps["logprobs"](logits, tokens, rows, self.top_k_groups))
        # The scheduler reads these back a round later: each copy starts as soon as its program ends, so the read
        # finds it landed instead of waiting for one synchronous transfer per array.
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        return out

    def decode_size(self, lanes: int) -> int:
        """The compiled round size for `lanes` active lanes."""
        return fit(lanes, self.ready.decode, "decode round of {} lanes")

    def decode(self, tokens, positions, page_tables, slots, active, sampler, *, full=False, prev_tokens=None,
               use_prev=None, logprobs=False, allowed=None, processed=None, rope_shift=None):
        """One decode round over the active lanes ([C] host arrays, `sampler` the SamplerInputs arrays;
        inactive lanes untouched), run as a batch of the next compiled size: one active lane computes one row,
        not C (at 35B-A3B every padding row also routed to experts whose weights the round then read). A lane
        with use_prev set feeds prev_tokens[lane] (the previous round's token output, still on the device)
        instead of tokens[lane], so a round can be dispatched before the previous one is read back. With `allowed`
        (int32 [C, mask_words], each lane's packed allowed tokens, all bits set for none) and `processed` (bool [C]:
        the lanes whose SamplerState rows apply, the rest sampled as without), the round samples from processed
        logits (`process_logits`). rope_shift [C]: each lane's prompt's MRoPE delta (None: zeros). Returns (tokens,
        chosen logprobs, top) indexed by lane, the last two None unless `logprobs`."""
        packed, extras, prev_tokens = self._round_inputs(tokens, positions, page_tables, slots, active, sampler,
                                                         prev_tokens, use_prev, allowed, processed, rope_shift)
        return self._decode_packed(packed, full, prev_tokens, logprobs, extras)

    def _round_inputs(self, tokens, positions, page_tables, slots, active, sampler, prev_tokens=None, use_prev=None,
                      allowed=None, processed=None, rope_shift=None):
        """`decode`'s arguments -> (the packed rows, the processing rows or None, the previous round's tokens)."""
        if prev_tokens is None:
            prev_tokens, use_prev = self._no_prev, np.zeros(self.max_lanes, bool)
        lanes = np.flatnonzero(active)
        packed = pack_decode_inputs(lanes, self.decode_size(len(lanes)), tokens, positions, page_tables, slots,
                                    use_prev, sampler, rope_shift)
        extras = None if allowed is None else self._decode_extras(packed, allowed, processed)
        return packed, extras, prev_tokens

    def _decode_extras(self, packed: np.ndarray, allowed, processed) -> np.ndarray:
        """`_process_step`'s rows [R, PROCESS_COLUMNS + mask_words] of a round: each row's lane and sampler columns
        (packed's columns from 5), its SamplerState lane (C unless `processed`), its allowed tokens (all, for padding
        rows)."""
        rows = packed[:, 5]  # each row's lane, C for padding
        c = self.max_lanes
        extras = np.full((len(rows), PROCESS_COLUMNS + self.mask_words), -1, np.int32)
        extras[:, :PROCESS_COLUMNS - 1] = packed[:, 5:6 + SAMPLER_COLUMNS]  # the lane and its sampler columns
        real = rows < c
        extras[:, PROCESS_COLUMNS - 1] = c
        extras[real, PROCESS_COLUMNS - 1] = np.where(np.asarray(processed, bool)[rows[real]], rows[real], c)
        extras[real, PROCESS_COLUMNS:] = np.asarray(allowed, np.int32)[rows[real]]
        return extras

    def _decode_packed(self, packed: np.ndarray, full: bool, prev_tokens, logprobs: bool, extras=None):
        full = self._sampler(full and extras is None)  # the step's own tokens are replaced: its cheapest will do
        out, state = self._steps["decode"](self.params, self.cfg, self.kernels, full, self.state, packed, prev_tokens)
        self._swap(state, ("decode", packed.shape[0], full))
        return self._round_outputs(out, packed, logprobs, extras)

    def _round_outputs(self, out, packed: np.ndarray, logprobs: bool, extras):
        tokens, logits = out
        if extras is not None:
            tokens = self._process(logits, extras, self.max_lanes)
        return self._with_logprobs(tokens, logits, packed[:, 5], logprobs)  # column 5: each row's lane

    def mixed(self, chunk: dict, decode_round: dict):
        """One lane's prefill pass of at most `mixed_tokens` tokens (`prefill`'s keyword arguments, no MTP) and a
        decode round over other lanes (`decode`'s) as one step (`qwen3_5.mixed`): the round's weight reads carry
        the pass. Returns (the pass's outputs as `prefill` returns them, the round's as `decode` does)."""
        chunk, decode_round = dict(chunk), dict(decode_round)
        p_full, p_logprobs = chunk.pop("full", False), chunk.pop("logprobs", False)
        r_full, r_logprobs = decode_round.pop("full", False), decode_round.pop("logprobs", False)
        packed, p_extras = self._pass_inputs(self.mixed_tokens, **chunk)
        r_packed, r_extras, prev_tokens = self._round_inputs(**decode_round)
        full = (p_full and p_extras is None) or (r_full and r_extras is None)
        return self._mixed_packed(packed, r_packed, full, prev_tokens, p_extras, r_extras, p_logprobs, r_logprobs)

    def _mixed_packed(self, packed, r_packed, full: bool, prev_tokens, p_extras=None, r_extras=None,
                      p_logprobs=False, r_logprobs=False):
        full = self._sampler(full)
        (chunk, rnd), state = self._steps["mixed"](self.params, self.cfg, self.kernels, full,
                                                   (self.mixed_tokens, self.max_taps), self.state, packed, self.media,
                                                   r_packed, prev_tokens)
        self._swap(state, ("mixed", r_packed.shape[0], full))
        return self._pass_outputs(chunk, p_logprobs, p_extras), self._round_outputs(rnd, r_packed, r_logprobs, r_extras)

    def verify_size(self, lanes: int) -> int:
        """The compiled verify round size for `lanes` speculating lanes."""
        return fit(lanes, self.ready.verify, "verify round of {} lanes")

    def verify(self, tokens, positions, counts, stops, page_tables, slots, sampler, *, full=False, logprobs=False,
               limits=None, rope_shift=None, chained=None, left=None, phase=None, lane_stops=None, frontier=None):
        """One verify round: lane l feeds tokens[l, :counts[l]] ([C, T]; T = verify_rows is the compiled width;
        count 0: not in the round) from positions[l]; `stops` [C]: the engine's stop tokens end the lane; limits
        [C]: the positions it may feed below; left [C]: the tokens it may still emit; phase [C]: LIVE, or CLOSING
        for a lane feeding its stop token; lane_stops [C, LANE_STOPS]: each request's own stop ids. A `chained`
        lane ([C] bool; counts > 0 marks it in the round) continues `frontier`, a previous round's, on the device:
        it need not be read first. Keeps each lane's accepted drafts (`speculative.accept_drafts`). Returns a
        `VerifyOut` on the device, copying kept and fed to the host. rope_shift [C]: as `decode`'s."""
        lanes = np.flatnonzero(np.asarray(counts) > 0)
        packed = pack_verify_inputs(lanes, self.verify_size(len(lanes)), tokens, positions, counts, stops,
                                    page_tables, slots, sampler, limits, rope_shift, chained, left, phase,
                                    lane_stops)
        return self._verify_packed(packed, full, np.shape(tokens)[1], logprobs,
                                   self._no_frontier if frontier is None else frontier)

    def _verify_packed(self, packed: np.ndarray, full: bool, rows: int, logprobs: bool, frontier):
        layout, full = (rows, self.max_lanes), self._sampler(full)
        out, state, *carry = self._steps["verify"](self.params, self.cfg, self.kernels, full, layout, self.state,
                                                   packed, self._stop_mask, frontier, self.mtp_carry)
        self._swap(state, ("verify", packed.shape[0], full))
        emitted, kept, logits, fed, frontier, *drafts = out
        if carry and not self._recording:  # as `_swap`
            self.mtp_carry = carry[0]
        # row r's t-th logits chose emitted[lane r, t]: index l T + t of the flattened tokens (padding: past them)
        places = (packed[:, rows + 4][:, None] * rows + np.arange(rows)).reshape(-1).astype(np.int32)
        for x in (kept, fed, *drafts):
            x.copy_to_host_async()
        emitted, chosen, top = self._with_logprobs(emitted, logits, places, logprobs)
        return VerifyOut(emitted, chosen, top, kept, fed, frontier, drafts[0] if drafts else None)

    def set_sampler_lane(self, lane: int, row: np.ndarray) -> None:
        """Writes a lane's SamplerState row (`sampling.lane_row`) and zeroes its output counts: at admission of a
        request that processes its logits."""
        self._swap_sampler(self._steps["sampler_lane"](self.sampler_state, np.int32(lane), row))

    def _swap_kv(self, kv) -> None:
        self._swap(DeviceState(*kv, self.state.ssm, self.state.conv))

    def _swap_gdn(self, gdn) -> None:
        self._swap(DeviceState(self.state.k_pages, self.state.v_pages, *gdn))

    # Scalars and id lists go to the small steps as numpy: an eager jnp.int32(x) is a dispatch of its own, host
    # time the scheduler pays on every restore (docs/benchmarks/prefix_cache.md).
    def copy_slot(self, src: int, dst: int) -> None:
        s = self.state
        self._swap_gdn(self._steps["copy_slot"](s.ssm, s.conv, np.int32(src), np.int32(dst)))

    def copy_page(self, src: int, dst: int, length: int) -> None:
        s = self.state
        self._swap_kv(self._steps["copy_page"](s.k_pages, s.v_pages, np.int32(src), np.int32(dst),
                                               np.int32(length)))

    # --- Host tier transfers (enable_host_transfers) ---------------------------------------------
    def gather_pages(self, pages: np.ndarray) -> jax.Array:
        """Page bundles of `pages` (int32 [B], B a transfer size) -> uint32 [B, bundle words], dispatched (not
        waited for) and landing in pinned host memory where the backend has it; np.asarray waits for it."""
        return self._steps["gather_pages"](self.state.k_pages, self.state.v_pages, np.asarray(pages, np.int32))

    def scatter_pages(self, pages, rows: np.ndarray) -> None:
        """Host rows uint32 [B, row_bytes / 4] into `pages` (int32 [B], B a transfer size, numpy or on the
        device); an out-of-range page id drops its row."""
        s = self.state
        self._swap_kv(self._steps["scatter_pages"](s.k_pages, s.v_pages, jnp.asarray(pages), jnp.asarray(rows)))

    def gather_slot(self, slot: int) -> jax.Array:
        """State slot `slot` -> uint32 [image_rows, row_bytes / 4], dispatched like gather_pages."""
        return self._steps["gather_slot"](self.state.ssm, self.state.conv, np.int32(slot))

    def scatter_slot(self, slot, rows: np.ndarray) -> None:
        """Host rows uint32 [image_rows, row_bytes / 4] into state slot `slot` (an int or an int32 device
        scalar)."""
        s = self.state
        self._swap_gdn(self._steps["scatter_slot"](s.ssm, s.conv, jnp.asarray(slot, jnp.int32), jnp.asarray(rows)))

    # --- compilation -----------------------------------------------------------------------------
    def warmup(self, progress=None, threads: int = 1, first: bool = False) -> float:
        """Compiles every step variant on `threads` threads, then runs each once with side-effect-free inputs
        (`compiling.AheadOfTime`: the warm-up's calls are recorded, compiled together, then replayed); returns
        seconds spent. `progress(stage, done, total)` hears of each program as it is ready. first: only the sizes
        that serve every request (`StepSizes.first`), which `ready` then holds; `compile_rest` does the rest."""
        start = time.perf_counter()
        steps = self._steps
        sizes = self.configured().first() if first else self.configured()
        with AheadOfTime(threads) as ahead:
            # The recording pass swaps shapes into the runner's state: it gets its arrays back afterwards.
            kept = {**vars(self), "_layout_checked": set(self._layout_checked)}
            whats: list[str] = []
            self._steps = {name: ahead.lowering(name, fn) for name, fn in steps.items()}
            self._recording = True
            try:
                self._warmup_calls(lambda out, what: whats.append(what), sizes)
            finally:
                vars(self).update(kept)
            log.info("compiling | %d programs lowered in %.1f s (%s) | compiling on %d threads", ahead.programs,
                     ahead.lowering_s, ahead.slowest(), threads)
            done = 0

            def ready(out, what: str) -> None:
                nonlocal done
                jax.block_until_ready(out)  # so each line times the program's compile and first run, not its dispatch
                done += 1
                log.info("compiling | %s | %d/%d | %.1f s", what, done, len(whats), time.perf_counter() - start)
                if progress is not None:
                    progress("compiling", done, len(whats))

            self._steps = {name: ahead.waiting(name, fn) for name, fn in steps.items()}
            try:
                self._warmup_calls(ready, sizes)
            finally:
                self._steps = steps
            ahead.check_replayed()
        self.ready = sizes
        return time.perf_counter() - start

    def compile_rest(self, threads: int = 1, progress=None, stopping=lambda: False) -> float:
        """Compiles on `threads` threads the programs that `warmup(first=True)` left out, then lets the steps use
        every size (`ready`); returns seconds spent. Runs on a thread of its own while the engine serves: the calls
        are lowered on a copy of the runner whose arrays are shapes (the engine's may be donated meanwhile) and
        compiled, never run, so it writes nothing the steps read but `ready`. jax keeps each executable with its
        lowering, which the jitted step's own call finds. Ends early, sizes unchanged, once `stopping()`."""
        start = time.perf_counter()
        shadow = copy.copy(self)
        for name, value in vars(self).items():
            if name != "_steps":
                setattr(shadow, name, jax.tree.map(_shape_of, value))
        shadow._recording, shadow._layout_checked = True, set(self._layout_checked)
        shadow.ready = self.configured()  # its calls take the sampler asked for (`_sampler`), as the steps will
        marks: list[tuple[str, int]] = []  # each program's name for the log, and the calls recorded up to it

        def recorded(out, what: str) -> None:
            if stopping():
                raise _Stopped
            marks.append((what, ahead.recorded))

        with AheadOfTime(threads) as ahead:
            shadow._steps = {name: ahead.lowering(name, fn) for name, fn in self._steps.items()}
            try:
                shadow._warmup_calls(recorded, self.configured(), done=self.ready)
            except _Stopped:
                return time.perf_counter() - start
            log.info("compiling in the background | %d programs lowered in %.1f s (%s) | compiling on %d threads",
                     ahead.programs, ahead.lowering_s, ahead.slowest(), threads)
            for done, (what, calls) in enumerate(marks, 1):
                if stopping():
                    return time.perf_counter() - start
                ahead.wait_compiled(calls)
                log.info("compiling in the background | %s | %d/%d | %.1f s", what, done, len(marks),
                         time.perf_counter() - start)
                if progress is not None:
                    progress("compiling in the background", done, len(marks))
        self.ready = self.configured()
        return time.perf_counter() - start

    def _warmup_calls(self, ready, sizes: StepSizes, done: StepSizes | None = None) -> None:
        """Calls every step variant of `sizes` once with side-effect-free inputs, `ready(outputs, what)` after each
        program, skipping the programs `done` holds (compiled already). `warmup` plays it twice, first on the steps'
        output shapes only: it must not read an output's values, and it must make the same calls both times."""
        from ninfer_jax.runtime.sampling import SamplerInputs

        def new(kind: str, size: int, full: bool = True) -> bool:
            return done is None or not done.has(kind, size, full)

        table = np.zeros(self.max_pages, np.int32)
        one = SamplerInputs.empty(1).arrays()
        lanes = SamplerInputs.empty(self.max_lanes).arrays()
        c = self.max_lanes
        for full in (False, True) if sizes.greedy else (True,):
            sampler = f"sampler={'full' if full else 'greedy'}"
            for size in sizes.prefill + (() if full else sizes.idle):
                if not new("idle" if size in sizes.idle else "prefill", size, full):
                    continue
                # n_valid = 0 at a non-zero base: no KV write, identity GDN tokens, history unchanged. The pass's
                # prompt logprobs too (one program a size for both samplers).
                packed = pack_prefill_inputs((), size, PAGE, 0, one, (), (), table, self.max_taps)
                targets = np.zeros(size, np.int32) if self.prompt_logprobs else None
                ready(self._prefill_packed(packed, size, full, logprobs=True, targets=targets),
                      f"prefill {size} tokens {sampler}")
            for size in (s for s in sizes.decode if new("decode", s, full)):  # padding rows only: nothing written
                packed = pack_decode_inputs((), size, np.zeros(c), np.zeros(c), table[None].repeat(c, 0),
                                            np.zeros(c), np.zeros(c), lanes)
                ready(self._decode_packed(packed, full, self._no_prev, logprobs=True), f"decode {size} lanes {sampler}")
            for size in (s for s in sizes.mixed if new("mixed", s, full)):
                # a pass with no valid token and a round of padding rows: nothing written
                chunk = pack_prefill_inputs((), self.mixed_tokens, PAGE, 0, one, (), (), table, self.max_taps)
                packed = pack_decode_inputs((), size, np.zeros(c), np.zeros(c), table[None].repeat(c, 0),
                                            np.zeros(c), np.zeros(c), lanes)
                ready(self._mixed_packed(chunk, packed, full, self._no_prev),
                      f"mixed {self.mixed_tokens} tokens + {size} lanes {sampler}")
            for size in (s for s in sizes.verify if new("verify", s, full)):  # padding rows only: nothing written
                c_t = (c, self.verify_rows)
                packed = pack_verify_inputs((), size, np.zeros(c_t), np.zeros(c), np.zeros(c), np.zeros(c),
                                            table[None].repeat(c, 0), np.arange(c), lanes)
                ready(self._verify_packed(packed, full, self.verify_rows, True, self._no_frontier),
                      f"verify {size} lanes x {self.verify_rows} rows {sampler}")
        if self.vision is not None:  # images of each bucket's patches, every output row dropped
            vcfg = self.vision[1]
            for bucket in (b for b in sizes.patches if new("patches", b)):
                m = vcfg.spatial_merge_size
                patches = np.zeros((bucket, 3, vcfg.patch_size, vcfg.patch_size), np.uint8)
                self.encode_image(patches, np.zeros((3, 256), np.float32), (1, m, bucket // m), np.zeros(0))
                ready(self.media, f"vision encoder {bucket} patches")
        # Rows of lane C (past every lane): the SamplerState's row write and token counts are dropped.
        self.set_sampler_lane(c, np.zeros(2 * self.mask_words + 2 * MAX_LOGIT_BIAS + 4, np.int32))
        row = np.concatenate([[c], np.zeros(SAMPLER_COLUMNS), [c], np.full(self.mask_words, -1)]).astype(np.int32)
        for size, width in [(1, 0)] * (done is None) + [(size, c) for size in sizes.decode if new("decode", size)]:
            logits = jnp.zeros((size, self.cfg.vocab_size), jnp.float32)
            ready(self._process(logits, row[None].repeat(size, 0), width), f"logit processing {size} rows")
        if sizes.copies and (done is None or not done.copies):
            self._copy_calls(ready)

    def warmup_copies(self) -> float:
        """Compiles the cache's slot and page copies and the Host transfers (small programs; the engine
        compiles them here when it skips the model steps' warmup); returns seconds spent."""
        start = time.perf_counter()
        self._copy_calls(lambda out, what: log.info("compiling | %s | %.1f s", what, time.perf_counter() - start))
        jax.block_until_ready(self.state)
        return time.perf_counter() - start

    def _copy_calls(self, ready) -> None:
        """Calls the slot and page copies and the Host transfers once, changing nothing."""
        # Slot and page copies with src == dst (and length 0) change nothing.
        self.copy_slot(0, 0)
        self.copy_page(0, 0, 0)
        ready(self.state, "slot and page copies")
        if self.transfer_sizes:  # reads, and scatters whose every row is dropped (out-of-range ids)
            gathered = []
            for size in self.transfer_sizes:
                gathered.append(self.gather_pages(np.zeros(size, np.int32)))
                self.scatter_pages(np.full(size, self.state.num_pages, np.int32),
                                   np.zeros((size, self.row_bytes // WORD_BYTES), np.uint32))
            gathered.append(self.gather_slot(0))
            self.scatter_slot(self.state.num_slots,
                              np.zeros((self.image_rows, self.row_bytes // WORD_BYTES), np.uint32))
            ready((gathered, self.state), f"host transfers, page batches {self.transfer_sizes}")

    def kv_stats(self) -> dict:
        """The KV pools' storage: `dtype` (the profile, or a plain pool's dtype for "auto"), `bytes_per_token`
        (every attention layer, K + V with their scales, from the pools' own arrays, each KV head counted once
        where devices hold copies of it) and `capacity_tokens`."""
        pools = self.state.k_pages + self.state.v_pages
        tokens = self.state.num_pages * PAGE
        copies = 1 if self.kv_order is None else len(self.kv_order) // self.cfg.num_key_value_heads
        name = self.kv_profile if self.kv_profile != "auto" else jnp.dtype(pools[0].dtype).name if pools else "none"
        stored = sum(a.nbytes for a in jax.tree.leaves(pools)) // copies
        return {"dtype": name, "bytes_per_token": stored // max(1, tokens), "capacity_tokens": tokens}

    def parallel_stats(self) -> dict:
        """The mesh the model runs on: its size, whether experts are split across it, its devices."""
        if self.layout is not None:
            return self.layout.stats()
        return {"tensor_parallel_size": 1, "expert_parallel": False, "devices": [str(jax.devices()[0])]}

    def compile_counts(self) -> dict[str, int]:
        """Compiled programs per jitted step (grows only when a new shape or static value appears)."""
        return {name: f._cache_size() for name, f in self._steps.items()}

    def compile_count(self) -> int:
        return sum(self.compile_counts().values())

    def compiles_on(self, thread_ident: int) -> int:
        """Compiles of this runner's steps (of any runner's with the same step functions) on one thread so far."""
        names = {f"jit({fn.__name__})" for fn in self._steps.values()}
        return sum(n for key, n in list(_COMPILES.items()) if key[0] == thread_ident and key[1] in names)
