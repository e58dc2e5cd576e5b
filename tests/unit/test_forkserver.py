"""The suite's fork server (tests/forkserver.py) against the reference it stands in for: the same
program started as a new interpreter. A server without the heavy imports serves these tests."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.forkserver import CLIENT, VARIABLE

PROBE = """
import json, os, signal, sys, time
what = os.environ.get("PROBE", "state")
if what == "state":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path": sys.path,
                      "name": __name__, "x": os.environ.get("PROBE_X"),
                      "write_through": sys.stdout.write_through,
                      "stderr_lines": sys.stderr.line_buffering, "pid": os.getpid(),
                      "main_file": getattr(sys.modules["__main__"], "__file__", None),
                      "handlers": [str(signal.getsignal(s)) for s in (
                          signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)]}))
    print("to stderr", file=sys.stderr)
elif what == "exit":
    sys.exit(7)
elif what == "raise":
    raise ValueError("raised by the probe")
elif what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif what == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(5)))
    print(os.getpid(), flush=True)
    time.sleep(60)
elif what == "interrupt":
    raise KeyboardInterrupt
elif what == "busy":  # holds the GIL for minutes (catastrophic backtracking in C)
    import re
    print(os.getpid(), flush=True)
    re.match(r"(a+)+$", "a" * 32 + "b")
elif what == "family":
    import subprocess
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(os.getpid(), sleeper.pid, flush=True)
    time.sleep(60)
"""


@pytest.fixture()
def server(tmp_path):
    path = str(tmp_path / "socket")
    proc = subprocess.Popen([sys.executable, "-u", "-m", "tests.forkserver", path,
                             "--no-preload"],
                            cwd=os.path.dirname(os.path.dirname(CLIENT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield path
    proc.kill()
    proc.wait()


@pytest.fixture()
def program(tmp_path):
    """The probe as a script and as a module of a package on PYTHONPATH."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(PROBE)
    (tmp_path / "lib" / "probepkg").mkdir(parents=True)
    (tmp_path / "lib" / "probepkg" / "__init__.py").write_text("")
    (tmp_path / "lib" / "probepkg" / "probe.py").write_text(PROBE)
    (tmp_path / "work").mkdir()
    return tmp_path


def _env(extra=None, **variables):
    """The environment of a program the suite starts (one torch thread), with ``variables``
    and ``extra``; a ``None`` value unsets that variable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **variables)
    env.update(extra or {})
    return {name: value for name, value in env.items() if value is not None}


def _run(args, env, cwd, client: bool, unbuffered=False):
    command = [sys.executable, *(["-u"] if unbuffered else []),
               *([CLIENT] if client else []), *args]
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    return proc, out, err


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "-u"])
def test_a_forked_program_starts_as_a_new_interpreter_would(server, program, as_module,
                                                            unbuffered):
    args = (["-m", "probepkg.probe"] if as_module else [str(program / "scripts" / "probe.py")])
    env = _env(PROBE_X="7", PYTHONPATH=os.pathsep.join([str(program / "lib"), ""]))
    cwd = str(program / "work")
    fresh, fresh_out, fresh_err = _run([*args, "a", "--b"], env, cwd, client=False,
                                       unbuffered=unbuffered)
    forked, forked_out, forked_err = _run([*args, "a", "--b"], dict(env, **{VARIABLE: server}),
                                          cwd, client=True, unbuffered=unbuffered)
    assert fresh.returncode == forked.returncode == 0, (fresh_err, forked_err)
    want, got = json.loads(fresh_out), json.loads(forked_out)
    assert want.pop("pid") == fresh.pid  # started in the process itself
    assert got.pop("pid") != forked.pid  # forked from the server: the client waits for it
    assert got == want
    assert forked_err == fresh_err == "to stderr\n"


@pytest.mark.parametrize("what", ["exit", "raise", "kill", "interrupt"])
def test_the_client_ends_as_the_program_ends(server, program, what):
    """Its exit code or the signal it died of, as the same program run as a new interpreter."""
    env = _env(PROBE=what)
    fresh, _, fresh_err = _run([str(program / "scripts" / "probe.py")], env, str(program),
                               client=False)
    proc, _, err = _run([str(program / "scripts" / "probe.py")], dict(env, **{VARIABLE: server}),
                        str(program), client=True)
    assert proc.returncode == fresh.returncode, err
    assert fresh.returncode != 0
    assert err.splitlines()[-1:] == fresh_err.splitlines()[-1:]


def test_signals_to_the_client_reach_the_program(server, program):
    env = _env(PROBE="term", **{VARIABLE: server})
    proc = subprocess.Popen([sys.executable, CLIENT, str(program / "scripts" / "probe.py")],
                            env=env, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 5
    assert proc.stdout.read() == "got SIGTERM\n"


@pytest.mark.parametrize("how", ["client SIGKILL", "group SIGTERM"])
def test_a_killed_client_takes_the_program_and_what_it_started_with_it(server, program, how):
    """SIGKILL of the client (a test's kill_job): the server kills the program's group and
    descendants; SIGTERM to the client's process group (torchrun ending a worker): the
    program's group gets it, its child included, as a new interpreter's group would."""
    env = _env(PROBE="family", **{VARIABLE: server})
    proc = subprocess.Popen([sys.executable, CLIENT, str(program / "scripts" / "probe.py")],
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child, sleeper = (int(word) for word in proc.stdout.readline().split())
    if how == "client SIGKILL":
        proc.kill()
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    _assert_gone(child, sleeper)


def test_a_program_that_holds_the_gil_dies_with_its_client(server, program):
    env = _env(PROBE="busy", **{VARIABLE: server})
    proc = subprocess.Popen([sys.executable, CLIENT, str(program / "scripts" / "probe.py")],
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stdout.read() == ""  # the pipe ends: nothing holds it open
    _assert_gone(child)


def _assert_gone(*pids: int) -> None:
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("variables", [{"VLLM_SOMETHING": "1"}, {"RLEP_FAULT_INJECT": "kill@x:1"},
                                       {"OMP_NUM_THREADS": None},
                                       {VARIABLE: "/nonexistent/socket"}],
                         ids=["an import's variable", "a kill fault", "torch's default threads",
                              "no server"])
def test_what_a_fork_cannot_give_runs_as_a_new_interpreter(server, program, variables):
    env = _env(variables, **{VARIABLE: server})
    proc, out, err = _run([str(program / "scripts" / "probe.py")], env, str(program),
                          client=True)
    assert proc.returncode == 0, err
    assert json.loads(out)["pid"] == proc.pid  # exec'd in the client's own process


def test_a_program_that_would_import_another_copy_of_a_module_runs_as_a_new_interpreter(
        server, program):
    """The server imported the ``tests`` package of this checkout; a program with another
    ``tests`` first on its path (another checkout) must not get the server's."""
    (program / "other" / "tests").mkdir(parents=True)
    (program / "other" / "tests" / "__init__.py").write_text("")
    env = _env(PYTHONPATH=str(program / "other"), **{VARIABLE: server})
    proc, out, err = _run([str(program / "scripts" / "probe.py")], env, str(program),
                          client=True)
    assert proc.returncode == 0, err
    assert json.loads(out)["pid"] == proc.pid
