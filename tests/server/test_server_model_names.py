"""--served-model-name (vLLM's): requests may give any of the names, responses and /v1/models report them, and any
other name, the checkpoint's own included, is a 404 naming what is served."""

from __future__ import annotations

import openai
import pytest

from server_support import LiveServer, ScriptedEngine
from ninfer_jax.server.cli import UsageError, build_parser, serve_options

NAMES = ("qwen35", "Qwen/Qwen3.5-27B")


@pytest.fixture(scope="module")
def client():
    with LiveServer(ScriptedEngine(), served_model_names=NAMES) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_any_served_name_is_taken_and_the_first_is_reported(client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    chat = client.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == NAMES[0]
    with pytest.raises(openai.NotFoundError, match="This server serves `qwen35`, `Qwen/Qwen3.5-27B`"):
        client.completions.create(model=ScriptedEngine.model_name, prompt="Hi")


def test_the_flag_takes_several_names_after_the_model():
    parse = build_parser().parse_args
    assert serve_options(parse(["/models/q", "--served-model-name", *NAMES])).served_model_names == NAMES
    assert serve_options(parse(["--served-model-name", "a", "--model", "/models/q"])).served_model_names == ("a",)
    with pytest.raises(UsageError, match="--served-model-name without a model"):
        serve_options(parse(["--served-model-name", "a", "/models/q"]))
