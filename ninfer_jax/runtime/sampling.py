"""SamplingParams (vLLM's field names), the on-device sampler the jitted steps end with, and the log-probabilities
a round computes only when a request asks for them.

Sampling runs inside the step so only token ids leave the device, never the [B, vocab] logits. Per-lane
parameters arrive as arrays; the sampler's variant (greedy only, or full temperature / top-k / top-p) is static,
so each is one compiled program. `token_logprobs` is a program of its own over the logits a step leaves on the
device: a round whose requests ask for no logprobs does not pay for a log-softmax and a top-20 over the
vocabulary.

Logit processing (vLLM's order: allowed-token mask, min_tokens, logit_bias, then the repetition, frequency and
presence penalties) is a third variant, `process_logits`, run only by steps with a lane that asks for it. Its
per-lane statistics live in a `SamplerState` on the device: written for a lane at admission (`lane_row`,
`set_lane_row`), and counted up by each processing step with the tokens it samples.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound)
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2]
BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100]
# OpenAI's three, then vLLM's structured outputs (guided_regex, guided_choice, guided_grammar) in the same shape:
# {"type": "regex", "regex": "..."}, {"type": "choice", "choice": ["...", ...]}, {"type": "grammar", "grammar": Lark}
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


# generation_config.json fields that become SamplingParams defaults (vLLM's --generation-config auto takes these)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(path: str | Path) -> dict:
    """The SamplingParams defaults a Hugging Face generation_config.json sets (GENERATION_CONFIG_FIELDS), as vLLM
    applies them to requests that leave those fields unset; {} when the file does not exist. Raises ValueError
    naming the file for malformed JSON or a value SamplingParams refuses."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if raw.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    return defaults


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's names and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest are cut (0: off)
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # the text leaves out special tokens (the token ids keep them)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    # number of top logprobs per prompt token (0: only the prompt's own); such a request computes its whole prompt
    prompt_logprobs: int | None = None
    prefix_cache: bool = True  # not vLLM's: False = a disabled request, which neither reads nor adds to the cache
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # stop tokens are masked until this many tokens were generated
    allowed_token_ids: tuple[int, ...] | list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: tuple[str, ...] | list[str] | None = None  # vLLM's: words the output may not complete (bad_words.py)
    # vLLM's: only the prompt's last k tokens are kept (-1: as many as max_model_len leaves room for one output token)
    truncate_prompt_tokens: int | None = None
    # OpenAI's shape: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}};
    # None or {"type": "text"}: unconstrained. The engine compiles it to a grammar at submit time.
    response_format: dict | None = None
    # vLLM's thinking_token_budget, Anthropic's thinking.budget_tokens: tokens the output may think for when it starts
    # inside the model's reasoning (`<think>` ends the prompt); past them the end of thinking is forced
    # (thinking_budget.py).
    thinking_budget: int | None = None
    # vLLM's request priority: with scheduling_policy "priority", waiting requests get a lane lower values first,
    # arrival breaking ties; it must be 0 under "fcfs". Not sampling, but it travels with the request's settings.
    priority: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, numbers.Integral) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {n!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if not isinstance(self.priority, numbers.Integral) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        self._check_processing()

    def _check_processing(self) -> None:
        """Validates and normalises the logit-processing fields (vLLM's ranges)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
        if not _real(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias) or None)
        if self.allowed_token_ids is not None:
            ids = _items(self.allowed_token_ids)
            if ids is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                                      for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of token ids >= 0, got {self.allowed_token_ids!r}")
            if not ids:
                raise ValueError("allowed_token_ids must not be empty")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in ids})))
        budget = self.thinking_budget
        if budget is not None and (not isinstance(budget, numbers.Integral) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"thinking_budget must be an integer >= 0, got {budget!r}")
        if self.bad_words is not None:
            words = _items(self.bad_words)
            if words is None or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            object.__setattr__(self, "bad_words", words or None)
        fmt = self.response_format
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS:
                raise ValueError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}")
            if fmt["type"] == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                    raise ValueError("response_format.json_schema must be an object whose schema is a JSON schema")
            kind = fmt["type"]
            if kind in ("regex", "grammar") and (not isinstance(fmt.get(kind), str) or not fmt[kind]):
                raise ValueError(f"response_format.{kind} must be a non-empty string")
            if kind == "choice" and (not isinstance(fmt.get("choice"), list) or not fmt["choice"]
                                     or not all(isinstance(c, str) and c for c in fmt["choice"])):
                raise ValueError("response_format.choice must be a non-empty list of non-empty strings")
            if kind == "text":
                object.__setattr__(self, "response_format", None)

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request reads and adds to the prefix cache: not when disabled, nor with prompt logprobs, which
        need every prompt position's logits (a disabled request then: vLLM skips the cache for them too)."""
        return self.prefix_cache and self.prompt_logprobs is None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Whether every token's logits need `process_logits` (penalties, bias, min_tokens, allowed tokens, bad words
        or a grammar). A thinking budget needs it only where it may bind (`Request.processes_logits`)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
                or self.bad_words is not None or self.response_format is not None)

    def samples(self, n: int) -> list[SamplingParams]:
        """The samplings of n samples of one prompt (vLLM's `n`): with a seed s, sample i draws with seed s + i, so
        each differs and all repeat; unseeded, each draws its own seed."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        return [self if self.seed is None else dataclasses.replace(self, seed=self.seed + i) for i in range(n)]


def check_truncate_prompt_tokens(k) -> None:
    """Raises ValueError unless `k` is None, -1 or an integer >= 1 (vLLM's truncate_prompt_tokens)."""
    if k is not None and (not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1 and k != -1):
        raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k!r}")


