"""PreparedPrompt: tap hints land on the intended text, and block hashes chain per §5.1."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from frontend_support import qwen35_dir, tokenizer  # noqa: F401
from ninfer_jax.frontend import (
    BLOCK_TOKENS,
    Breakpoint,
    ChatTemplate,
    TapHint,
    TapHintKind,
    chain_block_hashes,
    keep_last_tokens,
    prepare_chat,
    prepare_tokens,
)
from ninfer_jax.prefix_cache.hashing import block_lookup_hash, encode_tokens

K = TapHintKind
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}

CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Read this document. "}, {"type": "text", "text": "Summarise it."}],
    },
    {
        "role": "assistant",
        "content": "Looking it up.",
        "reasoning_content": "Old reasoning.",
        "tool_calls": [{"function": {"name": "lookup", "arguments": "{}"}}],
    },
    {"role": "tool", "content": "first result"},
    {"role": "tool", "content": "second result"},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": "Thanks, and now?"},
]


# What precedes each message start but the first (the system turn at 0).
BOUNDARY_ENDS = [
    "a careful assistant.<|im_end|>\n",  # -> the user turn
    "Summarise it.<|im_end|>\n",  # -> the assistant turn
    "</tool_call><|im_end|>\n",  # -> the first tool result, which opens a user turn
    "\nfirst result\n</tool_response>",  # -> the second tool result, in the same turn
    "second result\n</tool_response><|im_end|>\n",  # -> the assistant's "Done."
    "assistant\nDone.<|im_end|>\n",  # -> the last user turn
]


def text_before(tokenizer, prompt, hint: TapHint) -> str:
    return tokenizer.decode(prompt.token_ids[: hint.position].tolist())


def hints_of(prompt, kind: TapHintKind) -> list[TapHint]:
    return [h for h in prompt.tap_hints if h.kind == kind]


def test_hints_fall_after_the_structure_they_name(tokenizer):
    breakpoints = [Breakpoint(1, part_index=0), Breakpoint(4), Breakpoint(6, explicit=False)]
    prompt = prepare_chat(tokenizer, CONVERSATION, [TOOL], breakpoints=breakpoints)

    (tools_end,) = hints_of(prompt, K.END_OF_TOOLS)
    assert text_before(tokenizer, prompt, tools_end).endswith("about function calls\n</IMPORTANT>")
    (system_end,) = hints_of(prompt, K.END_OF_SYSTEM)
    assert text_before(tokenizer, prompt, system_end).endswith("You are a careful assistant.<|im_end|>\n")
    (opener,) = hints_of(prompt, K.GENERATION_OPENER)
    assert text_before(tokenizer, prompt, opener).endswith("Thanks, and now?<|im_end|>\n")
    assert tokenizer.decode(prompt.token_ids[opener.position :].tolist()) == "<|im_start|>assistant\n<think>\n"

    part, tool_group = hints_of(prompt, K.EXPLICIT)
    assert text_before(tokenizer, prompt, part).endswith("Read this document.")  # the space joins "Summarise"
    assert text_before(tokenizer, prompt, tool_group).endswith("second result\n</tool_response><|im_end|>\n")
    (automatic,) = hints_of(prompt, K.AUTOMATIC)
    assert automatic.position == opener.position

    boundaries = [text_before(tokenizer, prompt, h) for h in hints_of(prompt, K.MESSAGE_BOUNDARY)]
    assert len(boundaries) == len(BOUNDARY_ENDS)
    assert [b[-len(e) :] for b, e in zip(boundaries, BOUNDARY_ENDS)] == BOUNDARY_ENDS


def test_hints_are_sorted_unique_and_inside_the_prompt(tokenizer):
    prompt = prepare_chat(tokenizer, CONVERSATION, [TOOL], breakpoints=[Breakpoint(4), Breakpoint(4)])
    assert list(prompt.tap_hints) == sorted(set(prompt.tap_hints))
    assert all(0 < h.position < prompt.num_tokens for h in prompt.tap_hints)
    assert len(hints_of(prompt, K.EXPLICIT)) == 1


def test_token_ids_are_the_tokenized_rendering(tokenizer):
    prompt = prepare_chat(tokenizer, CONVERSATION, [TOOL], enable_thinking=False)
    text = ChatTemplate.qwen35().render(CONVERSATION, [TOOL], enable_thinking=False).text
    assert prompt.token_ids.dtype == np.int32
    assert prompt.token_ids.tolist() == tokenizer.encode(text)
    assert not prompt.token_ids.flags.writeable and not prompt.block_hashes.flags.writeable
    np.testing.assert_array_equal(prompt.block_hashes, chain_block_hashes(prompt.token_ids))


def test_thinking_off_opener_and_no_structural_hints_without_system_or_tools(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Q"},
    ]
    prompt = prepare_chat(tokenizer, messages, enable_thinking=False)
    assert {h.kind for h in prompt.tap_hints} == {K.MESSAGE_BOUNDARY, K.GENERATION_OPENER}
    (opener,) = hints_of(prompt, K.GENERATION_OPENER)
    opener_text = tokenizer.decode(prompt.token_ids[opener.position :].tolist())
    assert opener_text == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_breakpoint_naming_a_missing_message_or_part_is_an_index_error(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(IndexError, match="message 3"):
        prepare_chat(tokenizer, messages, breakpoints=[Breakpoint(3)])
    with pytest.raises(IndexError, match="part 1"):
        prepare_chat(tokenizer, messages, breakpoints=[Breakpoint(0, part_index=1)])


def test_prepare_tokens_hashes_and_gives_no_hints():
    prompt = prepare_tokens(list(range(200)))
    assert prompt.tap_hints == () and prompt.num_tokens == 200
    assert prompt.block_hashes.shape == (3,) and prompt.block_hashes.dtype == np.uint64


def test_block_hash_is_xxh3_over_previous_hash_tokens_and_extra():
    tokens = np.arange(2 * BLOCK_TOKENS, dtype=np.int32) * 7919
    first = xxhash.xxh3_64_intdigest(
        (5).to_bytes(8, "little") + tokens[:BLOCK_TOKENS].astype("<u4").tobytes() + (9).to_bytes(8, "little")
    )
    second = xxhash.xxh3_64_intdigest(
        first.to_bytes(8, "little") + tokens[BLOCK_TOKENS:].astype("<u4").tobytes() + (0).to_bytes(8, "little")
    )
    assert chain_block_hashes(tokens, extra_keys=[9, 0], seed=5).tolist() == [first, second]


def test_a_change_in_block_b_changes_hashes_from_b_on_only():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 248077, 5 * BLOCK_TOKENS + 17)
    base = chain_block_hashes(tokens)
    assert base.shape == (5,)  # the partial tail block is not hashed
    np.testing.assert_array_equal(chain_block_hashes(tokens[: 3 * BLOCK_TOKENS + 5]), base[:3])  # equal prefixes
    changed = tokens.copy()
    changed[2 * BLOCK_TOKENS + 40] += 1
    after = chain_block_hashes(changed)
    np.testing.assert_array_equal(after[:2], base[:2])
    assert all(after[2:] != base[2:])
    tail_changed = tokens.copy()
    tail_changed[-1] += 1
    np.testing.assert_array_equal(chain_block_hashes(tail_changed), base)


def test_extra_keys_and_seed_change_the_chain():
    tokens = np.arange(3 * BLOCK_TOKENS)
    base = chain_block_hashes(tokens)
    with_media = chain_block_hashes(tokens, extra_keys=[0, 123, 0])
    np.testing.assert_array_equal(with_media[:1], base[:1])
    assert all(with_media[1:] != base[1:])
    assert all(chain_block_hashes(tokens, seed=1) != base)


def test_a_cache_salt_keys_block_zero_and_so_every_block_after_it():
    tokens = np.arange(2 * BLOCK_TOKENS + 10)
    plain = prepare_tokens(tokens)
    assert plain.block_extras is None and plain.block_extra(0) == 0
    a, again, b = (prepare_tokens(tokens, cache_salt=s) for s in ("tenant-a", "tenant-a", "tenant-b"))
    np.testing.assert_array_equal(a.block_hashes, again.block_hashes)
    assert all(a.block_hashes != plain.block_hashes) and all(a.block_hashes != b.block_hashes)
    # the salt is block 0's extra key only; the tail block's key is there for a tail's lookup
    assert a.block_extras == (a.block_extra(0), 0, 0) and a.block_extra(0) not in (0, b.block_extra(0))
    first = block_lookup_hash(0, encode_tokens(tokens[:BLOCK_TOKENS]), a.block_extra(0))
    assert a.block_hashes.tolist() == [first, block_lookup_hash(first, encode_tokens(tokens[BLOCK_TOKENS:128]))]
    # a prompt shorter than a block keys the block its generated tokens complete
    assert prepare_tokens(tokens[:10], cache_salt="tenant-a").block_extra(0) == a.block_extra(0)
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            prepare_tokens(tokens, cache_salt=bad)


def test_keeping_the_last_tokens_hashes_them_as_a_prompt_of_their_own_with_its_salt_and_hints():
    import dataclasses

    tokens = np.arange(3 * BLOCK_TOKENS + 5)
    hints = (TapHint(40, K.END_OF_SYSTEM), TapHint(150, K.MESSAGE_BOUNDARY))
    prompt = prepare_tokens(tokens, hints, cache_salt="tenant-a")
    kept = keep_last_tokens(prompt, 2 * BLOCK_TOKENS)
    want = prepare_tokens(tokens[-2 * BLOCK_TOKENS:], cache_salt="tenant-a")
    np.testing.assert_array_equal(kept.token_ids, want.token_ids)
    np.testing.assert_array_equal(kept.block_hashes, want.block_hashes)
    assert kept.salt == prompt.salt and kept.tap_hints == (TapHint(150 - 69, K.MESSAGE_BOUNDARY),)
    assert keep_last_tokens(prompt, len(tokens)) is prompt
    with_media = dataclasses.replace(prompt, media=object())  # only its presence matters here
    assert keep_last_tokens(with_media, len(tokens)) is with_media
    with pytest.raises(ValueError, match="cannot cut a prompt with images"):
        keep_last_tokens(with_media, 10)


@pytest.mark.parametrize(
    "tokens,extra,error",
    [([-1] * 64, None, "must lie in"), ([[1, 2]], None, "1-D"), (list(range(128)), [0], "one key per full block")],
)
def test_block_hash_rejects_bad_input(tokens, extra, error):
    with pytest.raises(ValueError, match=error):
        chain_block_hashes(tokens, extra_keys=extra)


def test_hints_after_multibyte_and_decomposed_text_land_on_the_turn_end(tokenizer):
    messages = [{"role": "system", "content": "Cafe\u0301 🎉👩‍👩‍👧 人力资源"},
                {"role": "user", "content": "x\u0301 🎉"}]
    prompt = prepare_chat(tokenizer, messages, breakpoints=[Breakpoint(1)])
    (system_end,) = hints_of(prompt, K.END_OF_SYSTEM)
    assert text_before(tokenizer, prompt, system_end).endswith("Café 🎉👩‍👩‍👧 人力资源<|im_end|>\n")
    (explicit,) = hints_of(prompt, K.EXPLICIT)
    assert text_before(tokenizer, prompt, explicit).endswith("x\u0301 🎉<|im_end|>\n")
