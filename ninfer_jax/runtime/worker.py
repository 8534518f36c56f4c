"""Worker: the engine's single mutation owner (spec §10.9) — admission, prefill chunks interleaved with
decode rounds, stop checks, and terminal settlement of every request.

One `step()` is schedule, run, postprocess: admit FIFO heads while a lane and their pages are free (a
blocked head is never overtaken), run at most one prefill chunk (oldest prefilling lane first), then one
decode round over every decoding lane, so running requests keep decoding while a long prompt prefills.

Page entitlement (spec §9.5): a lane is admitted with pages for its prompt plus a bounded output window;
decode extends it one page at a time at round boundaries, and when the pool cannot extend, the request
ends with finish_reason "length" (bounded completion). Nothing active is ever taken away.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from ninfer_jax.model.state import PAGE
from ninfer_jax.prefix_cache import Readiness
from ninfer_jax.runtime.options import EngineOptions
from ninfer_jax.runtime.prefix_binding import PrefixCacheBinding
from ninfer_jax.runtime.request import Request, StreamEvent
from ninfer_jax.runtime.runner import ModelRunner
from ninfer_jax.runtime.sampling import SamplerInputs

log = logging.getLogger("ninfer_jax.worker")


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


class Worker:
    """Owns lanes, page tables and the page pool; drives the ModelRunner. Called from one thread only."""

    def __init__(self, runner: ModelRunner, options: EngineOptions, cache: PrefixCacheBinding,
                 stop_ids: frozenset[int]):
        self.runner, self.options, self.cache = runner, options, cache
        self.pages = cache.pages  # the index's page pool: Free / Active (lanes) / Cached / Filling
        c = options.max_concurrency
        self.lanes: list[Request | None] = [None] * c
        self.page_tables = np.zeros((c, runner.max_pages), np.int32)
        self.sampler = SamplerInputs.empty(c)
        self.waiting: collections.deque[Request] = collections.deque()
        self.stop_ids = stop_ids
        self.counters = collections.Counter()

    # --- queue -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.counters["requests_submitted"] += 1

    def cancel(self, request_id: str) -> bool:
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                self._finish(req, "cancelled")
                return True
        for req in self.lanes:
            if req is not None and req.id == request_id:
                self._finish(req, "cancelled")
                return True
        return False

    def abort_all(self, reason: str, error: str | None = None) -> None:
        """Ends every queued and running request (engine stop or failure)."""
        while self.waiting:
            self._finish(self.waiting.popleft(), reason, error)
        for req in self.lanes:
            if req is not None:
                self._finish(req, reason, error)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.lanes)

    # --- one scheduling step ---------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, one prefill chunk, one decode round. Returns whether any model work ran."""
        self.cache.poll_writes()  # Host writes that landed join the index (their pins drop)
        self.cache.raise_write_failure()  # one that failed fails the engine
        self._admit()
        did = False
        prefilling = [r for r in self.lanes if r is not None and r.prefilling]
        if prefilling:
            self._prefill_chunk(min(prefilling, key=lambda r: r.arrival))
            did = True
        if any(r is not None and not r.prefilling for r in self.lanes):
            self._decode_round()
            did = True
        if all(r is None for r in self.lanes):
            self.cache.dispatch_writes()  # no model step follows to hide them behind
        return did

    def _entitlement(self, req: Request) -> int:
        n = req.num_prompt
        window = min(req.sampling.max_tokens, self.options.output_window)
        want = pages_for(min(n + window, self.options.max_model_len))
        return max(pages_for(n + 1), min(want, self.pages.capacity))

    def _admit(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            lane = next((i for i, r in enumerate(self.lanes) if r is None), None)
            if lane is None:
                self.cache.prefetch(head, self._entitlement(head))  # the wait copies its Host path (§6.6)
                return
            readiness = self.cache.admit(head, lane, self._entitlement(head), self.lanes)
            if readiness is Readiness.TEMPORARILY_BLOCKED:
                self.counters["admission_blocked"] += 1
                self.cache.prefetch(head, self._entitlement(head))
                return  # the head waits for pages; nothing behind it overtakes it (spec §6.3)
            self.waiting.popleft()
            if readiness is Readiness.PERMANENTLY_INFEASIBLE:
                self._finish(head, "error", "the request can never fit the KV pool")
                continue
            head.lane = lane
            self.page_tables[lane] = 0
            self.page_tables[lane, : len(head.pages)] = head.pages
            self.sampler.set_lane(lane, head.sampling, head.seed, 0)
            self.lanes[lane] = head
            self.counters["requests_admitted"] += 1
            # cached_tokens is fixed at admission (spec §8.3); the first event carries it.
            self._deliver(head, StreamEvent(head.id, (), "", None, head.usage(), head.metrics()))

    # --- prefill ---------------------------------------------------------------------------------
    def _prefill_chunk(self, req: Request) -> None:
        base = req.computed
        end = min(req.num_prompt, base + self.options.prefill_chunk)
        tokens = req.prompt_ids[base:end]
        last = end == req.num_prompt
        full = last and not req.sampling.greedy
        self.sampler.step[req.lane] = len(req.output)
        tap_positions, tap_slots = self.cache.chunk_taps(req, end)
        tokens_out, chosen, top = self.runner.prefill(
            tokens, base, self.page_tables[req.lane], req.lane, self._lane_sampler(req.lane),
            tap_positions, tap_slots, full=full,
        )
        req.computed = end
        self.cache.after_compute(req)
        self.cache.dispatch_writes()  # the chunk computes meanwhile
        self.counters["prefill_tokens"] += end - base
        self.counters["prefill_chunks"] += 1
        if last:
            self._accept(req, int(np.asarray(tokens_out)[0]), chosen, top, 0)
            self._emit(req)

    def _lane_sampler(self, lane: int):
        s = self.sampler
        return tuple(
            np.asarray(a[lane : lane + 1]) for a in (s.temperature, s.top_k, s.top_p, s.seed, s.step)
        )

    # --- decode ----------------------------------------------------------------------------------
    def _decode_round(self) -> None:
        c = len(self.lanes)
        active = np.zeros(c, bool)
        tokens = np.zeros(c, np.int32)
        positions = np.zeros(c, np.int32)
        for lane, req in enumerate(self.lanes):
            if req is None or req.prefilling:
                continue
            if not self._ensure_page(req):
                self._finish(req, "length")  # bounded completion: the pool cannot extend this lane
                continue
            active[lane] = True
            tokens[lane] = req.output[-1]
            positions[lane] = req.computed
            self.sampler.step[lane] = len(req.output)
        if not active.any():
            return
        live = [r for r in self.lanes if r is not None and active[r.lane]]
        full = any(not r.sampling.greedy for r in live)
        tokens_out, chosen, top = self.runner.decode(
            tokens, positions, self.page_tables, np.arange(c, dtype=np.int32), active, self.sampler.device(),
            full=full,
        )
        self.cache.dispatch_writes()  # the last round's finishes: their gathers queue behind this round
        tokens_out = np.asarray(tokens_out)
        self.counters["decode_rounds"] += 1
        for req in live:
            req.computed += 1
            self.cache.after_compute(req)
            self._accept(req, int(tokens_out[req.lane]), chosen, top, req.lane)
            self._emit(req)

    def _ensure_page(self, req: Request) -> bool:
        """The lane has a page for position req.computed, extending by one page if needed."""
        block = req.computed // PAGE
        if block < len(req.pages):
            return True
        page = self.cache.grow(req) if block < self.runner.max_pages else None
        if page is None:
            return False
        req.pages.append(page)
        self.page_tables[req.lane, block] = page
        self.counters["pages_extended"] += 1
        return True

    # --- tokens, stop checks, events -------------------------------------------------------------
    def _accept(self, req: Request, token: int, chosen, top, row: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.output.append(token)
        self.counters["generated_tokens"] += 1
        if req.sampling.logprobs is not None and chosen is not None:
            n = req.sampling.logprobs
            ids, lps = np.asarray(top[0])[row], np.asarray(top[1])[row]
            entry = {"token_id": token, "logprob": float(np.asarray(chosen)[row]),
                     "top": [(int(i), float(lp)) for i, lp in zip(ids[:n], lps[:n])]}
            req.logprobs = (req.logprobs or []) + [entry]
        sp = req.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.stop_ids)
        if token in stops:
            req.finish_reason = "stop"
            return
        if req.detokenizer is not None:
            req.text += req.detokenizer.push(token)
            for s in sp.stop:
                at = req.text.find(s, max(0, req.emitted_text - len(s) + 1))
                if at >= 0:
                    req.text = req.text[:at]
                    req.finish_reason = "stop"
                    req.detokenizer = None  # the text ends here: nothing buffered may follow it
                    return
        if len(req.output) >= sp.max_tokens or req.computed + 1 >= self.options.max_model_len:
            req.finish_reason = "length"

    def _emit(self, req: Request) -> None:
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason)
            return
        hold = max((len(s) - 1 for s in req.sampling.stop), default=0)  # a stop string may be forming
        tokens, delta, lp = self._take_unsent(req, max(req.emitted_text, len(req.text) - hold))
        self._deliver(req, StreamEvent(req.id, tokens, delta, None, None, None, lp))

    @staticmethod
    def _take_unsent(req: Request, text_upto: int):
        """The tokens, text up to `text_upto` and logprobs not yet sent, marked as sent."""
        tokens = tuple(req.output[req.emitted_tokens :])
        delta = req.text[req.emitted_text : text_upto]
        lp = tuple(req.logprobs[-len(tokens):]) if req.logprobs and tokens else None
        req.emitted_tokens, req.emitted_text = len(req.output), text_upto
        return tokens, delta, lp

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Terminal settlement: free the lane's pages and slot, send the last event."""
        req.finish_reason = reason
        if req.lane is not None:
            self.cache.finish(req, req.lane, reason)
            self.lanes[req.lane] = None
            req.lane = None
        if req.detokenizer is not None and reason in ("stop", "length"):
            req.text += req.detokenizer.flush()
        tokens, delta, lp = self._take_unsent(req, len(req.text))
        self.counters[f"finished_{reason}"] += 1
        self._deliver(req, StreamEvent(req.id, tokens, delta, reason, req.usage(), req.metrics(), lp, error))

    def _deliver(self, req: Request, event: StreamEvent) -> None:
        try:
            req.sink(event)
        except Exception:  # a consumer's callback must not take the engine down for everyone
            log.exception("event sink of %s raised; the request keeps running", req.id)

    # --- accounting ------------------------------------------------------------------------------
    def check_ledger(self) -> None:
        """The cache's invariants, and private pages are exactly the lanes' (tests call this often)."""
        self.cache.check(self.lanes)

    def stats(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": sum(r is not None for r in self.lanes),
            "pages": self.pages.ledger(),
            "counters": dict(self.counters),
        }
