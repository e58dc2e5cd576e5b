"""What a rollout engine returns: one sampled :class:`Response`, and the text of its tokens as
vLLM's detokenizer gives it (:func:`decode_response`). Shared by both backends and their
request drivers (``rollout/contract.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Response:
    """One sampled response."""

    prompt_index: int            # index into the prompt list given to ``generate``
    token_ids: list[int]         # includes the EOS token when the response stopped on it
    logprobs: list[float]        # vLLM's log-prob of each sampled token (at the temperature)
    text: str
    finish_reason: str           # "stop" (EOS / stop token) or "length"
    routing: Optional[np.ndarray] = None
    """Mixture-of-experts engines with routing capture: ``[prompt + response, layers, k]``
    expert ids per position (-1: none; :mod:`rlep_megatron.rollout.routing_capture`)."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """``(policy version, number of tokens)`` spans over ``token_ids``, in order: which weights
    sampled each token (set by the scheduler that drove the engine)."""
    routing_key: Optional[tuple[int, int]] = None
    """Where ``routing`` went when several replicas gathered their responses: ``(rank, key)``
    of the rank that holds it (:mod:`rlep_megatron.actor.routing_store`)."""

    @property
    def length(self) -> int:
        return len(self.token_ids)


# a response is decoded after this many of its prompt's last tokens
_CONTEXT_TOKENS = 8


def decode_response(tokenizer, prompt: list[int], token_ids: list[int]) -> str:
    """The response's text as vLLM's detokenizer gives it: decoded after the prompt's last
    tokens (a tokenizer whose decoder drops the leading space of a text's first word, as
    SentencePiece's does, keeps the space a response starts with), special tokens skipped, no
    clean-up of spaces, and the bytes of a character the response ends inside (byte-level tokens
    cut by the length budget) not shown as a replacement character."""
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)

    context = list(prompt[max(0, len(prompt) - _CONTEXT_TOKENS):])
    text = None
    if context:
        prefix, full = decode(context), decode(context + token_ids)
        if full.startswith(prefix):
            text = full[len(prefix):]
    if text is None:
        text = decode(token_ids)
    return text.rstrip("\ufffd")
