"""The trainer end of a weight update to rollout servers: each device tensor is complete
before vLLM's NCCL engine reads it on its own side streams, every transfer wait has a
deadline that names the server, and a stalled gloo transfer ends within it."""
import threading
import time

import pytest
import torch

from rlep_megatron.rollout.servers.weights import TransferStalled, produced, within_deadline

pytestmark = pytest.mark.unit


class _DeviceTensor:
    """Stands for a CUDA tensor (``is_cuda``, ``device``) on a machine without one."""

    is_cuda = True

    def __init__(self, device):
        self.device = device


def test_each_device_tensor_is_handed_on_only_after_its_stream_finished():
    """The ordering contract: the producing stream is waited for before the consumer gets a
    device tensor, every time, and host tensors pass without a wait."""
    log = []
    pairs = [("a", _DeviceTensor("cuda:0")), ("b", torch.zeros(2)),
             ("c", _DeviceTensor("cuda:0"))]

    def producer():
        for name, tensor in pairs:
            log.append(("produced", name))
            yield name, tensor

    for name, _ in produced(producer(), synchronize=lambda device: log.append(("wait", device))):
        log.append(("read", name))
    assert log == [("produced", "a"), ("wait", "cuda:0"), ("read", "a"),
                   ("produced", "b"), ("read", "b"),
                   ("produced", "c"), ("wait", "cuda:0"), ("read", "c")]


def test_without_the_wait_a_side_stream_can_read_a_tensor_before_it_is_written():
    """The race the wait closes, on host threads: a "stream" writes the tensor once it is let
    go, and a "side stream" reads it as soon as it is handed on. Handed on at once, the reader
    sees the old values; through :func:`produced`, whose wait lets the writer finish, the
    new ones."""

    def run(wait: bool) -> float:
        tensor, go = torch.zeros(4), threading.Event()
        writer = threading.Thread(target=lambda: (go.wait(), tensor.fill_(1.0)))
        writer.start()

        def finish_stream(device):
            go.set()
            writer.join()

        pairs = [("w", _DeviceTensor("cuda:0"))]
        stream = produced(pairs, synchronize=finish_stream) if wait else pairs
        seen = [float(tensor.sum()) for _ in stream]
        finish_stream(None)
        return seen[0]

    assert run(wait=False) == 0.0
    assert run(wait=True) == 4.0


def test_a_stalled_transfer_ends_within_its_deadline_naming_the_server():
    hang = threading.Event()
    start = time.monotonic()
    with pytest.raises(TransferStalled, match="http://rollout-7:8000.*within 1 s"):
        within_deadline(hang.wait, 1.0, "the weight transfer to http://rollout-7:8000")
    assert time.monotonic() - start < 10
    hang.set()


def test_a_transfer_that_finishes_or_fails_in_time_passes_through():
    assert within_deadline(lambda: {"tensors": 3}, 5.0, "x") == {"tensors": 3}
    with pytest.raises(ValueError, match="refused"):
        within_deadline(lambda: (_ for _ in ()).throw(ValueError("refused")), 5.0, "x")


class _StalledServer:
    """A rollout server's client whose workers join the transfer group, then stop reading:
    ``update_weights`` never enters the broadcast."""

    def __init__(self):
        self.release = threading.Event()
        self.group = None

    def init_weight_transfer_engine(self, info):
        from rlep_megatron.rollout.servers import gloo_transfer

        self.group, self.store = gloo_transfer._gloo_group(
            info["master_address"], info["master_port"], 1, info["world_size"],
            info["timeout_s"], is_master=False)

    def start_weight_update(self):
        pass

    def update_weights(self, meta):
        self.release.wait()

    def finish_weight_update(self, version):
        pass


@pytest.mark.vllm
def test_a_gloo_transfer_to_a_server_that_stops_reading_fails_naming_it():
    """``rlep_gloo`` end to end on the trainer side: the group forms with a server whose
    workers then never receive; the bucket's send ends with an error naming the server within
    the deadline (8 s here, which the group's forming on a busy host must also fit in; the
    job's is ``max(300, rollout.server_timeout_s)``)."""
    from rlep_megatron.rollout.servers import gloo_transfer
    from rlep_megatron.rollout.servers.launch import free_port

    info = gloo_transfer.GlooTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port("127.0.0.1"), num_workers=1,
        timeout_s=8.0, bucket_bytes=1024, servers="http://stalled:8000", rank=0)
    server = _StalledServer()
    engine = gloo_transfer.GlooTrainerWeightTransferEngine.trainer_init(info, client=server)
    start = time.monotonic()
    try:
        with pytest.raises((TimeoutError, RuntimeError), match="http://stalled:8000"):
            engine.send_weights([("w", torch.ones(8))], "1")
        assert time.monotonic() - start < 30
    finally:
        server.release.set()
        engine.shutdown()
