"""Run a script or a ``module:function`` on N local ranks (as torchrun starts them), from tests."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(extra: Optional[dict[str, str]], gpu: bool = False) -> dict[str, str]:
    """The environment of a test's subprocess. CPU tests hide every GPU
    (``CUDA_VISIBLE_DEVICES=""``), so that they test the CPU path on any machine; gpu tests
    keep the parent's ``CUDA_VISIBLE_DEVICES`` exactly, unset included."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_ranks(script: str, nproc: int, args: Sequence[str] = (), timeout_s: float = 600,
              env: Optional[dict[str, str]] = None, gpu: bool = False
              ) -> subprocess.CompletedProcess:
    """``script args`` on ``nproc`` local ranks (``script``: a ``.py`` file, or a module run as
    ``python -m``); raises with the output's tail when a rank fails
    or the run exceeds ``timeout_s``. ``gpu``: the ranks see the GPUs, and torchrun starts them
    (``torchrun --standalone --nproc-per-node nproc``). On CPU they are started here with the
    variables torchrun gives them (rank 0 hosts the store), without torchrun's launcher: a
    process that imports torch only to start the ranks (about 2 CPU-seconds per launch). As
    torchrun does, the first rank to fail ends the others. A launch whose store could not
    listen on its port is started again on another (:data:`STORE_ATTEMPTS` in all). The
    ``rlep`` jobs of the e2e tests run under torchrun itself (tests/e2e/helpers.py)."""
    if gpu:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", *_program(script), *args]
        try:
            proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(env, gpu),
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            tail = (err.stdout or b"")[-4000:] if isinstance(err.stdout, bytes) else (
                err.stdout or "")
            raise AssertionError(f"torchrun {script} timed out after {timeout_s}s:\n{tail}"
                                 ) from None
    else:
        for attempt in range(STORE_ATTEMPTS):
            proc = _start_and_wait(script, nproc, list(args), _env(env), timeout_s)
            if proc.returncode == 0 or STORE_PORT_TAKEN not in proc.stdout + proc.stderr:
                break
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{script} x{nproc} failed ({proc.returncode}):\n{output}")
    return proc


# rank 0's store binds its port seconds after the port was found free (after its imports):
# another process may take it in between. The port is drawn below the kernel's ephemeral range
# (32768 and up on Linux), where no outgoing connection lands, and a launch whose store could
# not listen (it failed before any rank ran the program) is started again on another port.
STORE_ATTEMPTS = 3
STORE_PORT_TAKEN = "The server socket has failed to listen"
_STORE_PORTS = (20000, 32000)


def store_port() -> int:
    """A port for rank 0's store that is free now, drawn at random in :data:`_STORE_PORTS`."""
    import random
    import socket

    draw = random.Random()
    for _ in range(100):
        port = draw.randrange(*_STORE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_STORE_PORTS} after 100 draws")


def _program(script: str) -> list[str]:
    """``script`` as Python's (and torchrun's) arguments: a file, or ``-m MODULE``."""
    return [script] if script.endswith(".py") else ["-m", script]


def _start_and_wait(script: str, nproc: int, args: list[str], env: dict[str, str],
                    timeout_s: float) -> subprocess.CompletedProcess:
    """The CPU side of :func:`run_ranks`: each rank's output to files of its own, joined in
    rank order (stdout, then stderr)."""
    import signal
    import tempfile
    import time

    from tests import forkserver

    port = store_port()  # for rank 0's store
    shared = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                  LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                  GROUP_WORLD_SIZE="1", ROLE_NAME="default", TORCHELASTIC_RESTART_COUNT="0",
                  TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=f"tests-{os.getpid()}-{port}")
    ranks, files = [], []
    with tempfile.TemporaryDirectory() as logs:
        for rank in range(nproc):
            out, err = (open(os.path.join(logs, f"{rank}.{name}"), "w+") for name in ("out", "err"))
            files.append((out, err))
            ranks.append(subprocess.Popen(
                [sys.executable, "-u", *forkserver.command([*_program(script), *args])],
                cwd=REPO_ROOT,
                stdout=out, stderr=err,
                env=dict(shared, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank)),
                start_new_session=True))
        deadline, code = time.monotonic() + timeout_s, 0
        while code == 0 and any(r.poll() is None for r in ranks):
            code = next((r.returncode for r in ranks if r.returncode not in (None, 0)), 0)
            if time.monotonic() > deadline:
                code = 124
            time.sleep(0.1)
        code = code or next((r.returncode for r in ranks if r.returncode), 0)
        for rank in ranks:  # a failure (or the deadline) ends the ranks still running
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
            rank.wait()
        outputs = []
        for handles in zip(*files):
            texts = []
            for handle in handles:
                handle.seek(0)
                texts.append(handle.read())
                handle.close()
            outputs.append("".join(texts))
    if code == 124:
        outputs[1] += f"\n{script}: still running after {timeout_s:.0f} s: killed"
    return subprocess.CompletedProcess([script, *args], code, *outputs)


