"""Image parts through the APIs: OpenAI `image_url`, Anthropic `image` and Responses `input_image` parts become the
frontend's `{"type": "image", "image": bytes}` parts in their place among the text; every refusal is a 400 naming
the part; http(s) URLs are fetched, within a timeout and a size bound, only when the option allows it."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time

import httpx
import pytest
from PIL import Image

from ninfer_jax.frontend import Breakpoint
from ninfer_jax.frontend.image_processing import ImageError
from ninfer_jax.server import chat_prompt
from ninfer_jax.server.anthropic_messages import messages_input
from ninfer_jax.server.anthropic_schema import MessagesRequest
from ninfer_jax.server.errors import ApiError
from ninfer_jax.server.images import ImageOptions, ImageSource, load_images
from ninfer_jax.server.openai_messages import chat_input
from ninfer_jax.server.openai_schema import ChatCompletionRequest
from ninfer_jax.server.responses import ResponsesRequest, _messages
from server_support import LiveServer, ScriptedEngine

MODEL = ScriptedEngine.model_name
MAX_BYTES = 1000


def _png(color=(200, 30, 30), size=(4, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


PNG, PNG2 = _png(), _png((0, 90, 250), (2, 5))
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"


class _VisionStub:
    """An engine as load_images sees it: a name and a vision tower."""

    model_name = "stub"
    vision = object()


def _load(messages, **options):
    return asyncio.run(load_images(ImageOptions(**options), _VisionStub(), messages))


# --- conversion -----------------------------------------------------------------------------------------------

def test_openai_image_url_parts_become_image_parts_in_order_with_their_breakpoints():
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"},
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " with "},
            # base64 wrapped in lines, as MIME writes it
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "\n".join(
                base64.b64encode(PNG2).decode()[i:i + 76] for i in range(0, 200, 76))}},
        ]}]})
    chat = chat_input(request)
    messages, places = _load(chat.messages)
    assert messages[1]["content"] == [{"type": "text", "text": "Compare "}, {"type": "image", "image": PNG},
                                      {"type": "text", "text": " with "}, {"type": "image", "image": PNG2}]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert Breakpoint(1, 1) in chat.breakpoints  # the marker on the image: the end of that part
    assert places == {"messages[1].content[1]": "messages[1].content[1].image_url.url",
                      "messages[1].content[3]": "messages[1].content[3].image_url.url"}


def test_anthropic_image_blocks_in_user_messages_and_tool_results_become_image_parts():
    request = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 5, "system": "Look.", "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": B64},
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "the screen:"},
                {"type": "image", "source": {"type": "url", "url": "data:image/png;base64,"
                                             + base64.b64encode(PNG2).decode()}}]}]}]})
    given = messages_input(request)
    messages, places = _load(given.messages)
    # a media type that disagrees with the bytes is taken: the frontend reads the format from the bytes
    assert messages[1] == {"role": "user", "content": [{"type": "image", "image": PNG},
                                                      {"type": "text", "text": "What is it?"}]}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "the screen:"}, {"type": "image", "image": PNG2}]}
    assert Breakpoint(1, 0) in given.breakpoints
    assert places == {"messages[1].content[0]": "messages.0.content.0.source.data",
                      "messages[3].content[1]": "messages.2.content.0.content.1.source.url"}


def test_responses_input_image_parts_become_image_parts():
    large = bytes(range(256)) * 3200  # over a MiB as base64: decoded off the event loop
    request = ResponsesRequest.model_validate({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
        {"type": "input_text", "text": "Describe them."},
        {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(large).decode()}]}]})
    messages, _ = _load(_messages(request))
    assert messages == [{"role": "user", "content": [{"type": "image", "image": PNG},
                                                     {"type": "text", "text": "Describe them."},
                                                     {"type": "image", "image": large}]}]


# --- refusals through the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vision_server():
    engine = ScriptedEngine()
    engine.vision = object()  # a vision tower as far as the server checks; no request here reaches the frontend
    with LiveServer(engine, images=ImageOptions(max_image_bytes=MAX_BYTES, max_images_per_prompt=2)) as live:
        yield live


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("content, role, param, message", [
    ([_image("data:image/png;base64,iVBOR!w0")], "user", "messages[0].content[0].image_url.url", "not valid base64"),
    ([_image("data:text/plain;base64," + B64)], "user", "messages[0].content[0].image_url.url",
     "media type must be an image type"),
    ([_image("data:image/png," + B64)], "user", "messages[0].content[0].image_url.url", "must be base64"),
    # more base64 characters than the context's text bound (16 per token of 4096): not counted as text
    ([_image("data:image/png;base64," + base64.b64encode(bytes(60_000)).decode())], "user",
     "messages[0].content[0].image_url.url", f"more than {MAX_BYTES} bytes"),
    ([_image("http://127.0.0.1:9/x.png")], "user", "messages[0].content[0].image_url.url", "--allow-image-urls"),
    ([_image("file:///etc/passwd")], "user", "messages[0].content[0].image_url.url", "data:, http: or https:"),
    ([{"type": "text", "text": "x"}, _image(DATA_URL), _image(DATA_URL), _image(DATA_URL)], "user",
     "messages[0].content[3].image_url.url", "3 images; this server takes at most 2 (--max-images-per-prompt)"),
    ([_image(DATA_URL)], "system", "messages[0].content[0]", "user messages only"),
    ([{"type": "image_url", "image_url": {"url": DATA_URL, "detail": "ultra"}}], "user",
     "messages[0].content[0].image_url.detail", "must be one of auto, low, high"),
])
def test_openai_bad_image_parts_are_400_naming_the_part(vision_server, content, role, param, message):
    response = httpx.post(f"{vision_server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": role, "content": content}, {"role": "user", "content": "Hi"}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": ") and message in error["message"]


@pytest.mark.parametrize("block, message", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": B64}},
     "messages.0.content.0.source.media_type: Input should be 'image/png'"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}},
     "messages.0.content.0.source.data: the image data is not valid base64"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}},
     "messages.0.content.0.source.type: Input should be 'base64' or 'url'"),
])
def test_anthropic_bad_image_blocks_are_400_naming_the_block(vision_server, block, message):
    response = httpx.post(f"{vision_server.url}/v1/messages", json={
        "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [block]}]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(message)


def test_images_to_a_model_without_a_vision_tower_are_400_naming_the_part(vision_server, monkeypatch):
    monkeypatch.setattr(vision_server.context.engine, "vision", None)
    response = httpx.post(f"{vision_server.url}/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "x"},
                                     {"type": "input_image", "image_url": DATA_URL}]}]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        f"input[0].content[1].image_url: model {MODEL} has no vision tower; send text only")


def test_the_frontends_image_error_names_the_requests_block(vision_server, monkeypatch):
    def refuse(tokenizer, messages, *args, **kwargs):
        """prepare_chat refusing the image, named by its place in the template's messages as the frontend does."""
        [place] = [f"messages[{i}].content[{j}]" for i, message in enumerate(messages)
                   if isinstance(message["content"], list)
                   for j, part in enumerate(message["content"]) if part["type"] == "image"]
        raise ImageError(f"{place}: not an image")

    monkeypatch.setattr(chat_prompt, "prepare_chat", refuse)
    response = httpx.post(f"{vision_server.url}/v1/messages", json={
        "model": MODEL, "max_tokens": 5, "system": "Look.", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}]}]})
    assert response.status_code == 400, response.text
    # the template's messages[1].content[1] (the system prompt is its message 0)
    assert response.json()["error"]["message"] == "messages.0.content.1.source.data: not an image"


