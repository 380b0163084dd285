"""Whether the running frontends and workers speak this installed shmserve's worker protocol.

Frontends and workers talk over ZeroMQ in `shmserve.protocol`'s messages, versioned by
PROTOCOL_VERSION; each side ignores the other's heartbeats when the versions differ. So after an
upgrade that changed it, programs restarted one at a time (`shmserve restart`, `shmserve apply`)
cannot serve with the ones still running the old code: a rolling restart of the workers waited
its whole timeout for a worker no old frontend would use, and one of the frontends then left the
old workers unused (a degraded deployment). The commands that restart programs ask every
program first (a worker by a ping, a frontend by GET /health), and refuse such a change: only a
start of everything together serves on. A program that does not answer in time (stopped,
crash-looping) is left out of the comparison.
"""

from __future__ import annotations

import time

from shmserve import topology
from shmserve.config import Config
from shmserve.protocol import PROTOCOL_VERSION, Kind, Ping


def running_protocols(cfg: Config, timeout: float = 1.0) -> dict[int, int]:
    """The protocol version each running worker's heartbeat names, by worker index (a worker
    that does not answer within `timeout` is left out). Read from the heartbeat's first field,
    which every version of the protocol has kept, so any version's answer is understood."""
    import msgpack
    import zmq

    from shmserve import wire

    paths = sorted(topology.socket_dir(cfg).glob("worker-*.ipc"))
    ctx = zmq.Context()
    sockets: dict[zmq.Socket, int] = {}
    try:
        poller = zmq.Poller()
        for path in paths:
            index = path.stem.removeprefix("worker-")
            if not index.isdigit():
                continue
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{path}")
            sock.send_multipart(wire.encode(Ping(time.time())))  # frontend -1: not a frontend
            sockets[sock] = int(index)
            poller.register(sock, zmq.POLLIN)
        found: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(sockets) and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(left * 1000):
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == bytes((Kind.HEARTBEAT,)):
                    try:
                        fields = msgpack.unpackb(frames[1])
                    except ValueError:
                        continue
                    if isinstance(fields, list) and fields and isinstance(fields[0], int):
                        found[sockets[sock]] = fields[0]
                        poller.unregister(sock)
        return found
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def frontend_protocols(cfg: Config, timeout: float = 1.0) -> dict[int, int]:
    """The protocol each running frontend's GET /health names, by index, asked on its own
    socket; 8 for one that answers without naming it (it came in with protocol 9)."""
    import json

    from shmserve import remote

    found: dict[int, int] = {}
    for path in sorted(topology.socket_dir(cfg).glob("frontend-*.sock")):
        index = path.stem.removeprefix("frontend-")
        if not index.isdigit():
            continue
        code, body = remote.get_unix(str(path), "/health", timeout)
        if code != 200:
            continue
        try:
            said = json.loads(body)
        except ValueError:
            continue
        if isinstance(said, dict):
            version = said.get("protocol", 8)
            found[int(index)] = version if isinstance(version, int) else 8
    return found


def protocol_change(cfg: Config, timeout: float = 1.0) -> str | None:
    """What stands in the way of restarting programs one group at a time: the running
    frontends and workers that speak another protocol than this installed shmserve, said with
    what to do; None when they all speak it (or none answers: nothing to compare)."""
    other = [(f"frontend-{i}", v) for i, v in sorted(frontend_protocols(cfg, timeout).items())
             if v != PROTOCOL_VERSION]
    other += [(f"worker-{i}", v) for i, v in sorted(running_protocols(cfg, timeout).items())
              if v != PROTOCOL_VERSION]
    if not other:
        return None
    named = ", ".join(f"{name} speaks {version}" for name, version in other)
    return (f"running programs speak another worker protocol than this installed shmserve "
            f"({PROTOCOL_VERSION}): {named}. Frontends and workers of two versions cannot "
            "talk, so programs restarted one (or one group) at a time would not serve with "
            "the others; restart everything together: `shmserve down`, then `shmserve up "
            "--wait` (requests are refused until it is ready; in Kubernetes, a rolling update "
            "of the pods does this one pod at a time)")
