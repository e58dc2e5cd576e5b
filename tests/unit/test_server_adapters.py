"""``rollout.lora_sync=adapter`` on rollout servers before any server runs: the ``vllm serve``
command a user is given, the refusal of a server that does not take adapters, and the server
end's files (an adapter sent in parts arrives whole, as a PEFT directory that peft's format
reader takes, and nothing of a job is left after it)."""
import base64
import json
import os

import pytest
import torch

from rlep_megatron import config as config_lib

pytestmark = pytest.mark.unit

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def test_the_serve_command_of_an_adapter_recipe(tmp_path):
    from rlep_megatron.recipe_init import serve_command

    raw = config_lib.config_to_dict(config_lib.load_config(
        os.path.join(EXAMPLES, "tiny_cpu_baseline.yaml"), [
            "rollout.placement=separate", "rollout.server_urls=[http://gen0:8000]",
            "lora.rank=10", "rollout.lora_sync=adapter"]))
    command = serve_command(raw)
    assert command.startswith("VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 ")
    args = command.split()
    assert args[args.index("--max-lora-rank") + 1] == "16"  # vLLM's slot above rank 10
    assert "--enable-lora" in args and "--load-format" not in args  # the base from disk
    assert (args[args.index("--worker-extension-cls") + 1]
            == "rlep_megatron.rollout.servers.adapters.AdapterWorkerExtension")
    merged = serve_command({**raw, "rollout": {**raw["rollout"], "lora_sync": "merged"}})
    assert "--enable-lora" not in merged and "--load-format dummy" in merged


class _Client:
    url = "http://gen0:8000"

    def __init__(self, answer):
        self.answer = answer

    def call(self, method, path, **kwargs):
        from rlep_megatron.rollout.servers.client import RolloutServerError

        if isinstance(self.answer, Exception):
            raise self.answer
        if isinstance(self.answer, int):
            return {"results": [{"max_lora_rank": self.answer}]}
        raise RolloutServerError(f"rollout server {self.url} answered {path} with 500")


class _Clients:
    def __init__(self, answer):
        self.clients = [_Client(answer)]


@pytest.mark.parametrize("answer, needle", [
    (None, r"does not take LoRA adapters .*--enable-lora --max-lora-rank 8 --max-loras 1 "
           r"--worker-extension-cls .*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
    (1, "up to rank 1, below lora.rank=8: start it with --max-lora-rank 8"),
])
def test_a_server_that_cannot_take_the_adapter_is_refused(answer, needle):
    from rlep_megatron.config import LoraConfig
    from rlep_megatron.rollout.servers.adapters import ServerAdapters
    from rlep_megatron.rollout.servers.client import RolloutServerError

    with pytest.raises(RolloutServerError, match=needle):
        ServerAdapters(_Clients(answer), LoraConfig(rank=8), "base", timeout_s=60)
    ServerAdapters(_Clients(8), LoraConfig(rank=8), "base", timeout_s=60)


def test_an_adapter_sent_in_parts_arrives_whole(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save

    from rlep_megatron.rollout.servers import adapters

    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(adapters, "PART_BYTES", 1000)
    workers = []
    for local_rank in (0, 1):  # two workers of one server on this host: the first writes
        worker = adapters.AdapterWorkerExtension()
        worker.local_rank = local_rank
        workers.append(worker)
    tensors = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{f}.weight":
               torch.randn(4, 64) for f in "AB"}
    payload = save(tensors)
    name, other = "rlep-0abc-1", "rlep-0abc-2"
    for worker in workers:
        for index in range(0, len(payload), adapters.PART_BYTES):
            part = base64.b64encode(payload[index:index + adapters.PART_BYTES]).decode()
            worker.rlep_adapter_part(name, str(index // adapters.PART_BYTES), part)
    paths = {w.rlep_adapter_commit(name, json.dumps({"r": 4})) for w in workers}
    assert paths == {str(tmp_path / "rlep-server-adapters" / name)}
    path = paths.pop()
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.load(open(os.path.join(path, "adapter_config.json"))) == {"r": 4}
    loaded = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    workers[0].rlep_adapter_part(other, "0", base64.b64encode(payload).decode())
    workers[0].rlep_adapter_remove(name, "job")  # every adapter of the job, staged ones too
    assert os.listdir(tmp_path / "rlep-server-adapters") == []
    with pytest.raises(ValueError, match="not an adapter name"):
        workers[0].rlep_adapter_remove("../../etc")
