"""Request bodies of the OpenAI endpoints (chat completions, completions), validated by pydantic.

Unknown fields are ignored, as vLLM does. Fields the engine cannot honour are accepted only at their
neutral values (best_of=1); anything else is a 400 that says so, rather than a silent change of meaning.
vLLM's extensions `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens` and
`chat_template_kwargs` (e.g. `{"enable_thinking": false}`) are accepted; `reasoning_effort` "none" or "minimal"
turns thinking off (chat_prompt.thinking_mode).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ninfer_jax.runtime.sampling import MAX_LOGPROBS, check_truncate_prompt_tokens

from .chat_prompt import ReasoningEffort, thinking_mode
from .errors import refuse_unsupported
from .tool_choice import ForcedTools, openai_forced_tools, output_format


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class PromptCacheOptions(_Lenient):
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] = "30m"


# vLLM's structured_outputs keys that tune a constraint rather than give one: accepted, without effect (this server's
# JSON never allows free whitespace)
_STRUCTURED_OPTIONS = frozenset(("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                                 "whitespace_pattern"))


# vLLM's request fields that change the output and that this server does not implement, with their neutral values:
# a request may send them only at those (as best_of=1), so none is silently ignored.
_UNSUPPORTED = {"typical_p": 1, "use_beam_search": False, "length_penalty": 1, "spaces_between_special_tokens": True,
                "logits_processors": None, "chat_template": None, "documents": None,
                "prompt_embeds": None, "vllm_xargs": None, "kv_transfer_params": None}
# The same for chat completions alone: vLLM's echo (the last message prefixed to the answer), OpenAI's audio output,
# web search, and its deprecated functions / function_call (send tools and tool_choice)
_CHAT_UNSUPPORTED = {"echo": False, "audio": None, "modalities": ["text"], "web_search_options": None,
                     "functions": None, "function_call": None}


class _Sampling(_Lenient):
    """Fields both endpoints share."""

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_fields(cls, data: Any) -> Any:
        return refuse_unsupported(data, _UNSUPPORTED)

    model: str | None = None  # vLLM's: optional, a request without one is the served model's
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's
    n: int = Field(1, ge=1)  # samples of the prompt, which is computed once; the bound is --max-n
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension, as min_tokens
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias; SamplingParams checks it
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema; SamplingParams checks it
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled; SamplingParams checks it
    bad_words: list[str] | None = None  # vLLM's: words the output may not complete
    # vLLM's: only the prompt's last k tokens (-1: as many as the context leaves room for one output token)
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False  # vLLM's, as skip_special_tokens
    skip_special_tokens: bool = True
    # vLLM's: the order of waiting requests under --scheduling-policy priority (lower first); else it must be 0
    priority: int = 0
    # vLLM's extension: each prompt token's logprob and its top alternatives (the whole prompt is computed)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: the prompt's and each choice's token ids in the response (RL rollouts train on exactly these)
    return_token_ids: bool = False
    # vLLM's: logprobs name their tokens "token_id:N", so tokens that are no whole UTF-8 text stay identifiable
    return_tokens_as_token_ids: bool = False
    # vLLM's structured outputs beside response_format: the `structured_outputs` object (json, regex, choice,
    # grammar) and the older guided_* fields; at most one of them all
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the prompt shares cached blocks only with requests of the same salt (one tenant's from another's)
    cache_salt: str | None = Field(None, min_length=1)

    def token_namer(self, engine: Any) -> Any:
        """The tokenizer logprobs name tokens by (logprobs.py): None names them "token_id:N"."""
        return None if self.return_tokens_as_token_ids else engine.tokenizer

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        check_truncate_prompt_tokens(value)  # before the prompt is cut, which comes before SamplingParams
        return value

    @model_validator(mode="after")
    def _sampling_fields(self) -> _Sampling:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream")
        self.structured_format()  # raises for two constraints at once
        return self

    def structured_format(self) -> dict[str, Any] | None:
        """SamplingParams.response_format from whichever of response_format, structured_outputs and guided_* the
        request gave (one at most; SamplingParams checks the value)."""
        given = []
        if self.response_format is not None and self.response_format.get("type") != "text":
            given.append(("response_format", self.response_format))
        for name, value in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                            ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar),
                            *((f"structured_outputs.{k}", v) for k, v in (self.structured_outputs or {}).items()
                              if v is not None and v is not False and k not in _STRUCTURED_OPTIONS)):
            if value is None:
                continue
            kind = name.rpartition("_")[2] if name.startswith("guided_") else name.partition(".")[2]
            if kind == "json":
                if isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except ValueError:
                        raise ValueError(f"{name} must be a JSON schema") from None
                given.append((name, {"type": "json_schema", "json_schema": {"schema": value}}))
            elif kind == "json_object":
                given.append((name, {"type": "json_object"}))
            elif kind in ("regex", "choice", "grammar"):
                given.append((name, {"type": kind, kind: value}))
            else:
                raise ValueError(f"{name} is not a structured output this server takes (json, json_object, regex, "
                                 "choice, grammar)")
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(n for n, _ in given)}")
        return given[0][1] if given else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (with include_usage): each chunk's usage counts its choice so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs."""
        return self.prompt_logprobs

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True  # vLLM's: false leaves reasoning_content out (the model still thinks)
    # vLLM's: tokens a thinking answer may reason for before </think> is forced (SamplingParams.thinking_budget)
    thinking_token_budget: int | None = Field(None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the last (assistant) message is the start of the answer, which the model continues
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # Prompt caching: accepted; the cache is content-addressed, so the key routes nothing here.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_chat_fields(cls, data: Any) -> Any:
        return refuse_unsupported(data, _CHAT_UNSUPPORTED)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in \
                self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per token (0: the chosen token only), None: off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with add_generation_prompt where the request turned it off."""
        if self.add_generation_prompt or self.continue_final_message:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": False}

    def forced_tools(self, tools) -> ForcedTools | None:
        """The calls tool_choice forces of `tools` (the template's, tool_choice.py); None for "auto" and "none". A
        request that also constrains its output is a 400."""
        forced = openai_forced_tools(self.tool_choice, tools, parallel=self.parallel_tool_calls)
        self.output_format(forced)
        return forced

    def output_format(self, forced: ForcedTools | None) -> dict[str, Any] | None:
        """SamplingParams.response_format: the forced calls' schema, else the request's own constraint."""
        return output_format(forced, self.structured_format(), "the request")

    def thinking(self, default: bool, forced: ForcedTools | None = None) -> bool:
        """Whether the model thinks first (chat_prompt.thinking_mode); `default`: the server's --default-thinking."""
        return thinking_mode(default, template_kwargs=self.chat_template_kwargs,
                             reasoning_effort=self.reasoning_effort, response_format=self.output_format(forced))

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: prompt_logprobs' own, else with echo the logprobs' (the prompt's tokens
        are echoed with theirs, as OpenAI's legacy completions did)."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (a string or a list of token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(item, int) for item in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class TokenizeRequest(_Lenient):
    """vLLM's /tokenize: a completions prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # vLLM's; Qwen's tokenizer adds none either way
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def as_chat(self, model: str) -> ChatCompletionRequest:
        """The chat request these messages would be (for its rendering)."""
        return ChatCompletionRequest(model=model, messages=self.messages or [], tools=self.tools,
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     continue_final_message=self.continue_final_message,
                                     **({} if self.add_generation_prompt else {"add_generation_prompt": False}))


class DetokenizeRequest(_Lenient):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]