def _items(x) -> tuple | None:
    """A list-like field's items as a tuple (read once, so a generator serves too); None for a string, a mapping or
    a scalar."""
    if isinstance(x, (str, bytes, Mapping)) or not hasattr(x, "__iter__"):
        return None
    return tuple(x)


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _checked_bias(bias) -> dict[int, float]:
    """logit_bias with int keys (OpenAI sends strings) and bounded float values; raises ValueError."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or isinstance(key, bool):
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        if not _real(value) or not -BIAS_RANGE <= value <= BIAS_RANGE:
            raise ValueError(f"logit_bias values must be in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {value!r}")
        out[token] = float(value)
    return out


@dataclasses.dataclass
class SamplerInputs:
    """Host-side per-lane sampler arrays ([B] each), filled in place by the scheduler."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray  # uint32 per lane
    step: np.ndarray  # int32: tokens generated so far, folded into the key
    min_p: np.ndarray

    @classmethod
    def empty(cls, lanes: int) -> "SamplerInputs":
        return cls(
            temperature=np.zeros(lanes, np.float32),
            top_k=np.zeros(lanes, np.int32),
            top_p=np.ones(lanes, np.float32),
            seed=np.zeros(lanes, np.uint32),
            step=np.zeros(lanes, np.int32),
            min_p=np.zeros(lanes, np.float32),
        )

    def set_lane(self, lane: int, sp: SamplingParams, seed: int, step: int) -> None:
        self.temperature[lane] = 0.0 if sp.greedy else sp.temperature
        self.top_k[lane] = max(sp.top_k, 0)
        self.top_p[lane] = sp.top_p
        self.seed[lane] = seed & 0xFFFFFFFF
        self.step[lane] = step
        self.min_p[lane] = sp.min_p

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays in step order (the step fifth), not copied: the runner copies what it hands to a step."""
        return self.temperature, self.top_k, self.top_p, self.seed, self.step, self.min_p


# Groups of the two-stage top-k on the GPU, where lax.top_k over the whole vocabulary sorts; on CPU lax.top_k is the
# faster (docs/kernels_notes.md).
TOP_K_GROUPS = 64


def grouped_top_k(x, k: int, groups: int = 0):
    """lax.top_k(x, k) over the last axis of x [B, V], the same values and ids (ties: lower id first).

    groups > 0 takes the top k of each of `groups` slices of V first, then the top k of those candidates: every
    entry of the global top k is in its slice's top k, and candidates keep id order within equal values."""
    if groups <= 0 or x.shape[-1] < 2 * groups * k:
        return jax.lax.top_k(x, k)
    b, v = x.shape
    pad = -v % groups
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    width = x.shape[1] // groups
    vals, ids = jax.lax.top_k(x.reshape(b, groups, width), k)  # [B, groups, k]
    ids = ids + (jnp.arange(groups, dtype=ids.dtype) * width)[None, :, None]
    top, pos = jax.lax.top_k(vals.reshape(b, groups * k), k)
    return top, jnp.take_along_axis(ids.reshape(b, groups * k), pos, axis=1)


