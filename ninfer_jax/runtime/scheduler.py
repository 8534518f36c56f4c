"""Scheduler: the engine's single mutation owner (spec §10.9): admission, prefill passes interleaved with decode
rounds, and the settlement of every request.

One `step()` is schedule, run, postprocess: admit FIFO heads while a lane and their pages are free (a blocked
head is never overtaken, §6.3), dispatch at most one prefill pass (oldest prefilling lane first), then one decode
round over every decoding lane, so running requests keep decoding while a long prompt prefills.

Decode runs one round ahead of the host: a round is dispatched before the previous one is read back, feeding
that round's tokens on the device, so the device never idles while the host reads tokens and builds the next
round. The price: a lane that stops on a token the host has not read yet runs one more round, which feeds its
last token (its KV, state and endpoint then cover the whole output) and whose sampled token is dropped. A lane
with a grammar (response_format) skips the round after each of its own: its allowed tokens depend on the token
in flight, which its grammar must accept on the host first.

Page entitlement (§9.5): a lane is admitted with pages for its prompt plus a bounded output window; decode extends
it one page at a time. A lane the pool cannot extend sits out a round; then the most junior running requests (by
priority with that policy, then arrival) are preempted for it (vLLM's recompute preemption): each goes back to the
queue before every request junior to it, the cache keeping what it computed, its endpoint included, and its next
admission resumes from there with its output so far as part of its prefix. The most senior lane therefore always
grows; one that no other lane holds pages beside ends with finish_reason "length" (bounded completion).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from ninfer_jax.frontend.prepared_prompt import continue_prompt
from ninfer_jax.model.state import PAGE
from ninfer_jax.prefix_cache import Readiness
from ninfer_jax.runtime.device.runner import ModelRunner
from ninfer_jax.runtime.device.steps import CLOSING, LANE_STOPS
from ninfer_jax.runtime.images import ImageFeeder
from ninfer_jax.runtime.options import EngineOptions
from ninfer_jax.runtime.outputs import OutputProcessor
from ninfer_jax.runtime.prefix.manager import PrefixCacheManager
from ninfer_jax.runtime.request import Request
from ninfer_jax.runtime.sampling import SamplerInputs, lane_row
from ninfer_jax.runtime.speculative import DraftPause, NgramProposer, RoundChoice, SpeculativeStats
from ninfer_jax.runtime.structured import allowed_tokens

log = logging.getLogger("ninfer_jax.scheduler")


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


@dataclasses.dataclass
class _Round:
    """A decode round dispatched and not yet read back: its requests and its outputs on the device."""

    reqs: list[Request]
    out: tuple  # (tokens [C], chosen logprob [C] or None, top or None); a verify round's: the runner's VerifyOut
    verify: bool = False
    chained: frozenset[int] = frozenset()  # lanes continuing the previous verify round's frontier on the device


class _PhaseClock:
    """Adds the seconds since the last lap to `counters["seconds_<phase>"]`."""

    def __init__(self, counters: collections.Counter):
        self.counters, self.last = counters, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.counters[f"seconds_{phase}"] += now - self.last
        self.last = now


class Scheduler:
    """Owns the lanes, their page tables and sampler rows; drives the runner. Called from one thread only.

    It writes a request's lane, pages, computed count and timestamps; the OutputProcessor writes its output.
    """

    def __init__(self, runner: ModelRunner, options: EngineOptions, cache_manager: PrefixCacheManager,
                 stop_ids: frozenset[int]):
        self.runner, self.options, self.cache_manager = runner, options, cache_manager
        self.pages = cache_manager.pages  # the index's page pool: Free / Active (lanes) / Cached / Filling
        c = options.max_concurrency
        self.lanes: list[Request | None] = [None] * c
        self.page_tables = np.zeros((c, runner.max_pages), np.int32)
        self.rope_shift = np.zeros(c, np.int32)  # each lane's prompt's MRoPE delta (images move later positions)
        self.images = ImageFeeder(runner, options.vision_cache_tokens) if runner.vision is not None else None
        self.sampler = SamplerInputs.empty(c)
        self.waiting: collections.deque[Request] = collections.deque()
        self.counters = collections.Counter()
        self.outputs = OutputProcessor(stop_ids, options.max_model_len, self.counters)
        self.pending: _Round | None = None  # the decode round in flight (at most one)
        k = options.num_speculative_tokens or 0
        # MTP drafts come from the device with each verify round (`Request.drafts`); prompt lookup runs here.
        self.mtp = options.speculative == "mtp"
        self.proposer = NgramProposer(k, options.prompt_lookup_min, options.prompt_lookup_max) \
            if options.speculative == "ngram" else None
        self.speculating = options.speculative is not None
        # Whether a pass rides in the decode round's step while lanes decode (its programs exist when the runner
        # has mixed_tokens); scripts/bench_arrivals.py turns it off to time passes and rounds apart on one engine.
        self.mix = runner.mixed_tokens > 0 and not self.speculating
        self.speculative, self.pause = SpeculativeStats(k), DraftPause()
        # Whether speculation pays, measured per round width (`RoundChoice`); None: every round that can verify does.
        self.choice = RoundChoice() if self.speculating and options.adaptive_speculation == "on" else None
        self._last_read = None  # (kind of round, lanes, prefill passes so far), when its read returned
        # Lanes that stopped in a verify round one token short of their output: the next round feeds that token, as a
        # plain round in flight does, so endpoints (spec §7.7) cover the same tokens with speculation on or off.
        self.closing: set[int] = set()
        # MTP verify rounds continue the round in flight on the device (`_chainable`); tests that script the drafts
        # on the host turn it off.
        self.chain_rounds = True
        self._pass_in_flight = None  # the last prefill pass's token output, until the next pass is dispatched
        self.short: set[int] = set()  # lanes a round left without a page for their next position (`_make_room`)
        self._first_pending = None  # a mixed step's first token (`_prefill_pass`'s), read at the next step

    # --- queue -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queues `req` last, or with the priority policy after every waiting request of its priority or a lower
        value: the head (`waiting[0]`) is the one admission serves next and nothing behind it overtakes it. A
        preempted request goes back before every waiting one junior to it (`_seniority`)."""
        at = len(self.waiting)
        if req.preemptions:
            at = next((i for i, r in enumerate(self.waiting) if self._seniority(r) > self._seniority(req)), at)
        else:
            self.counters["requests_submitted"] += 1
            if self.options.scheduling_policy == "priority":
                at = next((i for i, r in enumerate(self.waiting) if r.sampling.priority > req.sampling.priority), at)
        self.waiting.insert(at, req)

    def _seniority(self, req: Request) -> tuple:
        """Admission order, and the reverse of preemption order: arrival, after the priority with that policy."""
        return (req.sampling.priority if self.options.scheduling_policy == "priority" else 0, req.arrival)

    def cancel(self, request_id: str) -> bool:
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                self._finish(req, "cancelled")
                return True
        for req in self.lanes:
            if req is not None and req.id == request_id:
                self._read_pending()  # its lane's state must match its count before an endpoint is taken
                if req.lane is not None:  # the read may have finished it
                    self._finish(req, "cancelled")
                return True
        return False

    def abort_all(self, reason: str, error: str | None = None) -> None:
        """Ends every queued and running request (engine stop or failure)."""
        try:
            self._read_pending()
        except Exception:  # the device failed: the round's lanes end below like every other
            self.pending = None
            log.exception("reading the decode round in flight failed while ending every request")
        while self.waiting:
            self._finish(self.waiting.popleft(), reason, error)
        for req in self.lanes:
            if req is not None:
                self._finish(req, reason, error)

    # --- one scheduling step ---------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, one prefill pass, one decode round. Returns whether any model work ran.

        The seconds per phase add up in `counters["seconds_<phase>"]`: where the host time of a step goes
        (admission includes restore dispatch; the two reads include waiting for the device)."""
        clock = _PhaseClock(self.counters)
        self.cache_manager.poll()  # Host writes that landed join the index; one that failed fails the engine
        self._make_room()  # before admission: running lanes' growth comes first (§9.5)
        self._admit()
        clock.lap("admit")
        prefilling = [r for r in self.lanes if r is not None and r.prefilling]
        head = min(prefilling, key=lambda r: r.arrival) if prefilling else None
        # While lanes decode, the head's pass rides in the round's step (runner.mixed) when the engine mixes, unless
        # it scores its prompt (only a pass of its own returns every row)
        mixed = head is not None and self.mix and bool(self.runner.ready.mixed) and any(
            r is not None and r.decoding for r in self.lanes) and not head.scores_prompt
        prefilled = self._prefill_pass(head)[0] if head is not None and not mixed else None
        clock.lap("prefill_dispatch")
        previous, self.pending = self.pending, None
        if previous is not None and not self._chainable(previous) and (previous.verify or self._may_speculate()):
            # Drafts follow the tokens a round emits, so a round that may verify drafts waits for the read, unless
            # the drafts and the tokens they follow are on the device (MTP); and a plain round takes its tokens
            # from a plain round's output only.
            self._retire(previous)
            clock.lap("round_read")
            previous = None
        self.pending, in_round = self._dispatch_round(previous, head if mixed else None)
        clock.lap("round_dispatch")
        # A pass's first token is read after the round's dispatch, so the device goes on computing meanwhile. One
        # from the round's own step waits for the next step's dispatch: read now, it would hold this step's host
        # work until the whole step ends and leave the device idle for it (the lane joins the round after next).
        deferred, self._first_pending = self._first_pending, in_round
        for first in (prefilled, deferred):
            if first is not None:
                self._first_token(*first)
                clock.lap("first_token_read")
        if previous is not None:
            self._retire(previous)
            clock.lap("round_read")
        if all(r is None for r in self.lanes):
            self.cache_manager.flush()  # no model step follows to hide the Host writes behind
            clock.lap("idle_writes")
        return bool(prefilling) or previous is not None or self.pending is not None or self._first_pending is not None

    def _entitlement(self, req: Request) -> int:
        n = req.prefix.num_tokens
        window = min(req.sampling.max_tokens - len(req.output), self.options.output_window)
        want = pages_for(min(n + window, self.options.max_model_len))
        return max(pages_for(n + 1), min(want, self.pages.capacity))

    def _admit(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            lane = next((i for i, r in enumerate(self.lanes) if r is None), None)
            if lane is not None and len(self.lanes) - self.lanes.count(None) >= self.runner.ready.decode[-1]:
                lane = None  # the wider rounds still compile (`ModelRunner.compile_rest`)
            if lane is None:
                self.cache_manager.prefetch(head, self._entitlement(head))  # the wait copies its Host path (§6.6)
                return
            started = time.perf_counter()  # what precedes is waiting; the admission itself restores
            admission = self.cache_manager.admit(head, lane, self._entitlement(head), self.lanes)
            if admission.readiness is Readiness.TEMPORARILY_BLOCKED:
                self.counters["admission_blocked"] += 1
                self.cache_manager.prefetch(head, self._entitlement(head))
                return  # the head waits for pages; nothing behind it overtakes it (spec §6.3)
            self.waiting.popleft()
            if admission.readiness is Readiness.PERMANENTLY_INFEASIBLE:
                if head.output:  # a preempted request that no longer fits ends where it was (bounded completion)
                    self._finish(head, "length")
                else:
                    self._finish(head, "error", "the request can never fit the KV pool")
                continue
            head.lane = lane
            head.pages = list(admission.pages)
            head.computed = head.reused = admission.reused_tokens
            head.drafts = head.drafts[:0]
            self.page_tables[lane] = 0
            self.page_tables[lane, :len(head.pages)] = head.pages
            self.rope_shift[lane] = head.prompt.media.rope_delta if head.prompt.media is not None else 0
            self.sampler.set_lane(lane, head.sampling, head.seed, 0)
            # its SamplerState row: penalty statistics (a preempted request's output counted again), bias and
            # min_tokens (a thinking budget's processed rounds read it too, neutral)
            if head.sampling.processed or head.thinking is not None:
                self.runner.set_sampler_lane(lane, lane_row(head.sampling, head.prompt_ids, self.outputs.stop_ids,
                                                            self.runner.cfg.vocab_size), head.output)
            self.lanes[lane] = head
            if head.admitted_at is None:  # its first admission (a preempted request's next one sends nothing)
                head.admitted_at, head.cached_tokens = started, admission.reused_tokens
                self.counters["requests_admitted"] += 1
                self.outputs.admitted(head)

    # --- prefill ---------------------------------------------------------------------------------
    def _prefill_pass(self, req: Request, decode_round: dict | None = None):
        """Dispatches the lane's next prefill pass, alone or (`decode_round`: `runner.decode`'s arguments) in one
        step with a decode round (`runner.mixed`, a pass of at most mixed_tokens). Returns (the pass's outputs when
        it ends the prompt, for `_first_token` to read once the step's round is dispatched too, else None; the
        round's outputs or None)."""
        base = req.computed
        end = self._pass_end(req, mixed=decode_round is not None)
        last = end == req.prefix.num_tokens
        self.sampler.step[req.lane] = len(req.output)
        tap_positions, tap_slots = self.cache_manager.taps_for_chunk(req, end)
        processing = self._processing([req]) if last else {}
        if req.scheduled_at is None:
            req.scheduled_at = time.perf_counter()
        rope_positions = media_rows = None
        if req.prompt.media is not None:
            rope_positions, media_rows = self.images.pass_inputs(req.prefix, base, end)
        chunk = dict(
            tokens=req.prefix.token_ids[base:end], base=base, page_table=self.page_tables[req.lane],
            slot=self.cache_manager.lane_slot(req.lane), sampler=self._lane_sampler(req.lane),
            tap_positions=tap_positions, tap_slots=tap_slots, full=last and not req.sampling.greedy,
            logprobs=last and req.sampling.logprobs is not None, lane=req.lane,
            allowed=processing["allowed"][req.lane] if processing else None, resumed=0 < base == req.reused,
            rope_positions=rope_positions, media_rows=media_rows,
        )
        round_out = None
        if decode_round is None:
            # with prompt logprobs each row is scored on the prompt token after it (the last row's is the output's)
            targets = req.prompt_ids[base + 1:end + 1] if req.scores_prompt else None
            tokens_out, chosen, top, scores = self.runner.prefill(**chunk, score_targets=targets)
            if scores is not None:
                req.prompt_scores.append((base, scores))
        else:
            (tokens_out, chosen, top), round_out = self.runner.mixed(chunk, decode_round)
            self.counters["mixed_steps"] += 1
        req.computed = end
        self.cache_manager.computed(req)
        self.cache_manager.flush()  # the pass computes meanwhile
        # At most one pass waits behind the one computing: the host does not run a whole prompt's passes ahead, so
        # a cancel (or a new request's admission) takes effect within one pass.
        previous, self._pass_in_flight = self._pass_in_flight, tokens_out
        if previous is not None:
            previous.block_until_ready()
        self.counters["prefill_tokens"] += end - base
        self.counters["prefill_chunks"] += 1
        return ((req, tokens_out, chosen, top) if last else None), round_out

    def _pass_end(self, req: Request, mixed: bool = False) -> int:
        """Where the lane's next pass ends: mixed_tokens on in a mixed step; prefill_chunk tokens on; or, while no
        lane decodes (no round waits on the pass), the longest idle size that fits the prompt. An idle size ends
        the prompt only for a greedy request: those sizes are compiled for the greedy sampler alone."""
        base, n = req.computed, req.prefix.num_tokens
        if mixed:
            return min(n, base + self.runner.mixed_tokens)
        ready = self.runner.ready
        end = min(n, base + min(self.options.prefill_chunk, ready.prefill[-1]))
        if end == n or any(r is not None and not r.prefilling for r in self.lanes):
            return end
        for size in reversed(ready.idle):
            if base + size < n or (base + size == n and req.sampling.greedy and not req.processes_logits()):
                self.counters["idle_prefill_chunks"] += 1
                return base + size
        return end

    def _first_token(self, req: Request, tokens_out, chosen, top) -> None:
        if req.prompt_scores:
            self.outputs.prompt_scored(req, req.prompt_scores)
            req.prompt_scores = []
        self.outputs.accept(req, int(np.asarray(tokens_out)[0]), chosen, top, 0)
        self._report(req)

    def _lane_sampler(self, lane: int):
        return tuple(a[lane:lane + 1] for a in self.sampler.arrays())

    def _processing(self, reqs: list[Request]) -> dict:
        """The runner's logit-processing arguments for a step over `reqs`: none unless one of them asks for it."""
        masks = allowed_tokens(reqs, len(self.lanes), self.runner.mask_words)
        return {} if masks is None else {"allowed": masks[0], "processed": masks[1]}

    # --- decode ----------------------------------------------------------------------------------
    def _dispatch_round(self, previous: _Round | None, chunk_of: Request | None = None):
        """Dispatches a decode round over every lane with a token to feed, the tokens of lanes in `previous` (not
        read back yet) taken from its output on the device; with `chunk_of`, that prefilling lane's next pass in the
        same step (alone when no lane decodes after all). Returns (the round, or None when no lane decodes; the
        pass's outputs as `_prefill_pass` gives them, None without `chunk_of`)."""
        c = len(self.lanes)
        if previous is not None and previous.verify:  # chained: every running lane verifies
            live = np.array([r is not None and r.decoding and r.finish_reason is None
                             for r in self.lanes])
            return (self._dispatch_verify(live, previous) if live.any() else None), None
        ahead = np.zeros(c, bool)  # the lane's previous token is still on the device
        if previous is not None:
            ahead[[r.lane for r in previous.reqs]] = True
        active = np.zeros(c, bool)
        tokens = np.zeros(c, np.int32)
        positions = np.zeros(c, np.int32)
        for lane, req in enumerate(self.lanes):
            if req is None or not req.decoding:
                continue  # prefilling, or its first token unread
            if req.finish_reason is not None:
                if lane in self.closing and not ahead[lane]:  # ended in a verify round: this round feeds its last token
                    active[lane], tokens[lane], positions[lane] = True, req.output[-1], req.computed
                continue  # else ended, waiting for its last round
            k = int(ahead[lane])
            if k and req.mask_follows_output:
                continue  # its mask needs the token in flight: it decodes again once that token is read
            if len(req.output) + k >= req.sampling.max_tokens or req.computed + k + 1 >= self.options.max_model_len:
                continue  # the token in flight is its last: no round past it
            if not self._ensure_page(req, req.computed + k):
                self.short.add(lane)  # it waits for a page (`_make_room`), its token in flight read meanwhile
                continue
            active[lane] = True
            tokens[lane] = 0 if k else req.output[-1]
            positions[lane] = req.computed + k
            self.sampler.step[lane] = len(req.output) + k
        if not active.any():
            return None, self._prefill_pass(chunk_of)[0] if chunk_of is not None else None
        if self.speculating:
            verify = self._dispatch_verify(active) if previous is None and self._may_speculate() else None
            if verify is not None:
                return verify, None
            self.speculative.plain_rounds += 1
            self.pause.plain_round()
            if self.choice is not None:
                self.choice.plain_round()
        live = [r for r in self.lanes if r is not None and active[r.lane]]
        decode_round = dict(
            tokens=tokens, positions=positions, page_tables=self.page_tables, slots=self.cache_manager.lane_slots,
            active=active, sampler=self.sampler.arrays(), full=any(not r.sampling.greedy for r in live),
            prev_tokens=previous.out[0] if previous is not None else None, use_prev=ahead & active,
            logprobs=any(r.sampling.logprobs is not None for r in live), rope_shift=self.rope_shift,
            **self._processing(live),
        )
        prefilled = None
        if chunk_of is None:
            out = self.runner.decode(**decode_round)
        else:
            prefilled, out = self._prefill_pass(chunk_of, decode_round)
        self.cache_manager.flush()  # the last round's finishes: their gathers queue behind this round
        self.counters["decode_rounds"] += 1
        return _Round(live, out), prefilled

    def _may_speculate(self) -> bool:
        """Whether the next round may verify drafts: speculation is on and not paused, and every decoding lane can
        take part. Otherwise rounds run as with speculation off, one in flight while the previous is read: wider
        rounds pay for their extra rows, and logit processing runs in plain rounds (its statistics follow each
        token)."""
        if not self.speculating or self.pause.paused:
            return False
        live = [r for r in self.lanes if r is not None and r.decoding]
        ahead = 2 * self.runner.verify_rows  # the tokens of a verify round in flight and of the next
        return 0 < len(live) <= self.runner.ready.verify[-1] and not any(
            r.processes_logits(ahead) or r.grammar is not None for r in live) and (
            self.choice is None or self.choice.speculate(len(live)))

    def _measure(self, verify: bool, lanes: int, tokens: int) -> None:
        """Times a round just read from the read of the one before it, when both are of one kind and width with no
        prefill pass between them (then the interval is the round's steady cost: device and host), for
        `RoundChoice`."""
        if self.choice is None:
            return
        now, kind = time.perf_counter(), (verify, lanes, self.counters["prefill_chunks"])
        if self._last_read is not None and self._last_read[0] == kind:
            self.choice.record(verify, lanes, tokens, now - self._last_read[1])
        self._last_read = (kind, now)

    def _dispatch_verify(self, active: np.ndarray, previous: _Round | None = None) -> _Round | None:
        """A verify round over the `active` lanes (each fed its last token and its drafts) when one has a draft;
        None otherwise (the round decodes plainly). Rounds in a row without a draft pause speculation (`DraftPause`):
        reading each round back before the next costs the device its idle gap. With MTP every round verifies: the
        round makes the next round's drafts, and a lane's first round has none. `previous`: an MTP verify round in
        flight (`_chainable`), whose lanes this round continues on the device."""
        live = [r for r in self.lanes if r is not None and active[r.lane]]
        c, t = len(self.lanes), self.runner.verify_rows
        tokens, counts, chained = np.zeros((c, t), np.int32), np.zeros(c, np.int32), np.zeros(c, bool)
        positions, stops, limits = np.zeros(c, np.int32), np.zeros(c, np.int32), np.zeros(c, np.int32)
        left, phase, own = np.zeros(c, np.int32), np.zeros(c, np.int32), np.full((c, LANE_STOPS), -1, np.int32)
        drafted = {}
        continued = {r.lane for r in previous.reqs} if previous is not None else set()
        for req in live:
            lane = req.lane
            # Each emitted token must fit max_tokens and the context (as a plain round's would).
            stops[lane], left[lane] = not req.sampling.ignore_eos, req.sampling.max_tokens - len(req.output)
            ids = list(req.sampling.stop_token_ids)[:LANE_STOPS]
            own[lane, :len(ids)] = ids
            if lane in continued:
                chained[lane], counts[lane] = True, 1  # its rows come from the frontier on the device
                continue
            if lane in self.closing:
                tokens[lane, 0], counts[lane], positions[lane], drafted[lane] = req.output[-1], 1, req.computed, 0
                phase[lane] = CLOSING
                continue
            if not self._ensure_page(req, req.computed):
                self.short.add(lane)  # fed nothing (`limits`) until `_make_room` finds it a page
            self.sampler.step[lane] = len(req.output)
            limit = min(left[lane], self.options.max_model_len - 1 - req.computed) - 1
            drafts = req.drafts[:max(0, limit)] if self.mtp else self.proposer.propose(req.sequence(), limit)
            n = len(drafts)
            while n and not self._ensure_page(req, req.computed + n):
                n -= 1  # the pool cannot extend the lane that far: fewer drafts
            tokens[lane, 0], tokens[lane, 1:1 + n] = req.output[-1], drafts[:n]
            counts[lane], positions[lane] = n + 1, req.computed
            drafted[lane] = n
        if not self.mtp:
            self.pause.found(any(drafted.values()))
            if not any(drafted.values()):
                return None
        for req in live:  # the pages each holds now: the rows fed must fit them, and the context
            limits[req.lane] = min(len(req.pages) * PAGE, self.options.max_model_len - 1)
        out = self.runner.verify(tokens, positions, counts, stops, self.page_tables, self.cache_manager.lane_slots,
                                 self.sampler.arrays(), full=any(not r.sampling.greedy for r in live),
                                 logprobs=any(r.sampling.logprobs is not None for r in live), limits=limits,
                                 rope_shift=self.rope_shift, chained=chained, left=left, phase=phase, lane_stops=own,
                                 frontier=previous.out.frontier if previous is not None else None)
        self.cache_manager.flush()
        self.counters["decode_rounds"] += 1
        self.counters["chained_rounds"] += previous is not None
        self.speculative.rounds += 1
        return _Round(live, out, verify=True, chained=frozenset(chained.nonzero()[0].tolist()))

    def _chainable(self, previous: _Round | None) -> bool:
        """Whether the next round can continue `previous`, an MTP verify round in flight, without reading it: its
        drafts are on the device, and each of its running lanes gets the pages two rounds may feed. Then the device
        never waits for the host between rounds; a lane the host finds ended in `previous` settles after this one."""
        if previous is None or not previous.verify or not self.mtp or not self.chain_rounds:
            return False
        if not self._may_speculate() or any(r.sampling.stop or len(r.sampling.stop_token_ids) > LANE_STOPS
                                            for r in previous.reqs):
            return False  # a stop the device cannot see would leave the lane's state past its output
        t, end = self.runner.verify_rows, self.options.max_model_len - 2  # the last position a round may feed
        return all(self._ensure_page(req, min(req.computed + t - 1, end))
                   and self._ensure_page(req, min(req.computed + 2 * t - 1, end))
                   for req in previous.reqs if req.finish_reason is None)

    def _retire_verify(self, done: _Round) -> None:
        """Reads a verify round back: each lane's kept drafts and the token after them, in order, until one ends
        it. The lane's state holds rows 0..kept; a stop found on the host before them leaves it ahead. A lane that
        ends here while the round in flight continues it settles when that round is read."""
        out = done.out
        t = self.runner.verify_rows
        emitted, kept, fed = np.asarray(out.emitted), np.asarray(out.kept), np.asarray(out.fed)
        drafts = np.asarray(out.drafts) if out.drafts is not None else None
        self._measure(True, len(done.reqs), int(np.sum(np.where(fed > 0, kept + 1, 0))))
        following = self.pending.chained if self.pending is not None else frozenset()
        for req in done.reqs:
            lane, base = req.lane, req.computed
            if lane in self.closing:  # this round fed its last token
                req.computed += 1
                self.cache_manager.computed(req)
                self._finish(req, req.finish_reason)
                continue
            if req.finish_reason is not None:  # it ended at the last read, and this round continued it
                self._settle_continued(req, int(kept[lane]) + 1 if fed[lane] else 0)
                continue
            n, a = int(fed[lane]) - 1, int(kept[lane])
            if n < 0:  # no room to feed (pages or context): its next round tries again
                continue
            req.drafted, req.accepted = req.drafted + n, req.accepted + a
            if drafts is not None:  # chained from the token this round emits last for the lane
                req.drafts = drafts[lane]
            if n:
                self.speculative.record(n, a)
            for i in range(a + 1):
                req.computed = base + i + 1
                self.outputs.accept(req, int(emitted[lane * t + i]), out.chosen, out.top, lane * t + i)
                if req.finish_reason is not None:
                    break
            if i + 1 == a:  # it fed every token of its output: the state is exact one token further
                req.computed = base + a + 1
            req.state_ahead = req.computed < base + a + 1
            self.cache_manager.computed(req)
            if req.finish_reason is None:
                self.outputs.progress(req)
            elif lane in following:
                continue  # the round in flight continues it: it settles when that round is read
            elif self._can_close(req):
                self.closing.add(lane)
            else:
                self._finish(req, req.finish_reason)

    def _settle_continued(self, req: Request, advanced: int) -> None:
        """Settles a lane that ended at the previous read, which the round just read continued on the device by
        `advanced` tokens (0: it fed none). One token fed after a stop it had not fed is exactly the plain round's
        closing feed; any other advance leaves its state ahead of its output (no endpoint, §7.7)."""
        if advanced == 1 and self._closable(req):
            req.computed += 1
            self.cache_manager.computed(req)
        elif advanced:
            req.state_ahead = True
        self._finish(req, req.finish_reason)

    def _closable(self, req: Request) -> bool:
        """A lane that stopped on a token it did not feed, its state exact up to that token."""
        return (req.finish_reason == "stop" and not req.state_ahead
                and req.computed == req.num_prompt + len(req.output) - 1
                and req.computed + 1 < self.options.max_model_len)

    def _can_close(self, req: Request) -> bool:
        """Whether a lane that stopped on a token it did not feed feeds it in one more round, as a plain lane does
        (its round in flight feeds it; a lane that reaches max_tokens knows it and runs no round past it)."""
        return self._closable(req) and self._ensure_page(req, req.computed)

    def _retire(self, done: _Round) -> None:
        """Reads a decode round back: counts its tokens as computed, accepts them, settles finishes. A lane that
        ends here while the next round (in flight) feeds its token settles when that round is read.

        Every lane that ends gets its last event before any of them settles: settling is the cache's
        bookkeeping, and lanes ending together would otherwise hold the last answer back behind the others'."""
        if done.verify:
            return self._retire_verify(done)
        tokens_out, chosen, top = done.out
        tokens_out = np.asarray(tokens_out)
        self._measure(False, len(done.reqs), len(done.reqs))
        following = {r.lane for r in self.pending.reqs} if self.pending is not None else set()
        ended = []
        for req in done.reqs:
            req.computed += 1
            if self.mtp:  # its drafts follow the token a verify round emitted, not this round's
                req.drafts = req.drafts[:0]
            self.cache_manager.computed(req)
            if req.finish_reason is None:  # else it ended at the last read; this round fed its last token
                self.outputs.accept(req, int(tokens_out[req.lane]), chosen, top, req.lane)
                if req.finish_reason is not None and req.lane in following:
                    continue
            if req.finish_reason is None:
                self.outputs.progress(req)
            else:
                self.outputs.last(req, req.finish_reason)
                ended.append(req)
        for req in ended:
            self._settle(req)
        if self.pause.paused and self._drafts_found(done.reqs):
            self.pause.resume()  # the next round verifies them

    def _drafts_found(self, reqs: list[Request]) -> bool:
        """Whether prompt lookup has a draft for one of these running lanes (while speculation pauses)."""
        if len(reqs) > self.runner.ready.verify[-1]:
            return False
        return any(len(self.proposer.propose(r.sequence(), 1))
                   for r in reqs if r.finish_reason is None)

    def _read_pending(self) -> None:
        """Reads the round in flight, if any, and a first token waiting, with none following them (cancel, stop):
        every lane settles."""
        first, self._first_pending = self._first_pending, None
        if first is not None:
            self._first_token(*first)
        if self.pending is not None:
            done, self.pending = self.pending, None
            self._retire(done)

    def _make_room(self) -> None:
        """Finds each lane a round left short a page for its next position, the most senior first: the most junior
        running requests are preempted for it, the lane itself when it is the most junior. A lane that no other
        holds pages beside ends with "length" (bounded completion, §9.5)."""
        if not self.short:
            return
        self._read_pending()  # no token in flight: every lane's state matches its count, as an endpoint needs
        short = sorted((r for r in self.lanes if r is not None and r.lane in self.short), key=self._seniority)
        self.short.clear()
        for req in short:
            while req.lane is not None and req.finish_reason is None and not self._ensure_page(req, req.computed):
                running = [r for r in self.lanes if r is not None and r.finish_reason is None]
                if running == [req]:
                    self._finish(req, "length")
                else:
                    self._preempt(max(running, key=self._seniority))

    def _preempt(self, req: Request) -> None:
        """Puts a running request back in the queue. The cache keeps what it computed (§7.7: its blocks, and its
        endpoint when it decodes), and its next admission resumes from there with its output so far as part of its
        prefix, so the lane's last token is fed again and the next one sampled as if the lane had gone on."""
        lane, pages = req.lane, len(req.pages)
        self.cache_manager.release(req, "preempted")
        self.lanes[lane] = None
        req.lane, req.pages, req.computed, req.prompt_scores = None, [], 0, []
        req.resume = continue_prompt(req.prompt, req.output) if req.output else None
        req.preemptions += 1
        self.add(req)
        self.counters["requests_preempted"] += 1
        log.info("preempted %s | lane %d | %d pages | %d tokens to resume | %d waiting", req.id, lane, pages,
                 req.prefix.num_tokens, len(self.waiting))

    def _ensure_page(self, req: Request, position: int) -> bool:
        """The lane has a page for `position`, extending by one page if needed."""
        block = position // PAGE
        if block < len(req.pages):
            return True
        page = self.cache_manager.grow(req) if block < self.runner.max_pages else None
        if page is None:
            return False
        req.pages.append(page)
        self.page_tables[req.lane, block] = page
        self.counters["pages_extended"] += 1
        return True

    # --- settlement ------------------------------------------------------------------------------
    def _report(self, req: Request) -> None:
        """The request's new output: its final event if the last token ended it, else a progress event."""
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason)
        else:
            self.outputs.progress(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Terminal settlement: the last event, then the lane's pages and slot go back."""
        self.outputs.last(req, reason, error)
        self._settle(req)

    def _settle(self, req: Request) -> None:
        """The cache keeps what the request computed (§7.7) and the lane is free; always within the step that
        sent the last event, so nothing (a stats call, the next admission) observes a finished lane."""
        if req.lane is not None:
            self.closing.discard(req.lane)
            self.cache_manager.release(req, req.finish_reason)
            self.lanes[req.lane] = None
            req.lane, req.pages = None, []

    # --- accounting ------------------------------------------------------------------------------
    def check_ledger(self) -> None:
        """The cache's invariants, and private pages are exactly the lanes' (tests call this often)."""
        self.cache_manager.check(self.lanes)

    def stats(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": sum(r is not None for r in self.lanes),
            "pages": self.pages.ledger(),
            "counters": dict(self.counters),
            "speculative": {**self.speculative.as_dict(), "pauses": self.pause.pauses,
                            "adaptive": self.choice.as_dict() if self.choice is not None else None}
            if self.speculating else None,
        }
