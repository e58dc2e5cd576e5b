"""Rollout on a stock ``vllm serve`` process (vLLM's CPU build, started by the test on
localhost) driven as ``rollout.placement: separate`` drives it: after every weight sync through
vLLM's weight-transfer lifecycle (``rlep_gloo``), the server's log-probs of its own samples
equal the Megatron actor's recomputation (fp32, every token within 1e-5); pauses around an
update keep, resume or restart the requests in flight with the version spans that say so, each
span's log-probs those of the actor at that version; two servers driven as one both take each
update and share the prompts; a server killed with SIGKILL fails the trainer side at once
(requests in flight) or after ``rollout.server_timeout_s`` (none in flight), naming the
server."""
import json
import subprocess
import sys

import pytest

from tests import forkserver, requires
from tests.torchrun import REPO_ROOT, _env, once_per_run

pytestmark = [pytest.mark.vllm]

requires("vllm")

PARITY_TOL = 1e-5


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_qwen2_dir):
    """The program's report, made once per test run (its tests may land on two workers)."""
    def make(tmp):
        out, log = tmp / "report.json", tmp / "server.log"
        proc = subprocess.run([sys.executable, *forkserver.command([
                               "-m", "tests.vllm.server_program", "--hf-dir", tiny_qwen2_dir,
                               "--out", str(out), "--log", str(log)])],
                              cwd=REPO_ROOT, env=_env(None), capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        return json.loads(out.read_text())
    return once_per_run(tmp_path_factory, "server_program", make)


def test_log_probs_equal_the_actors_after_every_sync(report):
    assert "dummy weights" in report["dummy_refused"]
    assert report["sync0"]["tensors"] == report["sync1"]["tensors"] > 0
    assert report["buckets"] > 1
    for key in ("parity_checkpoint", "parity_before", "parity_after", "parity_t07"):
        assert report[key]["tokens"] > 50, key
        assert report[key]["max"] <= PARITY_TOL, (key, report[key])
    assert report["reproducible"]
    # on a GPU vLLM's NCCL engine declares the tensors before it sends them: the declaration
    # made from the stream's plan is what the stream carries, in order
    assert report["nccl_source_metadata"] == {"equal": True,
                                              "tensors": report["sync0"]["tensors"]}
    # the optimizer step between two syncs moved the server's log-probs of the same tokens
    assert report["moved_tokens"] > 0 and report["moved_mean_abs"] > 100 * PARITY_TOL


def _split(entries):
    """Requests paused midway (tokens under both versions) and the others."""
    return [e for e in entries if len(e["versions"]) == 2]


def _spans_match_the_actor(check, new_span=True):
    """Each span's log-probs equal the actor's at the span's version; the optimizer step
    between the versions moved the actor's log-probs of those tokens far more than that."""
    assert check["old_span"]["tokens"] > 0 and check["old_span"]["max"] <= PARITY_TOL, check
    if new_span:
        assert check["new_span"]["tokens"] > 0 and check["new_span"]["max"] <= PARITY_TOL, check
        assert check["moved_max"] > 100 * PARITY_TOL, check


def test_keep_freezes_requests_and_the_server_labels_each_tokens_version(report):
    check = report["spans"]["keep"]
    entries = check["requests"]
    assert all(e["logprobs"] == e["length"] for e in entries)
    both = _split(entries)
    assert both, entries  # at least one request was generating when the weights changed
    for e in both:
        (old, a), (new, b) = e["versions"]
        assert (old, new) == (9, 10) and a > 0 and b > 0 and a + b == e["length"]
    # the new span goes on with the old weights' KV cache: only the old span is exact
    _spans_match_the_actor(check, new_span=False)


def test_resume_keeps_the_tokens_so_far_and_restart_drops_them(report):
    resumed = report["spans"]["resume"]["requests"]
    both = _split(resumed)
    assert both, resumed
    for e in both:
        (old, a), (new, b) = e["versions"]
        assert (old, new) == (11, 12) and a == e["tokens_before"] > 0 and e["kept_prefix"]
    _spans_match_the_actor(report["spans"]["resume"])
    restart = report["spans"]["restart"]
    restarted = [e for e in restart["requests"] if not e["done_before"]]
    assert restarted, restart
    for e in restarted:
        # every token sampled again by the new weights
        assert e["tokens_before"] == 0 and e["versions"] == [[14, e["length"]]], e
    for e in restart["requests"]:
        if e["done_before"]:  # finished before the pause: untouched, all under the old weights
            assert e["versions"] == [[13, e["length"]]] and e["tokens_before"] == e["length"]
    # the restarted requests are all new span; an old span exists only if one finished early
    assert restart["new_span"]["tokens"] > 0 and restart["new_span"]["max"] <= PARITY_TOL
    assert restart["old_span"]["max"] <= PARITY_TOL and restart["moved_max"] > 100 * PARITY_TOL


def test_two_servers_take_every_update_and_share_the_prompts(report):
    two = report["two_servers"]
    assert two["workers"] == [1, 1]  # one transfer group: the trainer and both servers' workers
    assert two["parity"]["tokens"] > 50 and two["parity"]["max"] <= PARITY_TOL, two
    # the prompts alternate between the servers: both generated (their own token counters)
    assert min(two["generated"]) > 0, two
    assert two["versions"] == [20]


def test_a_killed_server_fails_the_trainer_side_naming_it(report):
    url = report["url"]
    in_flight = report["killed_in_flight"]
    assert in_flight and url in in_flight["error"] and in_flight["seconds"] < 10
    idle = report["killed_idle"]
    assert url in idle["error"] and "has not answered" in idle["error"]
    assert 10 <= idle["seconds"] < 30  # rollout.server_timeout_s=10 in the program
