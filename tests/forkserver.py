"""The test suite's fork server: one process per pytest worker that imports torch, megatron-core,
transformers and vLLM once, then forks a child for each ``rlep`` rank, torchrun launcher or test
program that a test starts through tests/forkserver_client.py, where a new interpreter would
import them all again.

Most of a tiny job's CPU time is these imports (bench/RESULTS.md, "Where the suite's time
goes"), and the suite starts a few hundred such processes. The child gets the client's command
line, environment (with what the imports added to the server's), working directory,
``sys.path`` and standard streams, new random seeds, a session of its own, and the signal
handlers the imports left; it runs the program as ``python -m MODULE``, ``python SCRIPT`` or
``python -c`` would (``runpy``), then the interpreter's own ending (threads joined, ``atexit``),
and the server reports its exit code or signal to the client.

What a fork cannot give is declined, and the client starts a new interpreter instead: a
variable that the imports or the interpreter's start read (``VLLM_*``, ``TORCH*``, ``HF_*``,
``PYTHON*``, ...) with another value than the server's; ``RLEP_FAULT_INJECT=kill@...`` (its
kills find the launcher as the rank's parent process); a module the server imported that the
program's ``sys.path`` would find elsewhere (another checkout first on ``PYTHONPATH``); no
``OMP_NUM_THREADS`` (torch's default thread count is not the server's). What a fork gives
differently: one string hash seed for all children of a server (a new interpreter draws its
own), the server's umask, limits and CPU affinity, and no import-time output (the server's log
has it). When a client is gone (it ended or was killed) while its program runs, the server
kills the program's process group and descendants.
Tests of a program's own start-up (the README's commands, the import probes, the device
choice) start their programs themselves. ``RLEP_TEST_FORKSERVER=0`` turns it off.

Started by :func:`start` (``python -u -m tests.forkserver SOCKET``): tests/conftest.py starts it
when a worker's tests include tiers that start programs, else the first :func:`command` does.
"""
from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import NamedTuple

VARIABLE = "RLEP_TEST_FORKSERVER"
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver_client.py")

# variables that the preloaded imports (or the interpreter's start) read: a child whose value of
# one differs from the server's is started as a new interpreter; any other variable is read by
# the code when it runs, after the fork (torchrun's rank variables, the project's own settings)
_BOUND_PREFIXES = ("VLLM_", "TORCH", "PYTORCH_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO",
                   "DNNL_", "ONEDNN_", "ATEN_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
                   "TOKENIZERS_", "CUDA_", "NCCL_", "TRITON_", "PYTHON", "LD_",
                   "MALLOC_", "LC_", "RAY_", "MEGATRON_", "NVIDIA_", "TMPDIR", "HOME", "LANG",
                   "XDG_", "USE_TF", "USE_TORCH", "TZ")
