"""Triton's block rule, shared by the kernels: every block side is a power of two (and a matrix product's sides are
at least 16, the smallest tensor-core tile)."""

from __future__ import annotations


def is_pow2(n: int, minimum: int = 1) -> bool:
    """Whether n is a power of two and at least `minimum`."""
    return n >= minimum and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two at or above n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
