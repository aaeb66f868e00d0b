"""One MiB over a link, timed: `link_probe.py receive` prints the port it listens on and answers
with the byte count once it has read the last byte; `link_probe.py send HOST PORT` sends the MiB
and prints the seconds from its first byte until that answer, the link's rate rather than the
socket buffers'. tests/test_testbed.py runs each end in a node's network namespace.
"""

import socket
import sys
import time

MEBIBYTE = 1 << 20


def receive() -> None:
    with socket.create_server(("", 0)) as server:
        print(server.getsockname()[1], flush=True)
        peer, _ = server.accept()
        got = 0
        while chunk := peer.recv(65536):
            got += len(chunk)
        peer.sendall(str(got).encode())


def send(host: str, port: str) -> None:
    with socket.create_connection((host, int(port))) as link:
        started = time.perf_counter()
        link.sendall(bytes(MEBIBYTE))
        link.shutdown(socket.SHUT_WR)
        assert link.recv(64) == str(MEBIBYTE).encode()
        print(time.perf_counter() - started)


if __name__ == "__main__":
    receive() if sys.argv[1] == "receive" else send(*sys.argv[2:4])
