"""Puts a prompt's images on the device for its prefill passes: each image is encoded once into the runner's media
rows, and recently encoded ones stay there (an LRU by media digest), so a repeated image is not encoded again."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ninfer_jax.frontend.prepared_prompt import PreparedPrompt


class MediaRows:
    """Which images' encoder outputs the media rows hold. Rows are handed out in pages of PAGE_ROWS, so images of
    any size share the buffer without fragmenting it; an image's rows are its pages' rows in order.

    Invariant: every page is free or held by exactly one entry."""

    PAGE_ROWS = 16

    def __init__(self, rows: int):
        self.num_pages = rows // self.PAGE_ROWS
        self.free = list(range(self.num_pages))
        self.entries: OrderedDict[bytes, tuple[list[int], np.ndarray]] = OrderedDict()  # digest -> (pages, rows)
        self.evictions = 0

    def get(self, digest: bytes) -> np.ndarray | None:
        """The image's rows, most recently used now; None when not held."""
        entry = self.entries.get(digest)
        if entry is None:
            return None
        self.entries.move_to_end(digest)
        return entry[1]

    def put(self, digest: bytes, length: int, keep: set[bytes]) -> np.ndarray | None:
        """Rows for `length` tokens of a new image, evicting the least recently used images not in `keep`; None
        when even that leaves too few."""
        need = -(-length // self.PAGE_ROWS)
        while len(self.free) < need:
            victim = next((d for d in self.entries if d not in keep), None)
            if victim is None:
                return None
            self.free += self.entries.pop(victim)[0]
            self.evictions += 1
        pages, self.free = self.free[:need], self.free[need:]
        rows = (np.asarray(pages, np.int32)[:, None] * self.PAGE_ROWS + np.arange(self.PAGE_ROWS)).reshape(-1)
        self.entries[digest] = (pages, rows[:length])
        return rows[:length]

    @property
    def held_tokens(self) -> int:
        return sum(len(rows) for _, rows in self.entries.values())


class ImageFeeder:
    """A prefill pass's image inputs: the MRoPE positions of its tokens and the media row each placeholder reads,
    encoding the images the rows do not hold yet (dispatched before the pass, which reads them on the device)."""

    def __init__(self, runner, rows: int):
        self.runner = runner
        self.rows = MediaRows(rows)
        self.counters = {"images_encoded": 0, "image_cache_hits": 0, "image_tokens_encoded": 0}

    def pass_inputs(self, prompt: PreparedPrompt, base: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(rope positions int32 [3, end - base], media rows int32 [end - base], -1 for text) of prompt tokens
        [base, end)."""
        media = prompt.media
        rows = np.full(end - base, -1, np.int32)
        images = [im for im in media.images if im.begin < end and im.end > base]
        keep = {im.digest for im in images}
        for im in images:
            held = self.rows.get(im.digest)
            if held is None:
                held = self.rows.put(im.digest, im.length, keep)
                if held is None:  # options.resolve sizes the rows for one pass's images
                    raise RuntimeError(f"the media rows ({self.rows.num_pages * MediaRows.PAGE_ROWS}) cannot hold "
                                       f"the images of one prefill pass")
                self.runner.encode_image(im.patches, im.normalization, im.grid, held)
                self.counters["images_encoded"] += 1
                self.counters["image_tokens_encoded"] += im.length
            elif im.begin >= base:  # counted once, at the pass that reaches the image's first token
                self.counters["image_cache_hits"] += 1
            lo, hi = max(base, im.begin), min(end, im.end)
            rows[lo - base:hi - base] = held[lo - im.begin:hi - im.begin]
        return media.rope_positions[:, base:end], rows

    def stats(self) -> dict:
        return {**self.counters, "cached_images": len(self.rows.entries), "cached_tokens": self.rows.held_tokens,
                "capacity_tokens": self.rows.num_pages * MediaRows.PAGE_ROWS, "evictions": self.rows.evictions}
