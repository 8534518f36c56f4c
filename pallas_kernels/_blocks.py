"""Triton's block rule, shared by the kernels: every block side is a power of two (and a matrix product's sides are
at least 16, the smallest tensor-core tile)."""

from __future__ import annotations


def is_pow2(n: int, minimum: int = 1) -> bool:
    """Whether n is a power of two and at least `minimum`."""
    return n >= minimum and n & (n - 1) == 0