@contextlib.contextmanager
def command_in_this_process():
    """Around a command run in this process (``rlep_megatron.cli.main(argv)``, a tool's
    ``main()``): yields ``(stdout, stderr)`` StringIOs that capture its output, and restores the
    environment it changes (a single rank's RANK, MASTER_PORT, ...), the working directory
    and the root logger's handlers and level (the command sets up its logging on the captured
    stderr)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    environ, cwd = dict(os.environ), os.getcwd()
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            yield stdout, stderr
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        root.handlers[:] = handlers
        root.setLevel(level)


def run_tool_in_process(script: str, args: Sequence[str], cwd: Optional[str] = None
                        ) -> subprocess.CompletedProcess:
    """``python <script> <args>`` run in this process: a ``tools/`` converter's ``main()``
    with ``sys.argv`` set (:func:`command_in_this_process`). A converter tears down its
    process group and megatron's parallel state itself; this saves the process start (torch,
    megatron and transformers imported again, several seconds each time). The exit codes of
    the real programs are checked by a test that runs them as programs. ``cwd``: the
    directory it runs in (restored afterwards)."""
    import runpy

    argv = sys.argv
    sys.argv = [script, *args]
    try:
        with command_in_this_process() as (stdout, stderr):
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = runpy.run_path(os.path.join(REPO_ROOT, script))["main"]()
            except SystemExit as exit_:  # argparse
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess([script, *args], code, stdout.getvalue(),
                                       stderr.getvalue())


def rlep_in_process(args: Sequence[str], cwd: Optional[str] = None
                    ) -> subprocess.CompletedProcess:
    """``rlep <args>`` run in this process, in ``cwd``, with no GPU visible (as in a test's
    subprocess): for the commands that build no model (``init``, ``config``, ``plan``), whose
    own process would only add its start-up. tests/e2e/test_bad_input.py runs the program
    itself for its exit code."""
    from rlep_megatron.cli import main

    with command_in_this_process() as (stdout, stderr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if cwd is not None:
            os.chdir(cwd)
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["rlep", *args], code, stdout.getvalue(),
                                       stderr.getvalue())


def run_function(target: str, nproc: int, kwargs: Optional[dict[str, Any]] = None,
                 timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run ``package.module:function(**kwargs)`` on each of ``nproc`` ranks (:func:`run_ranks`)."""
    # run as a module: the tests/ directory first on sys.path would make tests/vllm/ the
    # vllm package
    return run_ranks("tests.function_runner", nproc, [target, json.dumps(kwargs or {})],
                     timeout_s=timeout_s)


def case_parser() -> "argparse.ArgumentParser":
    """The argument parser of a program that :class:`Cases` launches, with ``--cases FILE`` (a
    JSON list of argument lists) or one case's ``--hf-dir`` (a model directory; the planner's
    program reads only its config.json) and ``--out``; the program adds its own arguments."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=None,
                        help="JSON file: a list of argument lists, run one after another")
    parser.add_argument("--hf-dir")
    parser.add_argument("--out")
    return parser


def run_cases(parser, run_case: Callable[[Any], None]) -> None:
    """The command line's one case, or each case of ``--cases`` in turn (its arguments printed
    first on rank 0, so that a failure's output names its case): ``run_case(args)``."""
    args = parser.parse_args()
    argument_lists = None if args.cases is None else json.load(open(args.cases))
    cases = [args] if argument_lists is None else [parser.parse_args(a) for a in argument_lists]
    if not all(case.hf_dir and case.out for case in cases):
        parser.error("every case needs --hf-dir and --out")
    for number, case in enumerate(cases):
        if argument_lists is not None and int(os.environ.get("RANK", "0")) == 0:
            print(f"case {number}: {argument_lists[number]}", flush=True)
        run_case(case)


