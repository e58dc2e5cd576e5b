"""``python tests/forkserver_client.py -m MODULE ARGS...`` or ``... SCRIPT ARGS...``: run a Python
program in a process forked from the test worker's fork server (tests/forkserver.py), which has
already imported torch, megatron-core, transformers and vLLM, as if ``python -m MODULE ARGS`` (or
``python SCRIPT ARGS``) had been started here.

This process stands in for the program: it hands the server its command line, environment,
working directory and standard streams, passes on the signals it gets (SIGTERM, SIGINT, ...),
and ends as the program ends, with its exit code or killed by the same signal. When this process
dies, the server kills the program's process group and everything it started. Without a server
(the variable unset, the server gone) or when the server declines (an environment that its
imports would have read differently), the program is started here as a new interpreter instead.

Only the standard library: this starts in 0.03-0.05 s (`/usr/bin/time` of its usage message).
"""
import json
import os
import signal
import socket
import struct
import sys

VARIABLE = "RLEP_TEST_FORKSERVER"
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)


def unbuffered():
    """Whether this interpreter runs with ``-u`` (its stdout then writes through)."""
    return bool(getattr(sys.stdout, "write_through", False))


def run_here(argv, unblock=False):
    """The program as a new interpreter in this process (``exec``); ``unblock``: the relayed
    signals were blocked (a pending one is delivered to the program, which gets their
    default handling until it sets its own)."""
    flags = ["-u"] if unbuffered() else []
    sys.stdout.flush()
    sys.stderr.flush()
    if unblock:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    os.execv(sys.executable, [sys.executable, *flags, *argv])


def main():
    argv = sys.argv[1:]
    if not argv or argv == ["-m"]:
        sys.exit("usage: forkserver_client.py -m MODULE [ARGS...] | SCRIPT [ARGS...]")
    path = os.environ.get(VARIABLE)
    if not path or path == "0":
        run_here(argv)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.connect(path)
    except OSError:
        server.close()
        run_here(argv)
    # a signal that comes before the program's pid is known waits until it is (relayed) or
    # until the program runs here instead (delivered to it)
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                          "unbuffered": unbuffered()}).encode()
    socket.send_fds(server, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    replies = server.makefile("rb")
    first = json.loads(replies.readline() or b'{"fallback": "the server closed"}')
    if "pid" not in first:
        replies.close()
        server.close()
        run_here(argv, unblock=True)
    pid = first["pid"]

    # torchrun and the tests end a program by signalling the group this process leads
    # (killpg): the program's own group (it leads one) gets the signal then
    group = os.getpgrp() == os.getpid()

    def relay(number, _frame):
        for kill in ((os.killpg, os.kill) if group else (os.kill,)):
            try:
                kill(pid, number)
                return
            except ProcessLookupError:  # no group yet (the program is starting), or gone
                pass

    for number in RELAYED:
        signal.signal(number, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    line = replies.readline()  # the program's end; a relayed signal does not interrupt it
    if not line:
        sys.exit(f"forkserver_client: the fork server went away while {argv} ran")
    status = json.loads(line)
    if "signal" in status:
        number = status["signal"]
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        sys.exit(128 + number)
    sys.exit(status["exit"])


if __name__ == "__main__":
    main()
