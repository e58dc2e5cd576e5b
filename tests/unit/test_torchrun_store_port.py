"""The test launcher's store port: drawn below the ephemeral range, and a launch whose store
could not listen is started again (tests/torchrun.py)."""

import pytest

from tests import torchrun

pytestmark = pytest.mark.unit

# rank 0 counts its launches in a file; it fails as a store that could not listen does, on the
# launches before ``succeed_at``, with another error when ``other`` is set
PROGRAM = """
import os, sys
count_file, succeed_at, other = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if os.environ["RANK"] == "0":
    count = int(open(count_file).read()) + 1 if os.path.exists(count_file) else 1
    open(count_file, "w").write(str(count))
    if count < succeed_at:
        print("ValueError: bad" if other else
              "torch.distributed.DistNetworkError: The server socket has failed to listen on "
              "any local network address. port: 1, useIpv6: false, code: -98, name: "
              "EADDRINUSE", file=sys.stderr)
        sys.exit(1)
"""


def test_store_port_is_free_and_in_its_range():
    import socket

    low, high = torchrun._STORE_PORTS  # below Linux's default ephemeral range (32768 and up)
    ports = {torchrun.store_port() for _ in range(20)}
    assert all(low <= port < high for port in ports)
    assert len(ports) > 1  # drawn, not fixed
    port = torchrun.store_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize("succeed_at,other,launches,code", [
    (2, False, 2, 0),  # the store's port was taken once: launched again, passes
    (9, False, torchrun.STORE_ATTEMPTS, 1),  # taken every time: fails after the attempts
    (2, True, 1, 1),  # any other failure: not launched again
])
def test_a_launch_whose_store_could_not_listen_is_started_again(tmp_path, succeed_at, other,
                                                               launches, code):
    program, count_file = tmp_path / "program.py", tmp_path / "count"
    program.write_text(PROGRAM)
    args = [str(count_file), str(succeed_at), "1" if other else "0"]
    if code:
        with pytest.raises(AssertionError, match="failed"):
            torchrun.run_ranks(str(program), 2, args, timeout_s=120)
    else:
        torchrun.run_ranks(str(program), 2, args, timeout_s=120)
    assert int(count_file.read_text()) == launches
