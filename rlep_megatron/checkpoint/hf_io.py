"""Reading HF checkpoints (config.json, single or sharded safetensors) one tensor at a time."""
from __future__ import annotations

import json
import os
import struct
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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """``({name: {"dtype", "shape", "data_offsets"}}, offset of the data section)`` of a
    safetensors file, checked against the file's size."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a {size}-byte file")
            header = json.loads(f.read(length))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable safetensors file (truncated or corrupt?): "
                         f"{err}") from None
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + length + end > size:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, the header "
                         f"describes {8 + length + end})")
    return header, 8 + length


class SafetensorsReader:
    """Tensor-by-tensor access to ``model.safetensors`` or an index of shards.

    Tensors are read with plain file reads into fresh tensors (no memory map), so a pass over
    a checkpoint keeps only the tensors still referenced resident, not the files' pages."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
            self.weight_map = None
        else:
            raise FileNotFoundError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}
        if self.weight_map is None:
            header, _ = self._header(SINGLE_FILE)
            self.weight_map = {name: SINGLE_FILE for name in header}

    def _header(self, file_name: str) -> tuple[dict[str, Any], int]:
        if file_name not in self._headers:
            path = os.path.join(self.hf_dir, file_name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is listed in {INDEX_FILE} but missing")
            self._headers[file_name] = read_safetensors_header(path)
        return self._headers[file_name]

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The tensor's dtype and shape, from the file's header (nothing read but it)."""
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in {self.hf_dir}")
        entry = self._header(self.weight_map[name])[0][name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{self.hf_dir}: {name!r} has unsupported dtype {entry['dtype']}")
        return _DTYPES[entry["dtype"]], tuple(entry["shape"])

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in {self.hf_dir}")
        file_name = self.weight_map[name]
        header, data_start = self._header(file_name)
        path = os.path.join(self.hf_dir, file_name)
        if name not in header:
            raise ValueError(f"{path} has no tensor {name!r} although {INDEX_FILE} lists it")
        entry = header[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: {name!r} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        if tensor.numel() * tensor.element_size() != end - start:
            raise ValueError(f"{path}: {name!r} has {end - start} bytes for shape "
                             f"{entry['shape']} {entry['dtype']} (corrupt header?)")
        with open(path, "rb") as f:
            f.seek(data_start + start)
            read = f.readinto(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))
        if read != end - start:
            raise ValueError(f"{path}: truncated while reading {name!r}")
        return tensor
