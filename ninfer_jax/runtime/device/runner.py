"""ModelRunner: owns the params and the DeviceState, and runs the jitted prefill and decode steps.

Each step donates the DeviceState and returns it; `_swap` is the one place that assigns it back, checking
that the pools kept their shapes. Step shapes come from a bounded set (`device/buckets.py`: prefill pass lengths,
decode rounds of 1, 2, 4, ... C lanes; a greedy and a full sampler), all compiled by `warmup()`, with the
log-probabilities' program for each round size (`steps.logprobs_step`, dispatched only when a request asks) and the
logit processing's (`steps.process_step`: penalties, logit_bias, min_tokens, grammar masks; it samples a step's rows
again from its logits, dispatched only when a request of the step asks, so other steps keep their programs);
`compile_count()` lets tests prove that serving never compiles again. The steps themselves, and the packing of their
host inputs into one int32 array, are `device/steps.py`.

Host tier transfers (spec §6.5, §7.6; `enable_host_transfers`) jit the programs of `device/transfer.py`; a
batch of pages is split into the compiled power-of-two sizes (`buckets.split_transfer`), so transfers compile once
and never move a padding row.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.config import ModelConfig
from ninfer_jax.model import vision
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import Params
from ninfer_jax.model.spmd import conv_order, kv_order
from ninfer_jax.model.state import PAGE, DeviceState, init_device_state
from ninfer_jax.runtime.device import steps, transfer
from ninfer_jax.runtime.device.buckets import StepSizes, fit, idle_chunk_sizes, pow2_buckets, prefill_buckets
from ninfer_jax.runtime.device.compiling import AheadOfTime
from ninfer_jax.runtime.device.sharding import ParallelLayout
from ninfer_jax.runtime.device.steps import (
    FRONTIER_COLUMNS, PROCESS_COLUMNS, SAMPLER_COLUMNS, VerifyOut, jit_decode_step, jit_encode_step,
    pack_decode_inputs, pack_prefill_inputs, pack_verify_inputs,
)
from ninfer_jax.runtime.device.transfer import WORD_BYTES
from ninfer_jax.runtime.sampling import MAX_LOGIT_BIAS, TOP_K_GROUPS, SamplerState, mask_words, set_lane_row

log = logging.getLogger("ninfer_jax.runner")

# The most lanes a verify round takes: past them a round's k + 1 rows per lane stop riding on the weights' read for
# free, so wider rounds decode plainly. Not measured yet on the H200 (docs/STATUS.md).
SPECULATIVE_MAX_LANES = 16


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
        prompt_logprobs: whether each pass size's `steps.scores_step` is compiled (and `prefill` takes
        score_targets)."""
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
        self._no_counts = jnp.zeros(cfg.vocab_size, jnp.int32)  # the output counts of a lane's first admission
        if layout is not None:  # on the mesh from the start, as the steps return them: one program per step
            (self.sampler_state, self._no_prev, self._no_frontier, self._no_counts, self._stop_mask,
             self.mtp_carry) = layout.replicate((self.sampler_state, self._no_prev, self._no_frontier,
                                                 self._no_counts, self._stop_mask, self.mtp_carry))
        # Jitted per runner, so compile counts belong to this engine. jit sits exactly on the steps.
        self._prefill_rows = np.zeros(1, np.int32)  # a prefill's one row of logits is entry 0 of its tokens
        self._steps = {
            "prefill": jax.jit(steps.own_copy(steps.prefill_step), static_argnames=("cfg", "kc", "full", "layout"),
                               donate_argnames=("state", "carry")),
            "process": jax.jit(steps.own_copy(steps.process_step), static_argnames=("width",),
                               donate_argnames=("sampler_state",)),
            "sampler_lane": jax.jit(steps.own_copy(set_lane_row), donate_argnames=("state",)),
            "decode": jit_decode_step(),
            "mixed": jax.jit(steps.own_copy(steps.mixed_step), static_argnames=("cfg", "kc", "full", "layout"),
                             donate_argnames=("state",)),
            "verify": jax.jit(steps.own_copy(steps.verify_step), static_argnames=("cfg", "kc", "full", "layout"),
                              donate_argnames=("state", "carry")),
            "logprobs": jax.jit(steps.own_copy(steps.logprobs_step), static_argnames=("top_k_groups",)),
            "scores": jax.jit(steps.own_copy(steps.scores_step), static_argnames=("top_k_groups",)),
            "encode": jit_encode_step(),
            "copy_slot": jax.jit(steps.own_copy(steps.copy_slot), donate_argnames=("ssm", "conv")),
            "copy_page": jax.jit(steps.own_copy(steps.copy_page), donate_argnames=("k_pages", "v_pages")),
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
        `score_targets` (int32 [len(tokens)]: each token's next one) asks for `steps.scores_step`'s (on the device).

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
            extras = np.concatenate([[lane], *(c[:1] for c in steps.sampler_columns(sampler)), [lane], allowed])
            extras = extras.astype(np.int32)
        return packed, extras

    # The packed arrays go to the steps as numpy: jit's own transfer of them is cheaper than an eager
    # jnp.asarray (docs/kernels_notes.md, the decode round's host side). Each is new and never written again, so
    # the step may read it later (on CPU jax can alias a numpy buffer).
    def _prefill_packed(self, packed: np.ndarray, size: int, full: bool, logprobs: bool, extras=None, targets=None):
        """extras: the processing row [PROCESS_COLUMNS + W] of `steps.process_step`, or None; targets: int32 [size], the
        tokens `steps.scores_step` scores the pass's rows on, or None."""
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
        """A step's tokens sampled again from its processed logits (`steps.process_step`)."""
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
        """`steps.process_step`'s rows [R, PROCESS_COLUMNS + mask_words] of a round: each row's lane and sampler columns
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

    def set_sampler_lane(self, lane: int, row: np.ndarray, output=()) -> None:
        """Writes a lane's SamplerState row (`sampling.lane_row`) and its output counts (of `output`: a preempted
        request's tokens so far): at admission of a request that processes its logits."""
        counts = self._no_counts  # kept on the device: no [V] copy at each admission
        if len(output):
            counts = np.bincount(np.asarray(output, np.int64), minlength=self.cfg.vocab_size).astype(np.int32)
        self._swap_sampler(self._steps["sampler_lane"](self.sampler_state, np.int32(lane), row, counts))

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
        jitted = self._steps
        sizes = self.configured().first() if first else self.configured()
        with AheadOfTime(threads) as ahead:
            # The recording pass swaps shapes into the runner's state: it gets its arrays back afterwards.
            kept = {**vars(self), "_layout_checked": set(self._layout_checked)}
            whats: list[str] = []
            self._steps = {name: ahead.lowering(name, fn) for name, fn in jitted.items()}
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

            self._steps = {name: ahead.waiting(name, fn) for name, fn in jitted.items()}
            try:
                self._warmup_calls(ready, sizes)
            finally:
                self._steps = jitted
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
