"""A rollout rank's vLLM server is given a free port that it binds seconds later, after its
imports; another process may take the port in between (seen in the suite: ``OSError: [Errno
98] Address already in use`` as a resumed job's server started). The rank then starts the
server again on another port, at most ``PORT_ATTEMPTS`` times in all; any other failure to
start ends the rank at once. Driven here with a stand-in for the server process."""
import os
import subprocess
import sys
import tempfile
import time
import types

import pytest

from rlep_megatron import distributed
from rlep_megatron.config import RolloutConfig, load_config
from rlep_megatron.rollout.servers import launch
from rlep_megatron.rollout.servers.client import RolloutServerError

pytestmark = pytest.mark.unit

TAKEN = ("the rollout server http://127.0.0.1:{port} exited with code 1 while starting:\n"
         "    sock.bind(addr)\nOSError: [Errno 98] Address already in use\n")


def serve(monkeypatch, tmp_path, failures):
    """serve_rollout_rank with servers whose first ``failures`` starts fail as ``failures``
    says (``"taken"`` or another message); returns the servers made and the URLs published."""
    made, published = [], []

    class StandIn:
        def __init__(self, model_dir, cfg, **kwargs):
            self.port = 41000 + len(made)
            self.stopped = False
            self.process = types.SimpleNamespace(poll=lambda: None)
            made.append(self)

        def wait_ready(self):
            if len(made) <= len(failures):
                kind = failures[len(made) - 1]
                raise RolloutServerError(TAKEN.format(port=self.port) if kind == "taken"
                                         else kind)
            return f"http://127.0.0.1:{self.port}"

        def stop(self):
            self.stopped = True

        def log_tail(self):
            return ""

    monkeypatch.setattr(launch, "LocalServer", StandIn)
    monkeypatch.setattr(distributed, "publish_rollout_url",
                        lambda index, url: published.append((index, url)))
    monkeypatch.setattr(distributed, "job_store",
                        lambda: types.SimpleNamespace(check=lambda keys: True))
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"])
    launch.serve_rollout_rank(cfg, 0)
    return made, published


def test_a_taken_port_starts_the_server_again_on_another(monkeypatch, tmp_path):
    made, published = serve(monkeypatch, tmp_path, ["taken", "taken"])
    assert [s.port for s in made] == [41000, 41001, 41002]
    assert published == [(0, "http://127.0.0.1:41002")]
    assert all(s.stopped for s in made)  # the failed ones, and the last when the job ends


def test_the_attempts_are_bounded_and_other_failures_end_the_rank(monkeypatch, tmp_path):
    with pytest.raises(RolloutServerError, match="41002 exited with code 1"):
        serve(monkeypatch, tmp_path, ["taken"] * launch.PORT_ATTEMPTS)
    with pytest.raises(RolloutServerError, match="^out of memory$"):
        serve(monkeypatch, tmp_path, ["out of memory", "taken"])


def test_a_servers_sockets_live_in_a_directory_of_its_own_removed_when_it_stops(monkeypatch,
                                                                                tmp_path):
    """vLLM's front end and engine core meet on ZeroMQ sockets in ``VLLM_RPC_BASE_PATH``; a
    server stopped (or killed) left them in the temporary directory itself. Each LocalServer
    now gets a directory of its own, removed by ``stop()``; one the user set is used and kept.
    The server here is a stand-in process that makes a socket file where vLLM would."""
    real_popen = subprocess.Popen
    program = ("import os, pathlib, time; "
               "pathlib.Path(os.environ['VLLM_RPC_BASE_PATH'], 'engine-socket').touch(); "
               "time.sleep(60)")

    def popen(command, env, **kwargs):
        return real_popen([sys.executable, "-c", program], env=env, **kwargs)

    def socket_of(server, root):
        path = os.path.join(root, "engine-socket")
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert server.process.poll() is None and time.monotonic() < deadline, \
                f"the stand-in server made no socket in {root}"
            time.sleep(0.05)
        return path

    monkeypatch.setattr(launch, "serve_arguments", lambda *args, **kwargs: [])
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    cfg = RolloutConfig(num_samples_per_prompt=1, max_response_tokens=4)
    server = launch.LocalServer(str(tmp_path), cfg)
    assert server._rpc_dir and os.path.dirname(server._rpc_dir) == tempfile.gettempdir()
    socket_of(server, server._rpc_dir)
    server.stop()
    assert not os.path.exists(server._rpc_dir)
    # a directory the user chose is theirs: used, and left where it is
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
    server = launch.LocalServer(str(tmp_path), cfg)
    assert server._rpc_dir is None
    socket_of(server, str(mine))
    server.stop()
    assert os.listdir(mine) == ["engine-socket"]
