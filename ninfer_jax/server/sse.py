"""Server-sent events: the wire format, and a response that always closes its event source.

Starlette cancels a streaming body when the client disconnects; the body generator may then be left
suspended at a `yield`, and its `finally` (which cancels the engine request) would wait for garbage
collection. `EventStream` closes the generator itself once the response ends, however it ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(data: Any, event: str | None = None) -> str:
    """One event; `data` is JSON-encoded unless it is already a string (OpenAI's `[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