class Cases:
    """The cases of a multi-rank program that takes ``--cases FILE`` (a JSON list of argument
    lists, each with its own ``--hf-dir`` and ``--out``), declared when the test module is
    imported: the cases of one rank count run in one launch, started by the first test that
    asks for one of them. Start-up (imports, process group) is most of a small case's time.
    ``placeholders(root, request)`` may give ``{word: value}`` substituted in every case's
    arguments (files it writes under ``root``).
    ``load``: reads a case's ``--out`` (default ``torch.load``)."""

    def __init__(self, program: str, name: str,
                 placeholders: Optional[Callable[[Any, Any], dict[str, str]]] = None,
                 timeout_s: float = 1200, load: Optional[Callable[[str], Any]] = None):
        self.program, self.name, self.timeout_s = program, name, timeout_s
        self.placeholders = placeholders
        self.load = load
        self.cases: dict[Any, tuple[int, Optional[str], list[str]]] = {}
        self._outs: dict[int, Optional[dict[Any, str]]] = {}

    def add(self, key, nproc: int, arch: Optional[str], args: Sequence[str]):
        """Declare a case (``arch``: the ``tiny_<arch>_dir`` fixture's model; ``None``: the
        case's ``args`` give ``--hf-dir``); returns ``key``."""
        if key in self.cases:
            raise ValueError(f"case {key!r} declared twice")
        self.cases[key] = (nproc, arch, [str(a) for a in args])
        return key

    def result(self, key, request) -> Any:
        """The case's ``--out`` as :attr:`load` reads it, launching its rank count's cases
        first."""

        if key not in self.cases:
            raise KeyError(f"case {key!r} is not declared: add it with {self.name}.add(...) "
                           "where the module declares its cases")
        nproc = self.cases[key][0]
        if nproc not in self._outs:
            root = request.getfixturevalue("tmp_path_factory").mktemp(f"{self.name}_{nproc}")
            words = self.placeholders(root, request) if self.placeholders else {}
            outs, arguments = {}, []
            for number, (other, (ranks, arch, args)) in enumerate(self.cases.items()):
                if ranks != nproc:
                    continue
                outs[other] = str(root / f"case_{number}.out")
                model = ([] if arch is None
                         else ["--hf-dir", request.getfixturevalue(f"tiny_{arch}_dir")])
                arguments.append([*model, "--out", outs[other],
                                  *(words.get(a, a) for a in args)])
            (root / "cases.json").write_text(json.dumps(arguments, indent=1))
            self._outs[nproc] = None  # a failed launch is reported once, by the test that ran it
            run_ranks(self.program, nproc, ["--cases", str(root / "cases.json")],
                      timeout_s=self.timeout_s)
            self._outs[nproc] = outs
        outs = self._outs[nproc]
        if outs is None:
            import pytest

            pytest.fail(f"the launch of {self.name}'s {nproc}-rank cases failed (see the first "
                        "test that needed it)")
        if self.load is not None:
            return self.load(outs[key])
        import torch

        return torch.load(outs[key])


def once_per_run(tmp_path_factory, name: str, make: Callable[[Any], Any]) -> Any:
    """``make(directory)`` (a JSON-able result) run once per test run, whatever the number of
    pytest-xdist workers and wherever their tests of one module land: the first worker to ask
    runs it under a file lock in the run's shared temporary directory and keeps the result
    there; another waits for the lock and reads it. A failure is kept too, and raised in each
    worker that asks."""
    import filelock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done = shared / f"once_{name}.json"
    with filelock.FileLock(str(shared / f"once_{name}.lock")):
        if not done.is_file():
            directory = shared / f"once_{name}"
            directory.mkdir(exist_ok=True)
            try:
                value = {"result": make(directory)}
            except Exception as err:  # an assertion of make() included
                value = {"error": f"{type(err).__name__}: {err}"}
            done.write_text(json.dumps(value))
        value = json.loads(done.read_text())
    if "error" in value:
        raise AssertionError(f"{name} failed: {value['error']}")
    return value["result"]
