"""The bounded sets of shapes the engine compiles: prefill pass lengths, decode round widths, transfer batches.

Every step shape comes from one of these sets, so warmup can compile them all and serving never compiles.
"""

from __future__ import annotations

import dataclasses

# What a background compile (`ModelRunner.compile_rest`) leaves to the first warm-up: every request can be served
# with passes of this many tokens (the largest pass size up to it) and rounds of this many lanes.
FIRST_PASS_TOKENS = 1024
FIRST_LANES = 8


@dataclasses.dataclass(frozen=True)
class StepSizes:
    """The sizes each step is compiled at: prefill pass lengths (`prefill` for both samplers, `idle` for the
    greedy one), decode, mixed and verify round widths, image patch buckets, whether (`copies`) the cache's slot
    and page copies and Host transfers are compiled, and whether (`greedy`) the greedy-only sampler's programs are
    (without them every step samples with the full sampler, which takes the argmax for greedy rows too). Each tuple
    ascends."""

    prefill: tuple[int, ...]
    idle: tuple[int, ...] = ()
    decode: tuple[int, ...] = ()
    mixed: tuple[int, ...] = ()
    verify: tuple[int, ...] = ()
    patches: tuple[int, ...] = ()
    copies: bool = True
    greedy: bool = True

    def first(self) -> StepSizes:
        """The part that serves every request at the fewest programs: one pass size (the largest up to
        FIRST_PASS_TOKENS, the smallest where none is that small) and one round width (likewise up to FIRST_LANES),
        shorter passes and rounds padded to them; the full sampler only; the largest patch bucket (every image fits
        it); no idle passes or mixed steps (a pass and a round run as two steps). A warm start still traces every
        program it loads from jax's cache (the model's layers one by one, seconds each), so each program left out
        here is tracing it does not wait on."""
        def one(sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
            return tuple(s for s in sizes if s <= n)[-1:] or sizes[:1]

        return StepSizes(one(self.prefill, FIRST_PASS_TOKENS), (), one(self.decode, FIRST_LANES), (),
                         one(self.verify, FIRST_LANES), self.patches[-1:], self.copies, greedy=False)

    def has(self, kind: str, size: int, full: bool = True) -> bool:
        """Whether the program of step `kind` ("prefill", "decode", ...) at `size` with that sampler is among these."""
        return size in getattr(self, kind) and (full or self.greedy)


def prefill_buckets(prefill_chunk: int, smallest: int = 64, ratio: int = 4, step_floor: int = 512) -> tuple[int, ...]:
    """Chunk lengths compiled for prefill: smallest * ratio^k below the linear step, then every multiple of
    the step (a quarter of prefill_chunk, at least step_floor, 64-aligned) up to prefill_chunk.

    Short chunks are latency-bound, so a coarse geometric ladder costs little there; from step_floor tokens
    on a chunk is compute-bound and its padding is paid in full, so the ladder turns linear and pads by less
    than a quarter of the chunk (a resumed turn of 1.1k tokens runs as 1536, not 2048).
    """
    step = max(step_floor, prefill_chunk // 4 // smallest * smallest)
    sizes, n = [], smallest
    while n < min(step, prefill_chunk):
        sizes.append(n)
        n *= ratio
    n = step
    while n < prefill_chunk:
        sizes.append(n)
        n += step
    return tuple(sorted(set(sizes))) + (prefill_chunk,)


def idle_chunk_sizes(prefill_chunk: int, idle_prefill_chunk: int) -> tuple[int, ...]:
    """Pass lengths past prefill_chunk for a prompt no decode waits on: idle_prefill_chunk and its half (64-aligned)
    where each is longer than prefill_chunk. Two programs at most, whatever the ratio: a small prefill_chunk (chosen
    for the decode's sake) adds no more compiles."""
    if idle_prefill_chunk <= prefill_chunk:
        return ()
    half = idle_prefill_chunk // 2 // 64 * 64
    return ((half,) if half > prefill_chunk else ()) + (idle_prefill_chunk,)


def pow2_buckets(largest: int) -> tuple[int, ...]:
    """The powers of two below `largest`, then `largest`: the compiled sizes of decode rounds (lanes) and of page
    transfers. Any count is a sum of them (`split_transfer`), so no transfer moves a padding row (padding a 16-page
    write to a 64-page bucket moved 4x its bytes across PCIe), and a round pads to less than twice its lanes."""
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (largest,)


def fit(n: int, sizes: tuple[int, ...], what: str) -> int:
    """The smallest of the ascending compiled `sizes` that holds n; `what` names n in the error."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what.format(n)} exceeds the largest compiled size {sizes[-1]}")


def split_transfer(count: int, sizes: tuple[int, ...]) -> list[int]:
    """`count` pages as transfer batches of `sizes` (ascending, starting at 1), largest first, summing exactly
    to `count`: at most one batch of each size below the largest."""
    out = []
    for size in reversed(sizes):
        while count >= size:
            out.append(size)
            count -= size
    return out
