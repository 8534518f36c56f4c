"""OutputProcessor: a request's sampled tokens become its output, its stop checks and its stream events."""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from ninfer_jax.runtime.request import Request, StreamEvent

log = logging.getLogger("ninfer_jax.outputs")


class OutputProcessor:
    """Accepts tokens, checks stops and sends events. It is the only writer of a request's output fields
    (output, logprobs, text, emitted_*, finish_reason); the scheduler decides when it is called."""

    def __init__(self, stop_ids: frozenset[int], max_model_len: int, counters: collections.Counter):
        self.stop_ids, self.max_model_len, self.counters = stop_ids, max_model_len, counters

    def accept(self, req: Request, token: int, chosen, top, row: int) -> None:
        """Appends a sampled token (row `row` of its step's logprobs) and sets finish_reason if it ends the
        request: a stop token, a stop string (the text is cut before it, or after it with
        include_stop_str_in_output), a complete grammar, max_tokens or the
        context. A grammar advances by every token but a stop token."""
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.output.append(token)
        self.counters["generated_tokens"] += 1
        sp = req.sampling
        if sp.logprobs is not None and chosen is not None:
            ids, lps = np.asarray(top[0])[row], np.asarray(top[1])[row]
            entry = {"token_id": token, "logprob": float(np.asarray(chosen)[row]),
                     "top": [(int(i), float(lp)) for i, lp in zip(ids[:sp.logprobs], lps[:sp.logprobs])]}
            req.logprobs = (req.logprobs or []) + [entry]
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.stop_ids):
            req.finish_reason = "stop"
            return
        if req.grammar is not None and not req.grammar.accept(token):
            log.error("request %s: its grammar refused token %d: %s", req.id, token, req.grammar.error)
            req.finish_reason = "error"
            return
        if req.detokenizer is not None:
            req.text += req.detokenizer.push(token)
            for s in sp.stop:
                at = req.text.find(s, max(0, req.emitted_text - len(s) + 1))
                if at >= 0:
                    req.text = req.text[:at + len(s)] if sp.include_stop_str_in_output else req.text[:at]
                    req.finish_reason = "stop"
                    req.detokenizer = None  # the text ends here: nothing buffered may follow it
                    return
        if req.grammar is not None and req.grammar.done:
            req.finish_reason = "stop"  # the grammar is complete and allows only EOS
        elif len(req.output) >= sp.max_tokens or req.computed + 1 >= self.max_model_len:
            req.finish_reason = "length"

    def prompt_scored(self, req: Request, parts) -> None:
        """The prompt logprobs' event: `parts` are each prefill pass's (first position, the runner's scores), in
        order, whose row i predicted the prompt token at position + i + 1; the first token has no entry (None)."""
        n, top = req.num_prompt, req.sampling.prompt_logprobs
        entries: list[dict | None] = [None]
        for base, scores in parts:
            chosen, ids, lps = (np.asarray(x) for x in scores)
            for row in range(min(len(chosen), n - 1 - base)):
                entries.append({"token_id": int(req.prompt_ids[base + row + 1]), "logprob": float(chosen[row]),
                                "top": [(int(i), float(lp)) for i, lp in zip(ids[row, :top], lps[row, :top])]})
        if len(entries) != n:
            raise RuntimeError(f"request {req.id}: {len(entries)} prompt logprobs for {n} prompt tokens")
        self.deliver(req, StreamEvent(req.id, (), "", None, None, None, prompt_logprobs=tuple(entries)))

    def admitted(self, req: Request) -> None:
        """The first event: no tokens yet, the usage with cached_tokens fixed at admission (spec §8.3)."""
        self.deliver(req, StreamEvent(req.id, (), "", None, req.usage(), req.metrics()))

    def progress(self, req: Request) -> None:
        """An event with the tokens and text not sent yet, holding back text a stop string may still claim."""
        hold = max((len(s) - 1 for s in req.sampling.stop), default=0)
        tokens, delta, lp = self._take_unsent(req, max(req.emitted_text, len(req.text) - hold))
        self.deliver(req, StreamEvent(req.id, tokens, delta, None, None, None, lp))

    def last(self, req: Request, reason: str, error: str | None = None) -> None:
        """The final event: everything not sent yet, the finish reason, usage and metrics."""
        req.finish_reason = reason
        if req.detokenizer is not None and reason in ("stop", "length"):
            req.text += req.detokenizer.flush()
        tokens, delta, lp = self._take_unsent(req, len(req.text))
        self.counters[f"finished_{reason}"] += 1
        self.deliver(req, StreamEvent(req.id, tokens, delta, reason, req.usage(), req.metrics(), lp, error))

    @staticmethod
    def _take_unsent(req: Request, text_upto: int):
        """The tokens, text up to `text_upto` and logprobs not yet sent, marked as sent."""
        tokens = tuple(req.output[req.emitted_tokens:])
        delta = req.text[req.emitted_text:text_upto]
        lp = tuple(req.logprobs[-len(tokens):]) if req.logprobs and tokens else None
        req.emitted_tokens, req.emitted_text = len(req.output), text_upto
        return tokens, delta, lp

    @staticmethod
    def deliver(req: Request, event: StreamEvent) -> None:
        try:
            req.sink(event)
        except Exception:  # a consumer's callback must not take the engine down for everyone
            log.exception("event sink of %s raised; the request keeps running", req.id)
