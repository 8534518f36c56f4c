"""Speculative decoding: drafts proposed on the host (prompt lookup), and the exact rule by which a verify step keeps
them.

A verify round feeds each lane its last token and up to k drafts; the target's logits at those rows decide how many
drafts stand (`accept_drafts`, on the device, inside the step) and which token follows them. Greedy lanes keep the
longest prefix of drafts equal to the target's argmax; sampling lanes run rejection sampling against a one-hot draft
(vLLM's rule for drafts without probabilities), which leaves each token's distribution exactly the target's.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.runtime.sampling import filtered_sorted, sampling_key


class NgramProposer:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last n tokens, for the
    longest n in [n_min, n_max] that occurs (vLLM's prompt_lookup_min / prompt_lookup_max)."""

    def __init__(self, k: int, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max, got {n_min}..{n_max}")
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, tokens: np.ndarray, limit: int) -> np.ndarray:
        """Up to min(k, limit) drafts to follow `tokens` (int32 [L]); empty when no n-gram recurs."""
        want, size = min(self.k, limit), len(tokens)
        if want <= 0 or size < 2:
            return tokens[:0]
        # Where an earlier n-gram could end: the last token's earlier occurrences (one pass over the sequence);
        # the longer n-grams are checked at those places only.
        ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            at = ends[ends >= n - 1]
            for j in range(1, n):
                at = at[tokens[at - j] == tokens[size - 1 - j]]
            if len(at):
                # The continuation, extended as a repeat of itself when the match ends less than `want` tokens
                # before the end: what looking up again after each draft would propose.
                start = at[-1] + 1
                return tokens[start + np.arange(want) % (size - start)]
        return tokens[:0]


def stop_hits(emitted, stop_mask, stops, lane_stops):
    """Which of B lanes' tokens [B, ...] end them: the engine's stop tokens (stop_mask [V]) where stops [B] is set,
    and each lane's own stop ids (lane_stops [B, S], -1 for none) always, as `OutputProcessor.accept` decides."""
    expand = (slice(None),) + (None,) * (emitted.ndim - 1)
    own = jnp.any(emitted[..., None] == lane_stops[expand + (slice(None),)], axis=-1)
    return (stops[expand] & stop_mask[emitted]) | own


def accept_drafts(logits, tokens, counts, sampler, stop_mask, stops, lane_stops, *, full: bool):
    """The verify rule for B lanes of T rows.

    Args:
      logits: [B, T, V] float32; row t of lane b was fed tokens[b, t] (row 0 the last token, rows 1.. the drafts).
      tokens: [B, T] int32. counts: [B] rows fed (1 + drafts; 0: inactive).
      sampler: (temperature, top_k, top_p, seed, step, min_p), each [B]; step is the index of the token row 0 emits.
      stop_mask: [V] bool, the engine's stop tokens; stops: [B] bool, lanes those end (not ignore_eos);
        lane_stops: [B, S] int32, each lane's own stop ids (-1: none), which end it always.
      full: static; False: every lane greedy.
    Returns:
      (emitted [B, T] int32: the lane's tokens, valid through row kept; kept [B] int32: the drafts kept, so
      kept + 1 tokens are emitted and rows 0..kept are the ones the lane's state keeps; ended [B] bool: the token at
      row kept stops the lane). A stop token ends the emitted tokens.
    """
    b, t, v = logits.shape
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)  # row t's draft to judge
    has_draft = rows < (counts - 1)[:, None]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    ok, token = following == greedy, greedy
    if full:
        temperature, top_k, top_p, seed, step, min_p = sampler
        each = lambda x: jnp.repeat(x, t)  # noqa: E731  (per lane -> per row)
        flat_draft = following.reshape(-1)
        order, masked = filtered_sorted(logits.reshape(b * t, v), each(temperature), each(top_k), each(top_p),
                                        each(min_p))
        p_draft = jnp.sum(jnp.where(order == flat_draft[:, None], jax.nn.softmax(masked, axis=-1), 0.0), axis=-1)
        keys = jax.vmap(sampling_key)(each(seed), (step[:, None] + rows).reshape(-1))
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys)
        # A rejected draft: the next token from the target's distribution without it. A row with no draft to judge
        # draws exactly as a plain round would (same key, same distribution).
        judged = has_draft.reshape(-1)[:, None]
        residual = jnp.where(judged & (order == flat_draft[:, None]), -jnp.inf, masked)
        picked = jax.vmap(jax.random.categorical)(keys, residual)
        drawn = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32).reshape(b, t)
        sampling = (temperature > 0)[:, None]
        ok = jnp.where(sampling, (u < p_draft).reshape(b, t), ok)
        token = jnp.where(sampling, drawn, greedy)
    kept = jnp.sum(jnp.cumprod((ok & has_draft).astype(jnp.int32), axis=1), axis=1)
    emitted = jnp.where(rows < kept[:, None], following, token)
    ends = stop_hits(emitted, stop_mask, stops, lane_stops) & (rows <= kept[:, None])
    ended = ends.any(axis=1)  # then the first stop at or before row kept is the new row kept
    kept = jnp.minimum(kept, jnp.where(ended, jnp.argmax(ends, axis=1), t)).astype(jnp.int32)
    return emitted, kept, ended


