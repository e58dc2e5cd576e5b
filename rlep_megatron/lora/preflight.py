"""The checks of a ``lora`` section before anything is built, for the pre-flight
(``rlep config`` and every job) and the learner."""
from __future__ import annotations

from typing import Any

from rlep_megatron.lora import peft_io
from rlep_megatron.lora.targets import check_model


def check(lora, hf_config: dict[str, Any]):
    """:func:`check_model`, and the adapter of ``lora.init_from`` read and checked against the
    model: its tensors, or None without one."""
    if not lora.enabled:
        return None
    check_model(lora, hf_config)
    if not lora.init_from:
        return None
    from rlep_megatron.models import num_experts
    from rlep_megatron.models.llama_family import dims_from_config

    return peft_io.load(lora.init_from, lora, dims_from_config(hf_config),
                        moe=bool(num_experts(hf_config)))
