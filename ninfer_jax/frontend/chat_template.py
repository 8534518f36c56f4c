"""Renders chat messages with a checkpoint's Jinja chat template, as transformers' apply_chat_template does.

The environment matches transformers': sandboxed, trim_blocks + lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, and a `tojson` that keeps key order and non-ASCII text. Before
rendering, messages are normalised the way OpenAI-style servers feed Qwen templates: role `developer`
becomes `system`, and tool-call arguments sent as JSON strings become mappings (the template iterates
them with `|items`). The result carries the character offsets that tap hints need (`chat_layout`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_layout import ChatLayout, locate_chat_layout
from .qwen35_template import QWEN35_CHAT_TEMPLATE

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its `raise_exception`) or failed to render."""


@dataclass(frozen=True)
class RenderedChat:
    """A rendered prompt and where its structure lies in it (character offsets into `text`)."""

    text: str
    messages: tuple[Message, ...]  # as rendered (normalised); layout indices refer to these
    layout: ChatLayout


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from error

    @staticmethod
    def from_file(path: str | Path) -> ChatTemplate:
        """The template in a Jinja file; a file that cannot be read or compiled is a ChatTemplateError."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ChatTemplateError(f"chat template {path}: {error}") from None
        return ChatTemplate(source)

    @staticmethod
    def from_option(value: str) -> ChatTemplate:
        """vLLM's --chat-template: the template in the file `value` names, or `value` itself when it names no file
        and holds Jinja tags."""
        path = Path(value).expanduser()
        if not path.exists() and ("{{" in value or "{%" in value):
            return ChatTemplate(value)
        return ChatTemplate.from_file(path)

    @staticmethod
    def qwen35() -> ChatTemplate:
        """The built-in Qwen3.5 template (see `qwen35_template`), compiled once."""
        return _qwen35()

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> RenderedChat:
        """Renders `messages` (OpenAI chat format) and locates their turns in the text.

        Args:
            messages: dicts with `role`, `content` (a string or a list of content parts), and for
                assistant turns optionally `reasoning_content` and `tool_calls`.
            tools: OpenAI-style function tool definitions, or None.
            add_generation_prompt: append the assistant opener the model continues from.
            enable_thinking: Qwen3.5: False pre-closes an empty think block in the opener.
            continue_final_message: the last message is the assistant's start of its answer (Anthropic's prefill,
                vLLM's continue_final_message): the text ends with its content, its turn left open, and no
                opener follows (add_generation_prompt must be False).
            template_kwargs: further template variables (e.g. `add_vision_id`).
        """
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
            if not messages or messages[-1].get("role") != "assistant":
                raise ChatTemplateError("continue_final_message needs the last message to be the assistant's")
        normalised = tuple(_normalise_message(m) for m in messages)
        try:
            text = self._template.render(
                messages=list(normalised),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **template_kwargs,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as error:  # a template's own errors are often TypeErrors
            raise ChatTemplateError(_render_failure(error, normalised)) from error
        layout = locate_chat_layout(
            text, normalised, has_tools=bool(tools), add_generation_prompt=add_generation_prompt
        )
        if continue_final_message:
            text, layout = _open_final_turn(text, layout)
        return RenderedChat(text=text, messages=normalised, layout=layout)


def _open_final_turn(text: str, layout: ChatLayout) -> tuple[str, ChatLayout]:
    """The rendered conversation cut right after its last message's content, which the model then continues: that
    content must be found and end the turn (only `<|im_end|>` follows it), else the template wrote something after
    it the model would have to follow, and the conversation is refused."""
    ends = layout.part_ends[-1] if layout.located else ()
    cut = ends[-1] if ends else None
    if cut is None or cut <= layout.message_starts[-1] or text[cut:].rstrip() != "<|im_end|>":
        raise ChatTemplateError("continue_final_message needs the last message to end with text content that "
                                "ends its turn (no tool calls after it)")
    ends_at = layout.message_ends[:-1] + (cut,)
    return text[:cut], dataclasses.replace(layout, message_ends=ends_at)


def load_chat_template(checkpoint_dir: str | Path) -> ChatTemplate:
    """The checkpoint's template: chat_template.jinja, else tokenizer_config.json's `chat_template`.

    Falls back to the built-in Qwen3.5 template when the checkpoint has neither. A list of named
    templates in tokenizer_config.json yields its `default` one.
    """
    directory = Path(checkpoint_dir)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"))
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        source = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(source, list):
            source = {entry["name"]: entry["template"] for entry in source}.get("default")
        if isinstance(source, str):
            return ChatTemplate(source)
    return ChatTemplate.qwen35()


@functools.cache
def _qwen35() -> ChatTemplate:
    return ChatTemplate(QWEN35_CHAT_TEMPLATE)


def _normalise_message(message: Message) -> dict[str, Any]:
    normalised = copy.deepcopy(dict(message))
    if normalised.get("role") == "developer":
        normalised["role"] = "system"
    for call in normalised.get("tool_calls") or ():
        target = _tool_call_target(call)
        if target is not None and isinstance(target.get("arguments"), str):
            try:
                target["arguments"] = json.loads(target["arguments"])
            except json.JSONDecodeError:
                pass  # left as sent; the template decides whether it can render it
    return normalised


def _tool_call_target(call: Any) -> dict[str, Any] | None:
    """The dict holding a tool call's name and arguments: OpenAI's nested `function`, or the call itself."""
    target = call.get("function", call) if isinstance(call, dict) else None
    return target if isinstance(target, dict) else None


def _render_failure(error: Exception, messages: Sequence[Mapping[str, Any]]) -> str:
    """The template's error, naming the first tool call whose arguments stayed text: Qwen's templates read them as a
    mapping and fail with a message about item pairs that does not say where."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            target = _tool_call_target(call)
            if target is not None and isinstance(target.get("arguments"), str):
                return (f"messages[{i}].tool_calls[{j}]: the chat template could not render its arguments, which are "
                        f"not a JSON object ({error})")
    return str(error)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: key order and non-ASCII text kept (Jinja's own sorts keys and escapes).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