def sample(logits, inputs, *, full: bool):
    """Pick one token per row.

    Args:
      logits: [B, V] float32. inputs: (temperature, top_k, top_p, seed, step, min_p), each [B].
      full: static; False compiles greedy argmax only (every lane must be greedy).
    Returns:
      tokens [B] int32.
    """
    temperature, top_k, top_p, seed, step, min_p = inputs
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not full:
        return greedy
    order, masked = filtered_sorted(logits, temperature, top_k, top_p, min_p)
    picked = jax.vmap(lambda row, s, n: jax.random.categorical(sampling_key(s, n), row))(masked, seed, step)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sampling_key(seed, step):
    """The key of a lane's draw for its `step`-th token: a token's randomness depends on its seed and place only."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def filtered_sorted(logits, temperature, top_k, top_p, min_p):
    """The distribution `sample` draws from, as (order [B, V]: token ids by falling logit, masked [B, V]: their
    scaled logits, -inf where min-p, top-k or top-p cut them; vLLM's order: min-p, then top-k, then top-p over what
    is left). A temperature of 0 scales by 1 (greedy rows take argmax)."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # p >= min_p * p_max, in scaled logits: no normalisation needed, and the likeliest token always survives
    keep = keep & (sorted_logits >= sorted_logits[:, :1] + jnp.log(min_p)[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    keep = keep & (before < top_p[:, None])  # the top token always survives
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def token_logprobs(logits, tokens, *, num_logprobs: int = MAX_LOGPROBS, top_k_groups: int = 0):
    """The log-probabilities (of the unscaled distribution, as vLLM reports them) of the chosen tokens and the top
    `num_logprobs` alternatives: logits [B, V] float32, tokens [B] -> (chosen [B], (top ids [B, n] int32, top
    logprobs [B, n])). top_k_groups: static; the top-k runs in two stages over this many groups (0: lax.top_k)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_ids = grouped_top_k(logp, num_logprobs, top_k_groups)
    return chosen, (top_ids.astype(jnp.int32), top_lp)


# --- logit processing: penalties, logit_bias, min_tokens, allowed-token masks ---------------------------------

def mask_words(vocab: int) -> int:
    """int32 words of a packed token bitmask over `vocab` ids (bit v % 32 of word v // 32)."""
    return -(-vocab // 32)


def pack_token_bits(ids, vocab: int) -> np.ndarray:
    """The ids' bitmask, int32 [mask_words(vocab)] (llguidance's layout); ids outside [0, vocab) are ignored."""
    ids = np.asarray(ids, np.int64)
    ids = ids[(ids >= 0) & (ids < vocab)]
    bits = np.zeros(mask_words(vocab) * 32, bool)
    bits[ids] = True
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(np.int32)[:, 0]


def unpack_token_bits(words, vocab: int):
    """Inside a step: packed bitmasks [R, W] int32 -> bool [R, vocab]."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (words[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 of a negative word still lands in bit 0
    return bits.reshape(words.shape[0], -1)[:, :vocab] != 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Per-lane logit-processing state on the device, owned by the runner and donated to the steps that process
    logits. `set_lane_row` (at admission) is the only writer besides those steps, which count sampled tokens."""

    counts: jax.Array  # [C, V] int32: occurrences of each token in the lane's output
    prompt: jax.Array  # [C, W] int32: bitmask of the prompt's tokens (repetition_penalty)
    stops: jax.Array  # [C, W] int32: bitmask of the stop tokens min_tokens holds back
    bias_ids: jax.Array  # [C, MAX_LOGIT_BIAS] int32: logit_bias ids, padded with V (dropped)
    bias: jax.Array  # [C, MAX_LOGIT_BIAS] float32
    params: jax.Array  # [C, 4] float32: presence, frequency, repetition penalty, min_tokens

    @classmethod
    def empty(cls, lanes: int, vocab: int) -> "SamplerState":
        w = mask_words(vocab)
        return cls(jnp.zeros((lanes, vocab), jnp.int32), jnp.zeros((lanes, w), jnp.int32),
                   jnp.zeros((lanes, w), jnp.int32), jnp.full((lanes, MAX_LOGIT_BIAS), vocab, jnp.int32),
                   jnp.zeros((lanes, MAX_LOGIT_BIAS), jnp.float32), jnp.zeros((lanes, 4), jnp.float32))


def lane_row(sp: SamplingParams, prompt_ids, stop_ids, vocab: int) -> np.ndarray:
    """A lane's SamplerState row packed as int32 [2 W + 2 MAX_LOGIT_BIAS + 4] (floats bit-cast): prompt bits,
    stop bits (the request's stop ids, and `stop_ids` unless it ignores EOS), bias ids, biases, params."""
    stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(stop_ids))
    ids = np.full(MAX_LOGIT_BIAS, vocab, np.int32)
    bias = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (token, value) in enumerate((sp.logit_bias or {}).items()):
        ids[i], bias[i] = token, value
    params = np.array([sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens], np.float32)
    return np.concatenate([pack_token_bits(prompt_ids, vocab), pack_token_bits(stops, vocab), ids,
                           bias.view(np.int32), params.view(np.int32)])


def set_lane_row(state: SamplerState, lane, row, counts) -> SamplerState:
    """Inside a program: the lane's row from `lane_row` and its output counts ([V] int32: zeros, or a preempted
    request's output so far)."""
    w = state.prompt.shape[1]
    b = MAX_LOGIT_BIAS
    as_f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    return SamplerState(state.counts.at[lane].set(counts), state.prompt.at[lane].set(row[:w]),
                        state.stops.at[lane].set(row[w:2 * w]), state.bias_ids.at[lane].set(row[2 * w:2 * w + b]),
                        state.bias.at[lane].set(as_f32(row[2 * w + b:2 * w + 2 * b])),
                        state.params.at[lane].set(as_f32(row[2 * w + 2 * b:])))


def process_logits(logits, state: SamplerState, lanes, step, allowed):
    """vLLM's logit processing, in its order: the allowed-token mask, min_tokens, logit_bias, then the
    repetition, frequency and presence penalties.

    Args:
      logits: [R, V] float32. state: the SamplerState. lanes: [R] int32, each row's lane (C or past: padding).
      step: [R] int32, tokens the row's lane generated so far. allowed: [R, W] int32 packed allowed tokens.
    Returns:
      The processed logits [R, V].
    """
    v = logits.shape[1]
    row = lambda x, fill: x.at[lanes].get(mode="fill", fill_value=fill)  # noqa: E731
    params = row(state.params, 1.0)
    presence, frequency, repetition, min_tokens = (params[:, i:i + 1] for i in range(4))
    logits = jnp.where(unpack_token_bits(allowed, v), logits, -jnp.inf)
    held = unpack_token_bits(row(state.stops, 0), v) & (step[:, None] < min_tokens)
    logits = jnp.where(held, -jnp.inf, logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, row(state.bias_ids, v)].add(row(state.bias, 0.0), mode="drop")
    counts = row(state.counts, 0)
    in_output = counts > 0
    seen = unpack_token_bits(row(state.prompt, 0), v) | in_output
    penalty = jnp.where(seen, repetition, 1.0)
    logits = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency * counts - presence * in_output


def count_tokens(state: SamplerState, lanes, tokens) -> SamplerState:
    """The state after the rows' lanes sampled `tokens` ([R] each; padding rows' lanes are past C: dropped)."""
    return dataclasses.replace(state, counts=state.counts.at[lanes, tokens].add(1, mode="drop"))
