"""How vLLM serves the policy's adapter (``rollout.lora_sync=adapter``): the LoRA slot ranks it
has, and the engine settings that make room for one adapter of a run's rank. The colocated
engine passes them to its ``LLM``, a rollout server takes them as ``vllm serve`` flags."""
from __future__ import annotations

from rlep_megatron.config import VLLM_LORA_RANKS


def lora_slot_rank(rank: int) -> int:
    """The smallest vLLM LoRA slot rank an adapter of ``rank`` fits in."""
    if rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"lora.rank={rank} is above vLLM's largest LoRA rank "
                         f"({VLLM_LORA_RANKS[-1]}); use rollout.lora_sync=merged")
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def engine_settings(rank: int) -> dict:
    """vLLM engine arguments for one adapter of ``rank`` at a time: the policy's current one
    (each update brings a new adapter; the previous one is no longer asked for)."""
    return {"enable_lora": True, "max_lora_rank": lora_slot_rank(rank), "max_loras": 1}


def serve_flags(rank: int) -> list[str]:
    """:func:`engine_settings` as ``vllm serve`` flags."""
    settings = engine_settings(rank)
    return ["--enable-lora", "--max-lora-rank", str(settings["max_lora_rank"]),
            "--max-loras", str(settings["max_loras"])]
