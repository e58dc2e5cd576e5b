"""Collectives go through rlep_megatron.distributed, which puts tensors where the backend needs
them (NCCL takes CUDA tensors only; a small tensor built on the CPU would crash a GPU job at
its first step). A call of a torch.distributed collective anywhere else in the package fails
this test; the gloo stand-ins of the CPU shim (platform/gloo.py), which replace megatron's own
collectives with gloo ones and run only without CUDA, are the one other place allowed."""
import ast
import os

import pytest
import torch

from rlep_megatron import distributed

pytestmark = pytest.mark.unit

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "rlep_megatron")
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "barrier",
               "send", "recv", "isend", "irecv", "gather", "scatter", "all_to_all",
               "broadcast_object_list", "reduce", "batch_isend_irecv"}
ALLOWED = {os.path.join("rlep_megatron", "distributed.py"),
           os.path.join("rlep_megatron", "platform", "gloo.py")}


def direct_collective_calls(path):
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("torch.distributed", "dist"):
                found.append(f"{path}:{node.lineno} {owner}.{node.func.attr}")
    return found


def test_package_code_calls_collectives_only_through_the_helpers():
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and not any(os.path.normpath(path).endswith(a)
                                                for a in ALLOWED):
                offenders += direct_collective_calls(path)
    assert offenders == []


def test_the_guard_sees_a_direct_call(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import torch\ndef f(t):\n    torch.distributed.all_reduce(t)\n")
    assert len(direct_collective_calls(str(path))) == 1


def test_nccl_collectives_run_on_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.communication_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert distributed.communication_device() == torch.device("cpu")
