"""``RLEP_FAULT_INJECT``: the raise form, and the kill forms that end a job with SIGKILL at a
chosen training step and phase (the resume tests' deterministic kill points)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rlep_megatron import faults

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value, expected", [
    ("train:1", ("raise", "train", 1)),
    ("engine_step:0", ("raise", "engine_step", 0)),
    ("kill@train:4", ("kill", "train", 4, None)),
    ("kill@checkpoint:2:1", ("kill", "checkpoint", 2, 1)),
    ("hang@validate:2", ("hang", "validate", 2)),
    ("kill@shard:2", ("kill", "shard", 2, None)),  # rlep collect's shards
])
def test_the_forms_are_read(monkeypatch, value, expected):
    monkeypatch.setenv(faults.ENV, value)
    assert faults.target() == expected


@pytest.mark.parametrize("value", ["training:0", "train", "train:x", "train:1:2",
                                   "kill@engine_step:3", "kill@train:", "kill@train:1:2:3",
                                   "hang@train:1:0"])
def test_a_malformed_value_is_refused_naming_the_forms(monkeypatch, value):
    monkeypatch.setenv(faults.ENV, value)
    with pytest.raises(ValueError, match=r"kill@<phase>:<step>"):
        faults.target()


def test_the_raise_form_strikes_its_rank_and_phase_only(monkeypatch):
    monkeypatch.setenv(faults.ENV, "train:1")
    faults.check("train", 0, 3)
    faults.check("rollout", 1, 3)
    with pytest.raises(faults.InjectedFault, match="phase 'train' on rank 1"):
        faults.check("train", 1, 3)


def test_the_kill_form_waits_for_its_step(monkeypatch):
    """Other steps and phases pass (a kill here would end the test process)."""
    monkeypatch.setenv(faults.ENV, "kill@train:4")
    for step in (None, 1, 3, 5):
        faults.check("train", 0, step)
    faults.check("validate", 0, 4)


def test_kill_at_a_step_kills_the_process_and_its_children(tmp_path):
    """Outside torchrun: the process that reaches the point SIGKILLs its children (an engine,
    a server) and itself, with no clean-up run."""
    pid_file, cleaned = tmp_path / "child.pid", tmp_path / "cleaned"
    program = textwrap.dedent(f"""
        import atexit, subprocess
        from rlep_megatron import faults
        child = subprocess.Popen(["sleep", "120"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        atexit.register(lambda: open({str(cleaned)!r}, "w").write("ran"))
        faults.check("train", 0, 3)
        faults.check("train", 0, 4)
        print("not killed")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env={**env, faults.ENV: "kill@train:4"}, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "not killed" not in proc.stdout
    assert not cleaned.exists()
    child = int(pid_file.read_text())
    # killed: gone, or a zombie until init reaps it (SIGKILL's delivery is not instantaneous
    # on a loaded machine: wait up to 30 s for the state to show)
    deadline = time.monotonic() + 30
    while True:
        try:
            state = psutil.Process(child).status()
        except psutil.NoSuchProcess:
            break
        if state == psutil.STATUS_ZOMBIE:
            break
        assert time.monotonic() < deadline, f"the child is still {state} 30 s after the kill"
        time.sleep(0.05)


def test_under_torchrun_the_launcher_dies_first_and_the_peer_ranks_last():
    """Each rank that reaches a ``kill@`` point kills the job; if two ranks killed each other
    before either killed the launcher, torchrun would report its ranks' deaths and exit 1.
    So the launcher comes first, then the processes below it that are not ranks, then the
    other ranks, this rank last."""
    from rlep_megatron.faults import kill_order

    class Proc:
        def __init__(self, pid, children=()):
            self.pid, self.kids, self.up = pid, list(children), None
            for child in self.kids:
                child.up = self

        def parent(self):
            return self.up

        def children(self, recursive=False):
            if not recursive:
                return list(self.kids)
            return [d for c in self.kids for d in (c, *c.children(recursive=True))]

    engine0, worker1, engine1 = Proc(11), Proc(12), Proc(13)
    rank0, rank1 = Proc(1, [engine0]), Proc(2, [worker1, engine1])
    Proc(100, [rank0, rank1])  # the launcher
    order = [p.pid for p in kill_order(rank1, under_torchrun=True)]
    assert order == [100, 11, 12, 13, 1, 2]
    assert [p.pid for p in kill_order(rank0, under_torchrun=True)] == [100, 11, 12, 13, 2, 1]
    # outside torchrun: the process's own descendants, then itself
    assert [p.pid for p in kill_order(rank1, under_torchrun=False)] == [12, 13, 2]
