"""Structured output: a request's `response_format` compiled by llguidance into a matcher that, before each token,
yields the packed mask of the tokens the grammar allows, and advances by each token the host accepts.

Compilation runs in the caller's thread at submit time (`GrammarCompiler.prepare`), never on the engine's: a
schema's first compile can take a good fraction of a second. Compiled grammars are kept by their JSON text, so a
repeated schema costs one matcher copy. The engine's thread only computes masks and consumes tokens.
"""

from __future__ import annotations

import collections
import json
import threading

import numpy as np

from ninfer_jax.runtime.request import InvalidRequestError
from ninfer_jax.runtime.sampling import SamplingParams, mask_words

# Compact separators and no free whitespace: a model cannot pad its JSON with whitespace until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHED_GRAMMARS = 64


class Grammar:
    """One request's matcher. Used by the engine's thread only, after `GrammarCompiler.prepare`."""

    def __init__(self, matcher, words: int):
        self._matcher, self.words = matcher, words

    def fill_mask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into row (int32 [words], C-contiguous), bit t % 32 of word t // 32."""
        assert row.dtype == np.int32 and row.shape == (self.words,) and row.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def mask(self) -> np.ndarray:
        row = np.empty(self.words, np.int32)
        self.fill_mask(row)
        return row

    def accept(self, token: int) -> bool:
        """Advances by a sampled token; False when the grammar refuses it (it then stays in an error state)."""
        return bool(self._matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but EOS: the request ends here."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Validates a request's logit-processing token ids and compiles its response_format, in the caller's
    thread. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(int(t) for t in eos_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None  # llguidance's view of the vocabulary, built on first use (about a second)
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()

    def prepare(self, sp: SamplingParams) -> Grammar | None:
        """Raises InvalidRequestError for logit_bias or allowed_token_ids ids outside the vocabulary or a
        response_format the grammar library refuses; returns the request's Grammar, None without a response_format."""
        for name, ids in (("logit_bias", sp.logit_bias or {}), ("allowed_token_ids", sp.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): "
                                          f"{bad[:5]}")
        if sp.response_format is None:
            return None
        if self._tokenizer is None:
            raise InvalidRequestError("response_format needs the checkpoint's tokenizer files")
        key = json.dumps(sp.response_format, sort_keys=True)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
        if template is None:
            template = self._compile(sp.response_format)
            with self._lock:
                self._compiled[key] = template
                while len(self._compiled) > _CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return Grammar(template.deep_copy(), mask_words(self.vocab_size))

    def _compile(self, response_format: dict):
        import llguidance

        kind = response_format["type"]
        field = "json_schema" if kind == "json_object" else kind
        try:
            if kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(response_format["regex"])
            elif kind == "grammar":
                grammar = llguidance.LLMatcher.grammar_from_lark(response_format["grammar"])
            elif kind == "choice":  # one Lark rule of the choices as quoted literals
                grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in response_format["choice"]))
            else:
                schema = {"type": "object"} if kind == "json_object" else response_format["json_schema"].get(
                    "schema", {})
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"response_format.{field}: {e}") from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"response_format.{field} is not supported: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self):
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self.vocab_size,
                                                            eos_token=self._eos or None)
            return self._ll_tokenizer


def allowed_tokens(reqs, lanes: int, words: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The logit processing of a step whose requests `reqs` each hold a lane: (allowed-token masks int32
    [lanes, words], all bits set but for lanes with a grammar, allowed_token_ids, bad_words or a thinking budget,
    which take each, the budget's forced end of thinking last; bool [lanes], the lanes that process their logits), or
    None when none of them does (the plain samplers run)."""
    processing = [r.processes_logits() for r in reqs]
    if not any(processing):
        return None
    allowed = np.full((lanes, words), -1, np.int32)
    processed = np.zeros(lanes, bool)
    for r, processes in zip(reqs, processing):
        processed[r.lane] = processes
        if r.grammar is not None:
            r.grammar.fill_mask(allowed[r.lane])
        if r.allowed is not None:
            allowed[r.lane] &= r.allowed
        if r.bad_words is not None:
            r.bad_words.apply(allowed[r.lane], r.output)
        if r.thinking is not None:
            r.thinking.apply(allowed[r.lane], r.output)
    return allowed, processed
