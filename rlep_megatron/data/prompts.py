"""Prompt rendering and tokenisation: the chat template (plain text when the tokenizer has
none), left truncation to the prompt budget (docs/ALGORITHM.md section 3, step 2)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    """``[num_tokens]`` prompt ids after left truncation."""
    num_truncated_tokens: int
    """Tokens dropped from the left (0 when the prompt fits)."""


def render_prompt_text(tokenizer, messages: Sequence[dict]) -> str:
    """The text the model sees: chat template with the assistant turn opened, or the messages'
    contents joined by newlines when the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def tokenize_prompt(tokenizer, messages: Sequence[dict], max_prompt_tokens: int) -> RenderedPrompt:
    text = render_prompt_text(tokenizer, messages)
    # The template already holds any special tokens; do not let the tokenizer add more.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    overflow = max(0, len(ids) - max_prompt_tokens)
    return RenderedPrompt(token_ids=ids[overflow:], num_truncated_tokens=overflow)