# --- fetching image URLs ---------------------------------------------------------------------------------------

class _Images(http.server.BaseHTTPRequestHandler):
    """/ok.png: the PNG; /big: more than MAX_BYTES without a Content-Length; /slow: answers after 2 s;
    /moved: a redirect to an ftp: URL (which urllib would follow)."""

    def do_GET(self):
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/x.png")
            self.end_headers()
            return
        body = PNG if self.path in ("/ok.png", "/slow") else bytes(MAX_BYTES * 3)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:  # the server stopped reading at its bound
            pass
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()
    host.server_close()


def _user_image(url: str) -> list[dict]:
    source = ImageSource("messages[0].content[0].image_url.url", url=url)
    return [{"role": "user", "content": [{"type": "image", "image": source}]}]


def test_image_urls_are_fetched_when_allowed(image_host):
    messages, _ = _load(_user_image(f"{image_host}/ok.png"), allow_image_urls=True)
    assert messages[0]["content"] == [{"type": "image", "image": PNG}]


@pytest.mark.parametrize("path, message", [
    ("/big", f"the image has more than {MAX_BYTES} bytes"),
    ("/slow", "did not answer within 0.5 s (--image-fetch-timeout-s)"),
    ("/moved", "could not be fetched: redirected to a non-http(s) URL"),
])
def test_image_url_fetches_over_a_bound_are_400_naming_the_part(image_host, path, message):
    started = time.monotonic()
    with pytest.raises(ApiError) as raised:
        _load(_user_image(image_host + path), allow_image_urls=True, image_fetch_timeout_s=0.5,
              max_image_bytes=MAX_BYTES)
    assert time.monotonic() - started < 1.5  # the request does not wait for the slow host
    error = raised.value
    assert (error.kind, error.param) == ("invalid_request", "messages[0].content[0].image_url.url")
    assert error.message.startswith(error.param + ": ") and message in error.message
