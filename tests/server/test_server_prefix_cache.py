"""The protocol side of the prefix cache (spec §7.1, §8.3): client markers reach the engine as explicit tap hints,
protocol-automatic caching as an automatic hint at the last message, and the engine's reuse comes back as
OpenAI `cached_tokens` and Anthropic `cache_read_input_tokens` (fixed at admission, so message_start has it).
A scripted engine simulates content-addressed reuse, so the numbers are known."""

from __future__ import annotations

import httpx
import pytest

from ninfer_jax.frontend import Breakpoint, TapHintKind, prepare_chat
from ninfer_jax.prefix_cache.hashing import salt_key
from server_support import ScriptedEngine, claude, oai, server, sse_events  # noqa: F401 (fixtures)

MODEL = ScriptedEngine.model_name
SYSTEM = "You are a careful assistant. " * 30  # about 180 tokens: whole blocks the next turn reuses


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine()



def _hints(engine, kind):
    return [hint.position for hint in engine.prompts[-1].tap_hints if hint.kind == kind]


def _expected_hints(engine, messages, breakpoints, **kw):
    prepared = prepare_chat(engine.tokenizer, messages, breakpoints=breakpoints, template=engine.chat_template, **kw)
    return prepared.tap_hints


def test_openai_second_turn_reports_the_engines_reuse_as_cached_tokens(oai, engine):
    engine.say("</think>\n\nFirst answer.", "</think>\n\nSecond answer.")
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Question one?"}]
    first = oai.chat.completions.create(model=MODEL, messages=turn, prompt_cache_key="conversation-7")
    assert first.usage.prompt_tokens_details.cached_tokens == engine.cached[-1]
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Question two?"}]
    second = oai.chat.completions.create(model=MODEL, messages=turn, stream=True,
                                         stream_options={"include_usage": True})
    usage = list(second)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == engine.cached[-1] >= 128


def test_chat_and_responses_salt_the_prompt_with_cache_salt(oai, engine):
    engine.say("</think>\n\nSalted.", "</think>\n\nSalted.")
    turn = [{"role": "user", "content": "Question?"}]
    oai.chat.completions.create(model=MODEL, messages=turn, extra_body={"cache_salt": "tenant-a"})
    assert engine.prompts[-1].salt == salt_key("tenant-a")
    oai.responses.create(model=MODEL, input="Question?", extra_body={"cache_salt": "tenant-b"})
    assert engine.prompts[-1].salt == salt_key("tenant-b")


def test_openai_automatic_caching_marks_the_last_message_and_explicit_breakpoints_are_priority_one(oai, engine):
    messages = [{"role": "system", "content": [
                    {"type": "text", "text": "Rules.", "prompt_cache_breakpoint": {"mode": "explicit"}},
                    {"type": "text", "text": " More rules.", "cache_control": {"type": "ephemeral"}}]},
                {"role": "user", "content": "Hi"}]
    oai.chat.completions.create(model=MODEL, messages=messages,
                                extra_body={"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}})
    expected = _expected_hints(engine, messages, [Breakpoint(0, 0), Breakpoint(0, 1),
                                                  Breakpoint(1, None, explicit=False)])
    assert engine.prompts[-1].tap_hints == expected
    assert len(_hints(engine, TapHintKind.EXPLICIT)) == 2 and len(_hints(engine, TapHintKind.AUTOMATIC)) == 1


def test_anthropic_reuse_is_cache_read_input_tokens_from_message_start_on(claude, engine, server):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    engine.say("Answer one.")
    first = claude.messages.create(model=MODEL, max_tokens=50, system=system,
                                   messages=[{"role": "user", "content": "One?"}])
    marked = _hints(engine, TapHintKind.EXPLICIT)[-1]
    assert first.usage.cache_read_input_tokens == engine.cached[-1]
    assert first.usage.cache_creation_input_tokens == marked - engine.cached[-1]
    engine.say("Answer two.")
    with httpx.stream("POST", f"{server.url}/v1/messages", json={
            "model": MODEL, "max_tokens": 50, "stream": True, "system": system,
            "messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "Answer one."},
                         {"role": "user", "content": "Two?"}]}) as response:
        events = sse_events(response.iter_lines())
    start_usage = events[0][1]["message"]["usage"]
    assert start_usage["cache_read_input_tokens"] == engine.cached[-1] >= 128
    assert start_usage["input_tokens"] + start_usage["cache_read_input_tokens"] + \
        start_usage["cache_creation_input_tokens"] == engine.prompts[-1].num_tokens


def test_anthropic_cache_control_markers_become_explicit_hints_and_top_level_an_automatic_one(claude, engine):
    claude.messages.create(
        model=MODEL, max_tokens=20, cache_control={"type": "ephemeral"},
        system=[{"type": "text", "text": "Rules."}, {"type": "text", "text": "More.", "cache_control": {
            "type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Part A."},
                                               {"type": "text", "text": "Part B.",
                                                "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": "Ok."},
                  {"role": "user", "content": "Go on."}])
    template_messages = [{"role": "system", "content": [{"type": "text", "text": "Rules."},
                                                        {"type": "text", "text": "More."}]},
                         {"role": "user", "content": [{"type": "text", "text": "Part A."},
                                                      {"type": "text", "text": "Part B."}]},
                         {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Go on."}]
    expected = _expected_hints(engine, template_messages,
                               [Breakpoint(0, 1), Breakpoint(1, 1), Breakpoint(3, None, explicit=False)],
                               enable_thinking=False)
    assert engine.prompts[-1].tap_hints == expected
    assert len(_hints(engine, TapHintKind.EXPLICIT)) == 2 and len(_hints(engine, TapHintKind.AUTOMATIC)) == 1


def test_anthropic_request_without_markers_creates_no_cache_entry(claude, engine):
    message = claude.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.cache_creation_input_tokens == 0
    assert not _hints(engine, TapHintKind.EXPLICIT) and not _hints(engine, TapHintKind.AUTOMATIC)
