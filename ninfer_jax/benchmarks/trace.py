"""A seeded multi-turn agentic trace (pure Python): conversations of agent turns behind one long shared system +
tools preamble, to be rendered with the real Qwen3.5 chat template.

After the task query a turn is a follow-up query ("user": the template re-renders the answer before it without
its reasoning), a tool result of a few thousand tokens ("tool"), or an earlier tool result edited and the
question asked again ("edit": a deep edit). The assistant replies are filled in at run time (`turn_messages`).
"""

from __future__ import annotations

import dataclasses
import random
import re

_PROSE = (
    "the a of to and in is for on that with as by this be it are from at or an not which will when all can "
    "each must should file files change changes test tests run build code module function class value values "
    "request requests cache state error errors result results user project review before after only never "
    "always first last next every other same new old path paths line lines output input data config option "
    "options service server client report issue issues step steps check checks keep write read update use "
    "used make sure task tasks plan detail details call calls return returns list lists time order case "
    "cases memory device block blocks page pages slot token tokens model layer layers batch queue worker"
).split()
_CODE = (
    "self cfg args kwargs state cache pages slot tokens result out idx key value node tree parent child "
    "request lane chunk base frontier snapshot index pool entry count total size offset length buffer"
).split()
_TOOL_NAMES = (
    "read_file", "write_file", "edit_file", "list_directory", "grep_search", "glob_files", "run_shell",
    "run_tests", "git_diff", "git_log", "git_status", "web_search", "fetch_url", "python_eval",
    "create_issue", "comment_issue", "ask_user", "todo_write", "open_notebook", "search_symbols",
    "find_references", "format_code", "lint_code", "build_project",
)
EDITED = "\n# NOTE: updated by the user since the last read\n"


@dataclasses.dataclass(frozen=True)
class TraceShape:
    """Sizes of a trace, in words (about 1.1 Qwen3.5 tokens per prose word, 3 per code-like one).

    The default is a coding agent's session: a 12k-token system + tools preamble, tool results of 0.5k-2k
    tokens, 16 turns, histories past 30k. Its exact-cache bound (`reusable`) is 92.6% of the prompt tokens.
    The first shape measured (10 turns, 1500 system words, tool results of 700-1300 words) grew the history
    in 3k-token steps: its bound was 82.7%, below the 90% target of issue #8 for any cache.
    """

    conversations: int = 20
    turns: int = 16
    tools: int = 20  # tool definitions in the shared preamble
    tool_description_words: int = 100
    system_words: int = 6000  # the shared system prompt after the tools block
    user_words: tuple[int, int] = (25, 160)
    tool_result_words: tuple[int, int] = (150, 600)  # code-like text, about 3 tokens per word
    p_user: float = 0.3  # chance of each of up to two more follow-up queries before the agent loop
    edit_every: int = 2  # one conversation in this many has a deep edit in its second half
    # Assistant reply length (generated tokens), drawn per turn. Replies of one fixed length kept the requests in
    # flight in lockstep: they were sent together, decoded together and ended in the same round, so each
    # batch of eight queued behind its own prefills (TTFT = the request's place in that convoy).
    reply_tokens: tuple[int, int] = (32, 96)


DEFAULT_SHAPE = TraceShape()
SMOKE_SHAPE = TraceShape(conversations=3, turns=4, tools=3, tool_description_words=40, system_words=200,
                         user_words=(10, 30), tool_result_words=(40, 120), reply_tokens=(8, 24))


@dataclasses.dataclass(frozen=True)
class Turn:
    """What the client adds before a turn's request, after the assistant reply of the previous turn.

    kind "start": the first user query; "tool": the previous reply called `call` and `message` is its result;
    "user": a new query; "edit": history message `edit[0]` (an earlier tool result) gets content `edit[1]`
    and `message` asks again.
    """

    kind: str
    message: dict
    call: dict | None = None
    edit: tuple[int, str] | None = None
    reply_tokens: int = 64  # max_tokens of the turn's request (greedy, random weights: it runs to the limit)


@dataclasses.dataclass(frozen=True)
class Trace:
    shape: TraceShape
    seed: int
    system: str
    tools: tuple[dict, ...]
    conversations: tuple[tuple[Turn, ...], ...]


