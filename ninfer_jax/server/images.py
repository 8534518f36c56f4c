"""Image parts of chat requests: where their bytes come from, the bounds on them, and the frontend's parts they
become.

Each protocol's converter (openai_messages, anthropic_messages, responses) leaves the part as
`{"type": "image", "image": ImageSource(...)}`: where it stands in the request and what the client sent (a data:
or http(s): URL, or base64 data). `load_images`, awaited before the template renders, checks the count and the
model's vision tower, reads each source's bytes (fetching http(s) URLs off the event loop, only when
--allow-image-urls is given) and puts the bytes in the part: `{"type": "image", "image": bytes}`, the encoded file
that the frontend decodes. Every refusal is a 400 naming the part by its place in the request, and the option
that sets a bound.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ApiError

# Anthropic's image media types (its base64 sources must name one of them).
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_WHITESPACE = re.compile(r"\s+")
_READ_CHUNK = 1 << 16
# Base64 decodes at some 400 MB/s: a larger inline image is decoded in a thread, sparing the event loop a stall
# of milliseconds (a 20 MiB image takes some 60 ms).
_INLINE_ON_LOOP = 1 << 20


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """What image parts a request may carry and where their bytes may come from (ninfer-serve flags)."""

    # --allow-image-urls: fetch http(s) image URLs. Off by default: the server would fetch from any address it
    # reaches, its own network included, on a client's word.
    allow_image_urls: bool = False
    image_fetch_timeout_s: float = 10.0  # --image-fetch-timeout-s: a whole fetch, connection to last byte
    max_image_bytes: int = 20 << 20  # --max-image-bytes: one encoded image (OpenAI's bound), however it came
    max_images_per_prompt: int = 16  # --max-images-per-prompt


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """An image part as the request gave it, before its bytes are read. Exactly one of `url` and `data`."""

    where: str  # the part's place in the request, e.g. messages[1].content[0], for errors
    url: str | None = None  # data:, http: or https:
    data: str | None = None  # base64 (Anthropic's base64 source)


def image_part(source: ImageSource) -> dict[str, Any]:
    """The template's part for an image, until `load_images` reads its bytes."""
    return {"type": "image", "image": source}


def url_source(url: Any, where: str) -> ImageSource:
    """The source of an image given by URL; a URL that is not a string is a 400."""
    if not isinstance(url, str) or not url:
        raise ApiError("invalid_request", f"{where}: the image URL must be a non-empty string", param=where)
    return ImageSource(where, url=url)


async def load_images(options: ImageOptions, engine: Any, messages: Sequence[Mapping[str, Any]]
                      ) -> tuple[list[Mapping[str, Any]], dict[str, str]]:
    """`messages` with every image source replaced by its bytes, and each image part's place in the messages
    (`messages[i].content[j]`, as the frontend names it) mapped to its place in the request.

    Raises ApiError (400) naming the part: more images than --max-images-per-prompt, a model without a vision
    tower, a source that cannot be read.
    """
    found = [(i, j, part["image"]) for i, message in enumerate(messages)
             if isinstance(message.get("content"), list)
             for j, part in enumerate(message["content"]) if isinstance(part.get("image"), ImageSource)]
    if not found:
        return list(messages), {}
    first = found[0][2].where
    if getattr(engine, "vision", None) is None:
        raise ApiError("invalid_request", f"{first}: model {engine.model_name} has no vision tower; send text only",
                       param=first)
    if len(found) > options.max_images_per_prompt:
        where = found[options.max_images_per_prompt][2].where
        raise ApiError("invalid_request", f"{where}: the request has {len(found)} images; this server takes at most "
                       f"{options.max_images_per_prompt} (--max-images-per-prompt)", param=where)
    loaded = await asyncio.gather(*(_read(options, source) for _, _, source in found))
    out = [dict(message) for message in messages]
    for message in {i for i, _, _ in found}:
        out[message]["content"] = list(out[message]["content"])
    for (i, j, _), data in zip(found, loaded):
        out[i]["content"][j] = {**out[i]["content"][j], "image": data}
    return out, {f"messages[{i}].content[{j}]": source.where for i, j, source in found}


