"""Frontend: tokenizer, chat template, and PreparedPrompt (block hashes, tap hints)."""

from .block_hash import BLOCK_TOKENS, chain_block_hashes
from .chat_layout import ChatLayout
from .chat_template import ChatTemplate, ChatTemplateError, RenderedChat, load_chat_template
from .detokenizer import IncrementalDetokenizer
from .prepared_prompt import (Breakpoint, PreparedPrompt, TapHint, TapHintKind, keep_last_tokens, prepare_chat,
                              prepare_tokens)
from .qwen35_template import QWEN35_CHAT_TEMPLATE
from .tokenizer import Tokenizer, TokenizerNotFoundError, load_tokenizer, write_qwen35_tokenizer_files
from .vision_prompt import PromptImage, PromptMedia, VisionFrontend

__all__ = [
    "BLOCK_TOKENS",
    "Breakpoint",
    "ChatLayout",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "PreparedPrompt",
    "PromptImage",
    "PromptMedia",
    "QWEN35_CHAT_TEMPLATE",
    "RenderedChat",
    "TapHint",
    "TapHintKind",
    "Tokenizer",
    "TokenizerNotFoundError",
    "VisionFrontend",
    "chain_block_hashes",
    "keep_last_tokens",
    "load_chat_template",
    "load_tokenizer",
    "prepare_chat",
    "prepare_tokens",
    "write_qwen35_tokenizer_files",
]
