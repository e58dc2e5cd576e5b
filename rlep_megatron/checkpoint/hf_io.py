"""Reading HF checkpoints (config.json, single or sharded safetensors) one tensor at a time."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"HF checkpoint directory not found: {hf_dir}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir} has no config.json; is it an HF checkpoint directory?")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None


class SafetensorsReader:
    """Tensor-by-tensor access to ``model.safetensors`` or an index of shards."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.hf_dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
            self.weight_map = None
        else:
            raise FileNotFoundError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._safe_open = safe_open
        self._handles: dict[str, Any] = {}
        if self.weight_map is None:
            handle = self._open(SINGLE_FILE)
            self.weight_map = {name: SINGLE_FILE for name in handle.keys()}

    def _open(self, file_name: str):
        if file_name not in self._handles:
            path = os.path.join(self.hf_dir, file_name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is listed in {INDEX_FILE} but missing")
            try:
                self._handles[file_name] = self._safe_open(path, framework="pt", device="cpu")
            except Exception as err:
                raise ValueError(f"{path}: unreadable safetensors file (truncated or corrupt?): "
                                 f"{err}") from None
        return self._handles[file_name]

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in {self.hf_dir}")
        file_name = self.weight_map[name]
        try:
            return self._open(file_name).get_tensor(name)
        except (ValueError, FileNotFoundError):
            raise
        except Exception as err:
            raise ValueError(f"{os.path.join(self.hf_dir, file_name)}: cannot read {name!r} "
                             f"(truncated or corrupt?): {err}") from None
