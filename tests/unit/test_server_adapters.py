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

        if isinstance(self.answer, tuple):
            rank, updating = self.answer
            return {"results": [{"max_lora_rank": rank, "runtime_updating": updating}]}
        raise RolloutServerError(f"rollout server {self.url} answered {path} with 500")


class _Clients:
    def __init__(self, answer):
        self.clients = [_Client(answer)]


@pytest.mark.parametrize("answer, needle", [
    (None, r"does not take LoRA adapters .*--enable-lora --max-lora-rank 8 --max-loras 1 "
           r"--worker-extension-cls .*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
    ((0, True), "runs without --enable-lora"),
    ((8, False), "runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
    ((1, True), "up to rank 1, below lora.rank=8: start it with --max-lora-rank 8"),
])
def test_a_server_that_cannot_take_the_adapter_is_refused(answer, needle):
    from rlep_megatron.config import LoraConfig
    from rlep_megatron.rollout.servers.adapters import ServerAdapters
    from rlep_megatron.rollout.servers.client import RolloutServerError

    with pytest.raises(RolloutServerError, match=needle):
        ServerAdapters(_Clients(answer), LoraConfig(rank=8), "base", timeout_s=60)
    ServerAdapters(_Clients((8, True)), LoraConfig(rank=8), "base", timeout_s=60)


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
    name, other = "rlep-0abc-s0-1", "rlep-0abc-s0-2"
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
    with pytest.raises(ValueError, match="not an adapter directory"):
        workers[0].rlep_adapter_remove("../../etc")


class _Server:
    """A server's routes as ServerAdapters uses them, over real worker extensions (two
    workers: the first of the host writes); a loaded adapter is read back from its files."""

    def __init__(self, url):
        from types import SimpleNamespace

        from rlep_megatron.rollout.servers.adapters import AdapterWorkerExtension

        self.url, self.loaded, self.versions = url, {}, []
        self.workers = []
        for local_rank in (0, 1):
            worker = AdapterWorkerExtension()
            worker.local_rank = local_rank
            worker.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=8))
            self.workers.append(worker)

    def world_size(self):
        return len(self.workers)

    def call(self, method, path, json=None, **kwargs):
        from safetensors.torch import load_file

        if path == "/collective_rpc":
            return {"results": [getattr(w, json["method"])(*json["args"])
                                for w in self.workers]}
        if path == "/v1/load_lora_adapter":
            weights = os.path.join(json["lora_path"], "adapter_model.safetensors")
            self.loaded[json["lora_name"]] = load_file(weights)
        elif path == "/v1/unload_lora_adapter":
            del self.loaded[json["lora_name"]]
        elif path == "/update_weight_version":
            self.versions.append(json["new_version"])
        return "ok"


def test_servers_sharing_a_host_each_get_every_update_whole(tmp_path, monkeypatch):
    """Two servers of one job on one host (a rollout node's servers): at each update each
    loads the update's adapter intact from a directory of its own, the previous one is
    unloaded and its files gone, and nothing of the job is left after it closes."""
    from rlep_megatron.config import LoraConfig
    from rlep_megatron.rollout.servers import adapters
    from rlep_megatron.rollout.servers.client import FanOutClient

    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    monkeypatch.setattr(adapters, "PART_BYTES", 700)  # many parts, sent by both at once
    servers = [_Server("http://gen0:8000"), _Server("http://gen0:8001")]
    delivery = adapters.ServerAdapters(FanOutClient(servers), LoraConfig(rank=8), "base",
                                       timeout_s=60)
    names = []
    for version in (0, 1):
        tensors = {f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{f}.weight":
                   torch.randn(8, 64, generator=torch.Generator().manual_seed(version))
                   for layer in range(2) for f in "AB"}
        delivery.start()
        delivery.send(iter(tensors.items()))
        delivery.finish(str(version))
        names.append(delivery.current)
        for server in servers:
            assert list(server.loaded) == [delivery.current]  # the previous one unloaded
            got = server.loaded[delivery.current]
            assert got.keys() == tensors.keys()
            assert all(torch.equal(got[k], v) for k, v in tensors.items())
        assert len(os.listdir(tmp_path / "rlep-server-adapters")) == 2  # one per server
    assert names[0] != names[1] and servers[0].versions == ["0", "1"]
    delivery.close()
    assert os.listdir(tmp_path / "rlep-server-adapters") == []
    assert all(not server.loaded for server in servers)