# OMP_NUM_THREADS: set again in the child (a child without it is declined: torch's default
# thread count is not the server's)
_FREE = {"OMP_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONBREAKPOINT",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
_FREE_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
# ... and the project's own that are read at import
_BOUND = {"RLEP_SHOW_ALL_WARNINGS"}


def preload() -> None:
    """Import what every rank imports (module doc): the project's platform package first, as
    in a job (it sets vLLM's log level before vLLM is imported), megatron-core's modules that
    the CPU shim imports in every rank (rlep_megatron.platform.megatron_shim), then the rest."""
    import importlib

    from rlep_megatron.platform import megatron_shim

    for _module in megatron_shim._megatron_modules():
        pass
    for name in ("transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
                 "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "safetensors.torch",
                 "pyarrow.parquet", "psutil", "yaml"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional part's missing dependency
            pass


def declined(env: dict[str, str], base: dict[str, str], imported: dict[str, str]
             ) -> str | None:
    """Why a fork cannot stand in for a new interpreter with ``env`` (module doc), or None.
    ``base``: the server's environment before its imports; ``imported``: what they set (a
    program that a forked child starts, torchrun's ranks, inherits it)."""
    if "OMP_NUM_THREADS" not in env:
        return "OMP_NUM_THREADS is not set (torch's default thread count)"
    for name in sorted(set(env) | set(base)):
        if env.get(name) == base.get(name) or (
                name in imported and env.get(name) == imported[name]):
            continue
        if name in _BOUND:
            return f"{name} is set"
        if name == "RLEP_FAULT_INJECT" and "kill@" in env.get(name, ""):
            return "a kill@ fault finds the job's launcher as the rank's parent process"
        if (name.startswith(_BOUND_PREFIXES) and name not in _FREE
                and not name.startswith(_FREE_PREFIXES)):
            return f"{name} differs from the fork server's"
    return None


def _streams(unbuffered: bool) -> None:
    """``sys.stdin/stdout/stderr`` over file descriptors 0, 1 and 2 (now the client's),
    buffered as a new interpreter's are: with ``-u`` or ``PYTHONUNBUFFERED`` both writing
    through, as the server's own; else new ones, stderr line-buffered. A stream that an import
    kept from the server writes through to the same descriptor."""
    import io

    if unbuffered or os.environ.get("PYTHONUNBUFFERED"):
        return  # the server's own (it runs with -u): objects that the imports hold (a logging
        #         handler's stream) stay those of sys.stdout and sys.stderr

    def text(fd: int, mode: str, line: bool, errors: str):
        raw = io.FileIO(fd, mode, closefd=False)
        binary = io.BufferedWriter(raw) if mode == "wb" else io.BufferedReader(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line)

    sys.stdin = sys.__stdin__ = text(0, "rb", False, "strict")
    sys.stdout = sys.__stdout__ = text(1, "wb", os.isatty(1), "strict")
    sys.stderr = sys.__stderr__ = text(2, "wb", True, "backslashreplace")


def _fresh_state(request: dict, base_path: list[str], handlers: dict) -> None:
    """The process state a new interpreter would start the program with (module doc)."""
    import random
    import tempfile

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.path[:] = _child_path(request, base_path)
    sys.argv = list(argv[1:]) if argv[0] in ("-m", "-c") else list(argv)
    if argv[0] == "-c":
        sys.argv[0] = "-c"
    random.seed()
    tempfile.tempdir = None  # TMPDIR read again
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import multiprocessing.process

    multiprocessing.process.current_process().authkey = os.urandom(32)
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()
    if "torch" in sys.modules:  # libgomp read the server's OMP_NUM_THREADS when it loaded
        threads = os.environ.get("OMP_NUM_THREADS")
        sys.modules["torch"].set_num_threads(int(threads) if threads else
                                             len(os.sched_getaffinity(0)))
    for number, handler in handlers.items():  # the server's own, back to what a new
        signal.signal(number, handler)        # interpreter has after the imports


def _child_path(request: dict, base_path: list[str]) -> list[str]:
    """The ``sys.path`` a new interpreter would start ``request`` with: the script's directory
    (the working directory for ``-m``, ``""`` for ``-c``), ``PYTHONPATH``'s entries (absolute, an
    empty one the working directory), then the interpreter's own."""
    argv, cwd = request["argv"], request["cwd"]
    first = {"-m": cwd, "-c": ""}.get(argv[0]) or os.path.dirname(
        os.path.realpath(os.path.join(cwd, argv[0])))
    return [first, *dict.fromkeys([*_pythonpath(request["env"].get("PYTHONPATH", ""), cwd),
                                   *base_path])]


def _pythonpath(value: str, cwd: str) -> list[str]:
    return [os.path.normpath(os.path.join(cwd, p)) if p else cwd
            for p in (value.split(os.pathsep) if value else [])]


def _imported_elsewhere(path: list[str]) -> str | None:
    """A module the server imported that a new interpreter with ``sys.path`` ``path`` could
    find in another place: one of the path's directories that the server's path lacks holds a
    module or package of that name (another checkout of the project first on ``PYTHONPATH``, a
    script beside a module of the same name). None when there is none."""
    import importlib.machinery

    suffixes = tuple(importlib.machinery.all_suffixes())
    loaded = {name for name, module in sys.modules.items()
              if "." not in name and getattr(module, "__file__", None)}
    for entry in path:
        if entry in sys.path or not os.path.isdir(entry or "."):
            continue
        for item in os.listdir(entry or "."):
            name = next((item[:-len(s)] for s in suffixes if item.endswith(s)), item)
            name = name.split(".", 1)[0]
            if name in loaded:
                return f"{name} would be imported from {os.path.join(entry, item)}"
    return None


def _run_child(request: dict, base_path: list[str], handlers: dict) -> None:
    """In the forked child: become the program, run it, end as the interpreter would."""
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.setsid()  # a group of its own, which the server kills when the client is gone
        _fresh_state(request, base_path, handlers)
        _streams(request["unbuffered"])
        argv = request["argv"]
        try:
            if argv[0] == "-m":
                sys.modules.pop(argv[1], None)
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                import types

                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            else:
                runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")
            code = 0
        except SystemExit as exit_:
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT  # a new interpreter ends killed by SIGINT
        except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # the interpreter's ending: non-daemon threads joined, atexit
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """The client's request and its three file descriptors (closed here on a bad request)."""
    connection.settimeout(10)
    head, fds, _flags, _addr = socket.recv_fds(connection, 4, 3)
    try:
        while len(head) < 4:
            more = connection.recv(4 - len(head))
            if not more:
                raise ConnectionError("the client closed before its request")
            head += more
        size = struct.unpack("!I", head)[0]
        body = b""
        while len(body) < size:
            more = connection.recv(size - len(body))
            if not more:
                raise ConnectionError("the client closed during its request")
            body += more
        request = json.loads(body)
        if len(fds) != 3 or not {"argv", "env", "cwd", "unbuffered"} <= set(request):
            raise ValueError("a request needs argv, env, cwd, unbuffered and 3 descriptors")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    connection.settimeout(None)
    return request, fds


class _Server:
    """The accept, fork and reap loop of :func:`serve`."""

    def __init__(self, path: str, base_env: dict, imported_env: dict, base_path: list[str]):
        self.base_env, self.imported_env, self.base_path = base_env, imported_env, base_path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path + ".tmp")
        self.listener.listen(128)
        os.rename(path + ".tmp", path)  # a client finds the socket only when it is served
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self.handlers = {number: signal.getsignal(number)
                         for number in (signal.SIGCHLD, signal.SIGINT)}
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the suite; it ends this
        signal.signal(signal.SIGTERM, self.terminate)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_read, selectors.EVENT_READ)
        self.children: dict[int, socket.socket] = {}

    def run(self, parent: int) -> None:
        while os.getppid() == parent:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self.accept()
                elif key.fileobj is self.wake_read:
                    try:
                        while os.read(self.wake_read, 512):
                            pass
                    except BlockingIOError:
                        pass
                else:  # a client's connection: readable only when the client is gone
                    self.client_gone(key.data, key.fileobj)
            self.reap()
        self.terminate()

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        try:
            request, fds = _read_request(connection)
        except (OSError, ValueError, ConnectionError):
            connection.close()
            return
        try:
            why = (declined(request["env"], self.base_env, self.imported_env)
                   or _imported_elsewhere(_child_path(request, self.base_path)))
            pid = None
            if why is None:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    self.become_child(request, connection, fds)
        except Exception as err:  # noqa: BLE001 - the client starts the program itself
            why, pid = f"the server failed: {err!r}", None
        for fd in fds:
            os.close(fd)
        if pid is None:
            print(f"forkserver: declined {request['argv'][:2]}: {why}", flush=True)
            _reply(connection, {"fallback": why})
            connection.close()
            return
        print(f"forkserver: {pid} {' '.join(request['argv'][:3])}", flush=True)
        self.children[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, pid)
        _reply(connection, {"pid": pid})

    def become_child(self, request: dict, connection: socket.socket, fds: list[int]) -> None:
        """In the forked child: the server's descriptors closed, the client's streams on 0, 1
        and 2, then the program; never returns."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.selector.close()
            self.listener.close()
            os.close(self.wake_read)
            os.close(self.wake_write)
            for other in self.children.values():
                other.close()
            connection.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            request["env"] = {**request["env"], **self.imported_env}
        except BaseException:  # noqa: BLE001
            os._exit(1)
        _run_child(request, self.base_path, self.handlers)

    def client_gone(self, pid: int, connection: socket.socket) -> None:
        """A client closed its connection (it ended or was killed) while its program runs: kill
        the program's process group and everything it started, as the client's own killing
        would have killed a program that was its child."""
        try:
            if connection.recv(4096):
                return  # a client sends nothing after its request; ignored
        except OSError:
            pass
        self.selector.unregister(connection)
        kill_tree(pid)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            try:
                self.selector.unregister(connection)
            except KeyError:  # its client is gone (client_gone)
                pass
            if os.WIFSIGNALED(status):
                _reply(connection, {"signal": os.WTERMSIG(status)})
            else:
                _reply(connection, {"exit": os.WEXITSTATUS(status)})
            connection.close()

    def terminate(self, *_args) -> None:
        """The server ends (SIGTERM, or its pytest worker is gone): its programs with it."""
        for pid in list(self.children):
            kill_tree(pid)
        os._exit(0)


def kill_tree(pid: int) -> list:
    """SIGKILL every descendant of process ``pid``, the process group it leads (a forked
    program leads one, or soon will) and the process itself; returns the descendants (psutil
    processes, to wait for)."""
    import psutil

    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        family = []
    for process in family:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return family


def serve(path: str, imports: bool = True) -> None:
    """Preload (``imports``), then fork a child per request until the parent (the pytest
    worker) ends."""
    parent = os.getppid()
    base_env = dict(os.environ)
    gc.disable()
    if imports:
        preload()
    gc.freeze()  # the children share the imports' heap without copying it on a collection
    gc.enable()
    # what the imports set in the environment (vLLM sets a few): a child has them as a new
    # interpreter would after the same imports
    imported_env = {k: v for k, v in os.environ.items() if base_env.get(k) != v}
    base_path = [p for p in sys.path[1:]
                 if p not in _pythonpath(os.environ.get("PYTHONPATH", ""), os.getcwd())]
    server = _Server(path, base_env, imported_env, base_path)
    print(f"forkserver: ready in {time.process_time():.1f} CPU-s", flush=True)
    server.run(parent)


def _reply(connection: socket.socket, message: dict) -> None:
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client is gone; its program has killed itself, or will
        pass


_server = None
_socket = ""


def command(python_args: list[str]) -> list[str]:
    """The arguments after ``python`` that run ``python python_args`` through this test
    process's fork server (``python CLIENT python_args``), starting the server on the first
    call; ``python_args`` themselves with ``RLEP_TEST_FORKSERVER=0``. Until the server has
    finished its imports (6.6-8.5 CPU-seconds in the logs of bench/RESULTS.md's runs), the
    client starts the program itself."""
    if os.environ.get(VARIABLE) == "0":
        return list(python_args)
    start()
    return [CLIENT, *python_args]


def start() -> None:
    """Start this process's server in the background unless it runs or is turned off
    (tests/conftest.py, once the tests that start programs are collected)."""
    if _server is None and os.environ.get(VARIABLE) != "0":
        _start()


class Server(NamedTuple):
    pid: int
    socket: str


def start_and_wait(timeout_s: float = 300) -> Server:
    """This process's server, started if need be, once it serves (for a bench that times
    forked programs only)."""
    if _server is None:
        _start()
    path = _socket
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if _server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fork server did not start (exit code {_server.poll()})")
        time.sleep(0.1)
    return Server(_server.pid, path)


def _start() -> None:
    """The server in the background, its output in a log beside its socket; stopped when this
    process exits (and it stops by itself when this process is gone)."""
    global _server, _socket
    import atexit
    import subprocess
    import tempfile

    from tests.torchrun import REPO_ROOT, _env

    directory = tempfile.mkdtemp(prefix="rlep-forkserver-")
    path = os.path.join(directory, "socket")
    # RLEP_TEST_FORKSERVER_LOG=DIR: the server's log kept there (which programs it forked,
    # which it declined and why)
    log = open(os.path.join(os.environ.get("RLEP_TEST_FORKSERVER_LOG") or directory,
                            f"forkserver-{os.getpid()}.log"), "w")
    _server = subprocess.Popen([sys.executable, "-u", "-m", "tests.forkserver", path],
                               cwd=REPO_ROOT,
                               env=_env(None), stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    os.environ[VARIABLE] = _socket = path
    atexit.register(_stop, directory)


def _stop(directory: str) -> None:
    import shutil

    if _server is not None and _server.poll() is None:
        _server.terminate()  # it kills the programs it still runs
        try:
            _server.wait(10)
        except Exception:  # noqa: BLE001
            _server.kill()
            _server.wait()
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    # --no-preload: the server of tests/unit/test_forkserver.py, which imports nothing heavy
    serve(sys.argv[1], imports="--no-preload" not in sys.argv[2:])
