"""The threads that tokenize and render chat templates, apart from asyncio's default pool.

A long prompt takes a while to tokenize; on the event loop it would stall every other request, and in the
default pool it would compete with whatever else uses it. Here a call that has not started is dropped when
its request goes away (its awaiting task is cancelled), each call is bounded by the request limits, and at
most `max_waiting` calls wait: beyond that a request is refused at once (503) instead of queueing unboundedly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import ApiError

T = TypeVar("T")


class FrontendPool:
    def __init__(self, workers: int = 2, max_waiting: int = 64):
        self.workers, self.max_waiting = workers, max_waiting
        self._executor: ThreadPoolExecutor | None = None  # made on first use, so an unused app owns no threads
        self.pending = 0  # calls submitted and not yet returned to their caller (event loop only)

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) in a pool thread. Raises ApiError (503) when too many calls wait."""
        if self.pending >= self.workers + self.max_waiting:
            raise ApiError("unavailable", f"the server is busy: {self.pending} prompts wait to be tokenized; "
                           "retry shortly")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="ninfer-frontend")
        self.pending += 1
        try:
            # Cancelling the awaiting task cancels a call that has not started (asyncio chains the futures).
            return await asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
