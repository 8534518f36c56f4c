"""The runner's steps as pure functions, and the packed host inputs they read.

Each step takes the params, the static model and kernel configs, the DeviceState it donates and one int32 array of
host inputs (`pack_prefill_inputs`, `pack_decode_inputs`, `pack_verify_inputs`), and returns its outputs with the
new state. `runner.ModelRunner` jits them (`own_copy`), owns the state and swaps each step's result back.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.model import mtp, qwen3_5, vision
from ninfer_jax.model.state import PAGE
from ninfer_jax.runtime.sampling import count_tokens, process_logits, sample, token_logprobs
from ninfer_jax.runtime.speculative import accept_drafts

# A step's host inputs travel packed into one int32 array (floats bit-cast): one host-to-device copy per step
# instead of a dozen. Each copy costs host time and a trip through the GIL, and a decode round computes for
# only a few milliseconds.


SAMPLER_COLUMNS = 6  # the SamplerInputs arrays; the fifth (index 4) is the step


def sampler_columns(sampler) -> list[np.ndarray]:
    """The SamplerInputs arrays ([B] each) as int32 columns."""
    temperature, top_k, top_p, seed, step, min_p = sampler
    return [np.asarray(temperature, np.float32).view(np.int32), np.asarray(top_k, np.int32),
            np.asarray(top_p, np.float32).view(np.int32), np.asarray(seed, np.uint32).view(np.int32),
            np.asarray(step, np.int32), np.asarray(min_p, np.float32).view(np.int32)]


def _sampler_from_columns(col):
    """The inverse of sampler_columns, inside a step."""
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
    packed[PREFILL_ROWS * size:at] = [n, base, slot, *(c[0] for c in sampler_columns(sampler)), lane, resumed]
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


def prefill_step(params, cfg, kc, full, layout, state, packed, media, carry=None):
    """One prefill chunk of one lane -> ((its next token [1], the last row's logits [1, V]), state, with MTP (carry:
    the lanes' last target hidden [C, H]) the new carry, and the chunk's final-normed hidden rows [T, H] (for
    `scores_step`; dropped unless asked for: the buffer exists at the step's end anyway). MTP also writes the
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


# Rows of a pass scored at a time (`scores_step`): their float32 logits are SCORE_ROWS x vocabulary (254 MB at 256
# rows of Qwen3.5's 248k), where a 32k-token pass's at once would be 32 GB.
SCORE_ROWS = 256


def scores_step(params, hidden, targets, top_k_groups):
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
    columns = lane_columns + sampler_columns(sampler) + [np.zeros(c, np.int32) if rope_shift is None
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


def mixed_step(params, cfg, kc, full, layout, state, packed, media, round_packed, prev_tokens):
    """One lane's prefill chunk and a decode round over other lanes in one pass (`qwen3_5.mixed`) -> (the chunk's
    (next token [1], logits [1, V]), the round's (tokens by lane [C], logits by row [rows, V])), state). The inputs
    are `prefill_step`'s (no MTP) and `decode_step`'s; full: either may sample (the full sampler takes a greedy
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


def decode_step(params, cfg, kc, full, state, packed, prev_tokens):
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
    columns += sampler_columns(sampler)
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


def verify_step(params, cfg, kc, full, layout, state, packed, stop_mask, frontier, carry=None):
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


def encode_step(vparams, vcfg, attention, media, table, patches, taps, tap_weights, pos, n_valid, rows):
    """One image (uint8 patches and the processor's normalisation table: `vision.pixels_from_bytes`) through the
    vision tower (`vision.padded_tower`), its tokens written to media rows `rows` ([bucket / merge^2]; an
    out-of-range row drops a padding token)."""
    pixels = vision.pixels_from_bytes(table, patches, vcfg.temporal_patch_size)
    out = vision.padded_tower(vparams, vcfg, pixels, taps, tap_weights, pos, n_valid, attention)
    return media.at[rows].set(out.astype(media.dtype), mode="drop")


def logprobs_step(logits, tokens, rows, top_k_groups):
    """`token_logprobs` of a step's rows, indexed like `tokens` ([W]): row i of logits chose tokens[rows[i]];
    rows at W or past it are padding, dropped. Entries no row names are zero."""
    out = token_logprobs(logits, tokens.at[rows].get(mode="fill", fill_value=0), top_k_groups=top_k_groups)
    return jax.tree.map(lambda x: _rows_to_lanes(x, rows, tokens.shape[0]), out)


def jit_encode_step():
    """The image encode step jitted as the runner jits it (scripts/bench_vision.py times this form)."""
    return jax.jit(own_copy(encode_step), static_argnames=("vcfg", "attention"), donate_argnames=("media",))


def jit_decode_step():
    """The decode step jitted as the runner jits it (the decode profiler builds variants of it the same way)."""
    return jax.jit(own_copy(decode_step), static_argnames=("cfg", "kc", "full"), donate_argnames=("state",))


# The row's lane, its sampler columns, then the lane whose SamplerState row it uses (C: none, neutral); then the
# allowed-token mask's words.
PROCESS_COLUMNS = 2 + SAMPLER_COLUMNS


def process_step(logits, sampler_state, extras, width):
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


def copy_slot(ssm, conv, src, dst):
    """State slot src -> dst (a resume loading a snapshot into its lane): one D2D copy per GDN layer."""
    return tuple(s.at[dst].set(s[src]) for s in ssm), tuple(c.at[dst].set(c[src]) for c in conv)


def copy_page(k_pages, v_pages, src, dst, length):
    """The first `length` positions of page src -> page dst (a tail copy-on-write), every plane of every attention
    layer (a quantized page's rows keep their bytes)."""
    keep = (jnp.arange(PAGE) < length)[:, None, None]

    def one(pages):
        return pages.at[dst].set(jnp.where(keep, pages[src], pages[dst]))

    return jax.tree.map(one, k_pages), jax.tree.map(one, v_pages)


def own_copy(fn):
    """A new function object wrapping fn: jax keys its compile cache on the function, so each runner
    wrapping its own copy gets compile counts of its own."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper
