"""Byte-level BPE pieces shared by the tokenizer writer and the detokenizer.

tiktoken stores a BPE vocabulary as ranks only: encoding repeatedly joins the adjacent pair whose
concatenation has the lowest rank. Hugging Face `tokenizers` needs an explicit merge list instead;
`merges_from_ranks` rebuilds it so that both encode every text identically.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Reads a `.tiktoken` file (one `base64(token) rank` per line) into token bytes -> rank."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def byte_level_spelling(token: bytes) -> str:
    """The vocabulary spelling of a token: each byte through `bytes_to_unicode`."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order of the merged token, that makes BPE encode like tiktoken.

    For each multi-byte token t, tiktoken's own BPE is run over t's bytes alone; if it ends in t,
    its last join (a, b) is t's merge. This is the only way t can ever form: inside a longer text,
    t's bytes become one piece only if no join crossed its edges, and then the joins inside follow
    the same order as they do on t alone.

    NOTE: the simulation uses all ranks, not only those below t's. About 30 Qwen3.5 tokens (for
    example 人力资源) form only after a join of higher rank than their own; a merge list built from
    lower ranks only would spell them differently from tiktoken.
    """
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) > 1:
            last_join = _last_join(token, ranks)
            if last_join is not None:
                merges.append((rank, *last_join))
    merges.sort(key=lambda m: m[0])
    return [(left, right) for _, left, right in merges]


def _last_join(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Runs tiktoken's BPE over `token`; returns its final join if the result is `token` itself."""
    parts = [token[i : i + 1] for i in range(len(token))]
    rank_of = ranks.get
    while len(parts) > 2:
        best_rank, best_at = None, -1
        for i in range(len(parts) - 1):
            rank = rank_of(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, i
        if best_at < 0:
            return None
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None
