"""SamplingParams (vLLM's field names), the on-device sampler the jitted steps end with, and the log-probabilities
a round computes only when a request asks for them.

Sampling runs inside the step so only token ids leave the device, never the [B, vocab] logits. Per-lane
parameters arrive as arrays; the sampler's variant (greedy only, or full temperature / top-k / top-p) is static,
so each is one compiled program. `token_logprobs` is a program of its own over the logits a step leaves on the
device: a round whose requests ask for no logprobs does not pay for a log-softmax and a top-20 over the
vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's names and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    prefix_cache: bool = True  # not vLLM's: False = a disabled request, which neither reads nor adds to the cache

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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclasses.dataclass
class SamplerInputs:
    """Host-side per-lane sampler arrays ([B] each), filled in place by the scheduler."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray  # uint32 per lane
    step: np.ndarray  # int32: tokens generated so far, folded into the key

    @classmethod
    def empty(cls, lanes: int) -> "SamplerInputs":
        return cls(
            temperature=np.zeros(lanes, np.float32),
            top_k=np.zeros(lanes, np.int32),
            top_p=np.ones(lanes, np.float32),
            seed=np.zeros(lanes, np.uint32),
            step=np.zeros(lanes, np.int32),
        )

    def set_lane(self, lane: int, sp: SamplingParams, seed: int, step: int) -> None:
        self.temperature[lane] = 0.0 if sp.greedy else sp.temperature
        self.top_k[lane] = max(sp.top_k, 0)
        self.top_p[lane] = sp.top_p
        self.seed[lane] = seed & 0xFFFFFFFF
        self.step[lane] = step

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The five arrays in step order, not copied: the runner copies what it hands to a step."""
        return self.temperature, self.top_k, self.top_p, self.seed, self.step


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
      logits: [B, V] float32. inputs: (temperature, top_k, top_p, seed, step), each [B].
      full: static; False compiles greedy argmax only (every lane must be greedy).
    Returns:
      tokens [B] int32.
    """
    temperature, top_k, top_p, seed, step = inputs
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not full:
        return greedy
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    keep = keep & (before < top_p[:, None])  # the top token always survives
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(row, s, n):
        key = jax.random.fold_in(jax.random.PRNGKey(s), n)
        return jax.random.categorical(key, row)

    picked = jax.vmap(draw)(masked, seed, step)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def token_logprobs(logits, tokens, *, num_logprobs: int = MAX_LOGPROBS, top_k_groups: int = 0):
    """The log-probabilities (of the unscaled distribution, as vLLM reports them) of the chosen tokens and the top
    `num_logprobs` alternatives: logits [B, V] float32, tokens [B] -> (chosen [B], (top ids [B, n] int32, top
    logprobs [B, n])). top_k_groups: static; the top-k runs in two stages over this many groups (0: lax.top_k)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_ids = grouped_top_k(logp, num_logprobs, top_k_groups)
    return chosen, (top_ids.astype(jnp.int32), top_lp)
