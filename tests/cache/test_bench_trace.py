"""The prefix-cache benchmark's trace (scripts/bench_prefix_cache.py): seeded, and shaped as it promises. No engine."""

import os
import sys
from pathlib import Path

import pytest

from ninfer_jax.frontend import ChatTemplate, load_tokenizer, write_qwen35_tokenizer_files

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_prefix_cache import _EDITED, DEFAULT_SHAPE, generate_trace, turn_messages  # noqa: E402

OPENER = "<|im_start|>assistant\n<think>\n"


def reply(conv: int, turn: int) -> str:
    return f"thought-{conv}-{turn} " * 10


@pytest.fixture(scope="module")
def trace():
    return generate_trace(DEFAULT_SHAPE, seed=0)


@pytest.fixture(scope="module")
def prompts(trace):
    """prompts[c][t]: the rendered text of turn t, the replies before it being placeholders."""
    template = ChatTemplate.qwen35()
    return [[template.render(turn_messages(trace, c, [reply(c, k) for k in range(t)]), list(trace.tools)).text
             for t in range(len(turns))] for c, turns in enumerate(trace.conversations)]


def test_the_trace_is_a_function_of_its_seed(trace):
    assert generate_trace(DEFAULT_SHAPE, seed=0) == trace
    assert generate_trace(DEFAULT_SHAPE, seed=1) != trace
    assert len(trace.conversations) >= 20 and all(len(turns) >= 10 for turns in trace.conversations)


def test_every_conversation_starts_behind_the_same_preamble(trace, prompts):
    shared = os.path.commonprefix([p[0] for p in prompts])
    system_end = shared.find("<|im_end|>")
    assert system_end > 0 and "</tools>" in shared[:system_end] and trace.system in shared[:system_end]
    assert "<|im_start|>user\n" in shared[system_end:]  # the whole system + tools block is shared
    assert len({p[0] for p in prompts}) == len(prompts)  # and the first queries differ


def test_turn_kinds_extend_re_render_or_edit_the_history(trace, prompts):
    kinds = {turn.kind for turns in trace.conversations for turn in turns}
    assert kinds == {"start", "user", "tool", "edit"}
    for c, turns in enumerate(trace.conversations):
        assert turns[0].kind == "start" and any(turn.kind == "user" for turn in turns)
        for t in range(1, len(turns)):
            before, now = prompts[c][t - 1], prompts[c][t]
            shared = len(os.path.commonprefix([before, now]))
            if turns[t].kind == "tool":  # the reply keeps its reasoning: the prompt extends the last one
                assert now.startswith(before) and reply(c, t - 1).strip() in now
                assert len(now) > len(before) + 2000
            elif turns[t].kind == "user":  # the previous answer re-rendered without its reasoning
                assert shared == len(before) - len(OPENER) + len("<|im_start|>assistant\n")
                assert reply(c, t - 1).strip() not in now
            else:  # edit: an earlier tool result changed, deep in the history
                assert _EDITED in now and _EDITED not in before
                assert shared < 0.75 * len(before)
    assert sum(turn.kind == "edit" for turns in trace.conversations for turn in turns) >= 5


def test_histories_grow_past_30k_tokens_behind_a_preamble_of_several_thousand(trace, prompts, tmp_path_factory):
    tokenizer = load_tokenizer(write_qwen35_tokenizer_files(tmp_path_factory.mktemp("qwen35")))
    first = prompts[0][0]
    preamble = len(tokenizer.encode(first[: first.index("<|im_end|>")]))
    finals = [len(tokenizer.encode(p[-1])) for p in prompts]
    assert 5000 <= preamble <= 10000
    assert max(finals) > 30000 and min(finals) > 2.5 * preamble
