"""Request body of POST /v1/messages (Anthropic Messages API), validated by pydantic.

Content blocks stay plain dicts here: `anthropic_messages` walks them once, in prompt order, to convert
them and to validate their `cache_control` markers with the protocol's own rules and messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolDefinition(_Lenient):
    # "custom" (or none): a client tool; Anthropic's server tools (web_search_..., bash_..., ...) run nowhere here
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    cache_control: Any = None


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(_Lenient):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    cache_control: Any = None  # top-level: automatic caching at the last cacheable block

    @model_validator(mode="after")
    def _thinking_budget(self) -> MessagesRequest:
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None or thinking.budget_tokens < 1024:
                raise ValueError("thinking.budget_tokens: must be at least 1024")
            if thinking.budget_tokens >= self.max_tokens:
                raise ValueError("max_tokens must be greater than thinking.budget_tokens")
        return self

    @property
    def enable_thinking(self) -> bool:
        """Thinking is off unless asked for, as in the Messages API."""
        return self.thinking is not None and self.thinking.type != "disabled"

    @property
    def thinking_budget(self) -> int | None:
        """The tokens the answer may think for: `budget_tokens` of enabled thinking (adaptive thinking has none)."""
        return self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and (self.tool_choice or {}).get("type") != "none"


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int = 1 << 30  # not part of this endpoint; large enough for any thinking budget
