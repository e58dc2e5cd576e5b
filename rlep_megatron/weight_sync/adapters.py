"""The weight stream of ``rollout.lora_sync=adapter``: the LoRA adapter's tensors alone, under
PEFT's names, full on every rank (the frozen base never moves: the engine loaded it once). The
same interface as :class:`~rlep_megatron.weight_sync.WeightStreamer` (``names``, ``plan``,
``total_bytes``, ``iter_tensors``), so the loop delivers it through the one weight lifecycle."""
from __future__ import annotations

from typing import Iterator

import torch

from rlep_megatron.lora import peft_io


class AdapterStreamer:
    """Build it once after the adapters are attached (collective: it reads their shapes)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.chunks = chunks
        tensors = peft_io.full_tensors(chunks)
        self._plan = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        self.total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self._plan]

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return list(self._plan)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every adapter tensor of the current policy. Collective over the TP and PP groups."""
        yield from peft_io.full_tensors(self.chunks).items()
