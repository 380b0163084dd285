"""A restarting frontend puts its socket in place without a moment where the path is missing
(nginx logs a connect to a missing socket file at level crit, a refused one as an error)."""

import os
import socket
import threading
import time

from frontend.__main__ import bind_in_place


def test_the_socket_path_never_goes_missing_while_frontends_replace_it(tmp_path):
    path = tmp_path / "frontend-0.sock"
    current = bind_in_place(path, 16)
    seen = {"missing": 0, "refused": 0, "connected": 0, "backlog full": 0}
    stop = threading.Event()

    def connect_in_a_loop():
        while not stop.is_set():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                # nothing accepts: a blocking connect to a full backlog would wait for ever
                client.settimeout(0.05)
                try:
                    client.connect(str(path))
                    seen["connected"] += 1
                except FileNotFoundError:
                    seen["missing"] += 1
                except ConnectionRefusedError:
                    seen["refused"] += 1
                except (BlockingIOError, TimeoutError):
                    seen["backlog full"] += 1

    client = threading.Thread(target=connect_in_a_loop)
    client.start()
    try:
        for _ in range(300):
            current.close()  # the old frontend exits, its file stays
            attempts = sum(seen.values())
            current = bind_in_place(path, 16)
            # the client's connects interleave with the replacements, however busy the machine
            deadline = time.monotonic() + 5
            while sum(seen.values()) == attempts and time.monotonic() < deadline:
                time.sleep(0)
    finally:
        stop.set()
        client.join()
        current.close()
    assert seen["missing"] == 0, seen
    assert sum(seen.values()) >= 300, seen
    # the new socket is the one at the path, and no staging file is left beside it
    assert os.listdir(tmp_path) == ["frontend-0.sock"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        current = bind_in_place(path, 16)
        client.connect(str(path))
        current.close()


def test_a_socket_path_of_the_longest_length_allowed_binds(tmp_path):
    """The staging name is no longer than the socket's, so a run_dir that passes the length
    check (shmserve.render: 108 bytes for every socket path) serves."""
    from shmserve.render import MAX_SOCKET_PATH

    name = "frontend-0.sock"
    room = MAX_SOCKET_PATH - len(str(tmp_path)) - len(name) - 2
    directory = tmp_path / ("d" * room)
    directory.mkdir()
    path = directory / name
    assert len(str(path).encode()) == MAX_SOCKET_PATH
    sock = bind_in_place(path, 4)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
    finally:
        sock.close()
