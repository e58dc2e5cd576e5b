"""Checks a megatron model against HF ``transformers`` on the same prompts: the maximum
absolute difference of per-token log-probs (``tools/verify_conversion.py``).

Run under torchrun at the layout to check; the megatron side runs sharded, the HF reference runs
on the rank holding the last pipeline stage's TP rank 0.
"""
from __future__ import annotations

import torch

DEFAULT_PROMPTS = (
    "What is 12 + 7? Answer: 19",
    "Compute 3 * (4 + 5) step by step.\n3 * 9 = 27\nAnswer: 27",
    "x",
    "The quick brown fox jumps over the lazy dog; 1,2,3,4,5,6,7,8,9,10!",
    "2+2",
)


def hf_token_logprobs(hf_dir: str, input_ids: torch.Tensor, lengths: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[n, seq]`` log p(token t | tokens < t) from transformers, column 0 = 0; each
    sequence runs alone (no padding), so the reference is independent of padding handling."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=dtype)
    model.eval()
    out = torch.zeros(input_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for row in range(input_ids.shape[0]):
            ids = input_ids[row, : int(lengths[row])].unsqueeze(0)
            logits = model(ids).logits[0, :-1].double()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out[row, 1: int(lengths[row])] = logp
    return out


def max_abs_logprob_diff(megatron_logp: torch.Tensor, reference: torch.Tensor,
                         lengths: torch.Tensor) -> float:
    positions = torch.arange(reference.shape[1]).unsqueeze(0)
    valid = (positions >= 1) & (positions < lengths.unsqueeze(1))
    return float((megatron_logp.double() - reference).abs()[valid].max())