def generate_trace(shape: TraceShape = DEFAULT_SHAPE, seed: int = 0) -> Trace:
    """A seeded agentic trace: the same (shape, seed) gives the same trace, in any process.

    Args:
        shape: sizes (conversations, turns, preamble, tool results, mix of turn kinds).
        seed: the only source of randomness.

    Returns:
        The shared preamble (system prompt, tool definitions) and each conversation's turns; the assistant
        replies are filled in at run time (`turn_messages`).
    """
    rng = random.Random(seed)
    replies = random.Random(f"{seed}-replies")  # its own stream: the prompts do not depend on reply_tokens
    tools = tuple(_tool_definition(rng, name, shape.tool_description_words) for name in _TOOL_NAMES[: shape.tools])
    system = "You are a coding agent working in a large repository. " + _prose(rng, shape.system_words)
    conversations = []
    for c in range(shape.conversations):
        kinds = _turn_kinds(rng, shape, has_edit=c % shape.edit_every == 0)
        turns, tool_messages, length = [], [], 2  # history: system, first query
        for t, kind in enumerate(kinds):
            if kind == "start":
                turns.append(Turn(kind, {"role": "user", "content": _user_query(rng, shape, c, t)}))
                continue
            length += 1  # the previous assistant reply
            if kind == "tool":
                tool = rng.choice(tools)["function"]
                call = {"name": tool["name"], "arguments": _call_arguments(rng, tool)}
                message = {"role": "tool", "content": _tool_result(rng, shape, tool["name"])}
                tool_messages.append((length, message["content"]))
                turns.append(Turn(kind, message, call=call))
            else:
                edit = None
                if kind == "edit":  # one of the earlier half of the tool results changed from its middle on
                    index, content = tool_messages[rng.randrange(max(1, len(tool_messages) // 2))]
                    half = len(content) // 2
                    edit = (index, content[:half] + EDITED + _tool_result(rng, shape, "edit")[:half])
                turns.append(Turn(kind, {"role": "user", "content": _user_query(rng, shape, c, t)}, edit=edit))
            length += 1
        conversations.append(tuple(dataclasses.replace(turn, reply_tokens=replies.randint(*shape.reply_tokens))
                                   for turn in turns))
    return Trace(shape, seed, system, tools, tuple(conversations))


def turn_messages(trace: Trace, conv: int, replies: list[str]) -> list[dict]:
    """The chat messages a client sends for turn len(replies) of a conversation.

    Args:
        trace: the trace.
        conv: the conversation.
        replies: the decoded assistant replies of its earlier turns, in order.

    Returns:
        OpenAI-format messages: the shared system prompt, then the history with every edit so far applied.
        Assistant replies carry their text as `reasoning_content` (the template drops it from turns before
        the last user query) and the tool call the next turn answers.
    """
    turns = trace.conversations[conv]
    messages = [{"role": "system", "content": trace.system}, turns[0].message]
    for t, reply in enumerate(replies):
        nxt = turns[t + 1]
        assistant = {"role": "assistant", "content": "", "reasoning_content": reply}
        if nxt.call is not None:
            assistant["tool_calls"] = [{"type": "function", "function": nxt.call}]
        else:
            cut = len(reply) * 3 // 4  # an answer: the reply's end is the visible content
            assistant.update(content=reply[cut:], reasoning_content=reply[:cut])
        messages.append(assistant)
        messages.append(nxt.message)
        if nxt.edit is not None:
            index, content = nxt.edit
            messages[index] = {**messages[index], "content": content}
    return messages


def _turn_kinds(rng: random.Random, shape: TraceShape, has_edit: bool) -> list[str]:
    """A task query, one or more follow-up queries (each re-renders the answer before it without its
    reasoning), then an agent loop of tool results; in some conversations an edit in the loop's second half."""
    follow_ups = 1 + sum(rng.random() < shape.p_user for _ in range(2))
    kinds = ["start"] + ["user"] * follow_ups + ["tool"] * shape.turns
    kinds = kinds[: shape.turns]
    loop = [t for t, kind in enumerate(kinds) if kind == "tool"]
    if has_edit and len(loop) >= 2:  # after at least one tool result
        kinds[rng.choice(loop[max(1, len(loop) // 2) :])] = "edit"
    return kinds


def _prose(rng: random.Random, words: int) -> str:
    sentences, n = [], 0
    while n < words:
        k = rng.randint(8, 22)
        sentence = " ".join(rng.choice(_PROSE) for _ in range(k))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        n += k
    return " ".join(sentences)


def _tool_definition(rng: random.Random, name: str, words: int) -> dict:
    params = {f"{rng.choice(_CODE)}_{i}": {"type": rng.choice(["string", "integer", "boolean"]),
                                          "description": _prose(rng, 12)} for i in range(rng.randint(2, 5))}
    return {"type": "function", "function": {
        "name": name, "description": _prose(rng, words),
        "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]}}}


def _call_arguments(rng: random.Random, tool: dict) -> dict:
    kinds = {"string": lambda: f"src/{rng.choice(_CODE)}/{rng.choice(_CODE)}.py",
             "integer": lambda: rng.randint(1, 500), "boolean": lambda: rng.random() < 0.5}
    return {name: kinds[spec["type"]]() for name, spec in tool["parameters"]["properties"].items()}


def _user_query(rng: random.Random, shape: TraceShape, conv: int, turn: int) -> str:
    return f"[session {conv}, request {turn}] " + _prose(rng, rng.randint(*shape.user_words))


def _tool_result(rng: random.Random, shape: TraceShape, tool: str) -> str:
    """Code-like tool output (numbered source lines) of about the shape's word count."""
    words, lines, n = rng.randint(*shape.tool_result_words), [f"$ {tool}"], 0
    while n < words:
        k = rng.randint(3, 9)
        indent = " " * (4 * rng.randint(0, 3))
        call = f"{rng.choice(_CODE)}.{rng.choice(_CODE)}({', '.join(rng.choice(_CODE) for _ in range(k - 2))})"
        lines.append(f"{len(lines):5d}  {indent}{rng.choice(_CODE)} = {call}")
        n += k
    return "\n".join(lines)


def sanitize_reply(text: str) -> str:
    """A reply as a client sends it back: noise text from random weights, minus the markers the template and
    the reasoning/tool parsers read (a stray `</think>` would change how the history renders)."""
    return re.sub(r"</?(think|tool_call|tool_response)>", "", text)