async def _read(options: ImageOptions, source: ImageSource) -> bytes:
    where = source.where
    url = source.url or ""
    scheme = url.partition(":")[0].lower()
    if source.data is not None or scheme == "data":
        inline = source.data if source.data is not None else url
        decode = _base64 if source.data is not None else _data_url
        if len(inline) < _INLINE_ON_LOOP:
            return decode(inline, where, options.max_image_bytes)
        return await asyncio.to_thread(decode, inline, where, options.max_image_bytes)
    if scheme not in ("http", "https"):
        raise ApiError("invalid_request", f"{where}: image URLs must be data:, http: or https: URLs, got "
                       f"{scheme + ':' if scheme and ':' in url else 'no scheme'}", param=where)
    if not options.allow_image_urls:
        raise ApiError("invalid_request", f"{where}: this server does not fetch image URLs (--allow-image-urls); "
                       "send the image inline as a base64 data: URL", param=where)
    timeout = options.image_fetch_timeout_s
    try:
        return await asyncio.wait_for(asyncio.to_thread(_fetch, url, where, timeout, options.max_image_bytes),
                                      timeout)
    except TimeoutError:
        raise _timed_out(where, timeout) from None


def _data_url(url: str, where: str, max_bytes: int) -> bytes:
    """`data:image/png;base64,...` -> its bytes."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ApiError("invalid_request", f"{where}: the data URL has no ',' before its data", param=where)
    media_type, *params = (field.strip().lower() for field in header.split(";"))
    if not media_type.startswith("image/"):
        raise ApiError("invalid_request", f"{where}: the data URL's media type must be an image type (image/png, "
                       f"image/jpeg, ...), got {media_type or 'none'!r}", param=where)
    if "base64" not in params:
        raise ApiError("invalid_request", f"{where}: the data URL must be base64 (data:{media_type};base64,...)",
                       param=where)
    return _base64(payload, where, max_bytes)


def _base64(payload: str, where: str, max_bytes: int) -> bytes:
    """Standard base64 (line breaks allowed) -> bytes, within max_bytes."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        try:  # wrapped base64 (MIME's 76-character lines); the strict pass first spares long payloads the copy
            data = base64.b64decode(_WHITESPACE.sub("", payload), validate=True)
        except (binascii.Error, ValueError):
            raise ApiError("invalid_request", f"{where}: the image data is not valid base64", param=where) from None
    if not data:
        raise ApiError("invalid_request", f"{where}: the image data is empty", param=where)
    if len(data) > max_bytes:
        raise _too_large(where, max_bytes)
    return data


class _HttpRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) only (urllib's own handler follows ftp: too)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if newurl.partition(":")[0].lower() not in ("http", "https"):
            raise urllib.error.URLError(f"redirected to a non-http(s) URL {newurl[:100]!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, where: str, timeout: float, max_bytes: int) -> bytes:
    """The body at an http(s) URL, at most max_bytes, within `timeout` seconds (run in a thread: it blocks)."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "ninfer-jax", "Accept": "image/*"})
    try:
        with urllib.request.build_opener(_HttpRedirects).open(request, timeout=timeout) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise _too_large(where, max_bytes)
            body = bytearray()
            while chunk := response.read(min(_READ_CHUNK, max_bytes + 1 - len(body))):
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(where, max_bytes)
                if time.monotonic() > deadline:
                    raise _timed_out(where, timeout)
    except urllib.error.HTTPError as error:
        raise ApiError("invalid_request", f"{where}: fetching the image URL failed: HTTP {error.code} "
                       f"{error.reason}", param=where) from None
    except TimeoutError:
        raise _timed_out(where, timeout) from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(reason, TimeoutError):
            raise _timed_out(where, timeout) from None
        raise ApiError("invalid_request", f"{where}: the image URL could not be fetched: {reason}",
                       param=where) from None
    if not body:
        raise ApiError("invalid_request", f"{where}: the image URL answered an empty body", param=where)
    return bytes(body)


def _too_large(where: str, max_bytes: int) -> ApiError:
    return ApiError("invalid_request", f"{where}: the image has more than {max_bytes} bytes; this server takes at "
                    "most that many per image (--max-image-bytes)", param=where)


def _timed_out(where: str, timeout: float) -> ApiError:
    return ApiError("invalid_request", f"{where}: the image URL did not answer within {timeout:g} s "
                    "(--image-fetch-timeout-s)", param=where)