class DraftPause:
    """When speculation pauses: after DRY_ROUNDS rounds in a row that could have verified drafts and found none, the
    next PAUSE_ROUNDS rounds decode plainly (one in flight while the previous is read), unless a lookup on the tokens
    read finds a draft first (`resume`)."""

    DRY_ROUNDS = 2
    PAUSE_ROUNDS = 16

    def __init__(self):
        self.dry = self.left = self.pauses = 0  # rounds in a row without a draft; plain rounds left; pauses so far

    @property
    def paused(self) -> bool:
        return self.left > 0

    def found(self, any_draft: bool) -> None:
        """A round that could have speculated found a draft for some lane, or none."""
        self.dry = 0 if any_draft else self.dry + 1
        if self.dry >= self.DRY_ROUNDS:
            self.dry, self.left = 0, self.PAUSE_ROUNDS
            self.pauses += 1

    def plain_round(self) -> None:
        self.left = max(0, self.left - 1)

    def resume(self) -> None:
        self.left = 0


class SpeculativeStats:
    """Counts of drafted and accepted tokens and the accept-length histogram (tokens emitted per lane and round)."""

    def __init__(self, k: int):
        self.k = k
        self.rounds = self.drafted = self.accepted = self.plain_rounds = 0
        self.histogram = collections.Counter()

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.histogram[accepted + 1] += 1

    def as_dict(self) -> dict:
        lanes = sum(self.histogram.values())
        return {"num_speculative_tokens": self.k, "verify_rounds": self.rounds, "plain_rounds": self.plain_rounds,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accept_length": sum(n * c for n, c in self.histogram.items()) / lanes if lanes else 0.0,
                "accept_length_histogram": {n: self.histogram[n] for n in range(1, self.k + 2)}}


class _Window:
    """The tokens and seconds of the last `size` steady rounds of one kind and width, with their sums (a ring: no
    allocation a round)."""

    __slots__ = ("tokens", "seconds", "total_tokens", "total_seconds", "rounds")

    def __init__(self, size: int):
        self.tokens, self.seconds = [0] * size, [0.0] * size
        self.total_tokens, self.total_seconds, self.rounds = 0, 0.0, 0

    def add(self, tokens: int, seconds: float) -> None:
        i = self.rounds % len(self.tokens)
        self.total_tokens += tokens - self.tokens[i]
        self.total_seconds += seconds - self.seconds[i]
        self.tokens[i], self.seconds[i] = tokens, seconds
        self.rounds += 1

    @property
    def rate(self) -> float:
        return self.total_tokens / self.total_seconds


class RoundChoice:
    """Whether speculation pays (issue 30), from the rounds the engine ran: per width (the decoding lanes, to a power
    of two), the tokens each kind of round emits per second of wall clock, as the sum of tokens over the sum of
    seconds of its last WINDOW steady rounds: one host-bound round's time is noisy, a sum over many is not, and a
    ratio of sums weighs each round by its time where a mean of per-round rates would favour short rounds. While
    verify rounds emit at least plain rounds' rate they run; once they fall behind, PROBE_AFTER plain rounds follow
    and speculation is measured again (acceptance and contexts change). A width whose plain rate is unknown runs
    MEASURE plain rounds first. The scheduler times each round from the read of the one before it, counting only
    rounds of one kind and width in a row with no prefill pass between them (`Scheduler._measure`)."""

    # Steady rounds of a kind that make its rate known. Host-bound rounds range 0.6-1.6 ms: one slow round among 8
    # fast ones moves their sum by about 20%, as much as verifying gains at 1 lane; among 16 by half that.
    MEASURE = 16
    WINDOW = 32  # steady rounds in a rate: enough to outweigh a slow one, few enough to follow changed acceptance
    PROBE_AFTER = 64  # plain rounds before a width that chose them tries speculation again

    def __init__(self):
        self.windows: dict[tuple[bool, int], _Window] = {}  # (verify, width) -> its last steady rounds
        self.plain_left = 0  # plain rounds to run before speculation is tried again
        self.chose_plain = 0  # times speculation measured slower than plain decoding

    @staticmethod
    def width(lanes: int) -> int:
        return 1 << max(0, lanes - 1).bit_length()

    def _known(self, key: tuple[bool, int]) -> _Window | None:
        window = self.windows.get(key)
        return window if window is not None and window.rounds >= self.MEASURE else None

    def speculate(self, lanes: int) -> bool:
        """Whether a round of `lanes` decoding lanes should verify drafts."""
        if self.plain_left:
            return False
        w = self.width(lanes)
        verify = self._known((True, w))
        if verify is None:
            return True  # measure speculation first: that is what was asked for
        plain = self._known((False, w))
        if plain is None:
            self.plain_left = self.MEASURE + 2  # the first of a run and one read late do not count
            return False
        # Exact, no margin: speculation was asked for, and where it keeps pace it runs (8 lanes: never slower).
        if verify.rate >= plain.rate:
            return True
        self.chose_plain += 1
        self.plain_left = self.PROBE_AFTER
        del self.windows[(True, w)]  # measured afresh after the plain rounds
        return False

    def plain_round(self) -> None:
        self.plain_left = max(0, self.plain_left - 1)

    def record(self, verify: bool, lanes: int, tokens: int, seconds: float) -> None:
        """A steady round of `lanes` lanes emitted `tokens` tokens in `seconds` since the round before it."""
        if seconds <= 0 or tokens <= 0:
            return
        key = (verify, self.width(lanes))
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = _Window(self.WINDOW)
        window.add(tokens, seconds)

    def as_dict(self) -> dict:
        return {"chose_plain": self.chose_plain,
                "tokens_per_s": {f"{'verify' if v else 'plain'}@{w}": round(window.rate, 1)
                                 for (v, w), window in sorted(self.windows.items()) if window.rounds >= self.MEASURE}}
