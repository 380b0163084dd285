import msgpack
import pytest

from shmserve import wire
from shmserve.protocol import (KIND_OF, Abort, Closing, ClosingSeen, Commit, Error, ErrorCode,
                               Heartbeat, Queued, Kind, ModelInfo, Ping, Reload, ReloadDone,
                               ReloadStatus, Result, ShmHandle, Submit, Unloaded)

HANDLE = ShmHandle("shmserve-abc-fe0-1", 128, 4 * 6, "int32", (6,))
EMPTY = ShmHandle("shmserve-abc-fe0-1", 128, 0, "int32", (0,))  # a single-segment request
MESSAGES = [
    Ping(1.5),
    Heartbeat(1, 0, 4242, True, "cpu", (
        ModelInfo("m", "embedding", 384, 256, "fp32", "ab12", "ready", ""),
        ModelInfo("m@b", "classification", 3, 512, "int8", "r1", "loading", "r2")), 3, 4096, 1.5,
        0.25, 1234.5, 0.05, (Queued(0, 300), Queued(-2, 7))),
    Heartbeat(1, 3, 1, False, "loading", (), 0, 1, 0.0, 0.0),
    Heartbeat(1, 2, 5, True, "cpu", (), 0, 1, 0.0, 0.0,
              unloaded=(Unloaded("b", "OSError: gone", 2, 3.5),)),
    Submit(7, "req-1", "m", HANDLE, ShmHandle("a", 0, 0, "int32", (0,)),
           ShmHandle("a", 64, 4 * 2 * 384, "float32", (2, 384)), 1e9, -1, EMPTY),
    Submit(8, "req-2", "ce", HANDLE, HANDLE, ShmHandle("a", 64, 4 * 6, "float32", (6, 1)), 1e9,
           0, ShmHandle("a", 128, 4 * 6, "int32", (6,))),
    Result(7, 0.5, 12.25, 32, 100, "rev-2"),
    Error(7, ErrorCode.OVERLOADED, "queue full"),
    Abort(2**40),
    Closing(2, 4242),
    ClosingSeen(1),
    Reload(3, "ticket-1", "m@b", "/models/m-v2", ""),
    Commit(4, "ticket-1", "m@b", True),
    Commit(5, "ticket-1", "m", False),
    ReloadDone(3, ReloadStatus.BUSY, "", "another reload is in progress"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_is_two_frames_with_the_kind_first(msg):
    frames = wire.encode(msg)
    assert len(frames) == 2
    assert frames[0] == bytes((KIND_OF[type(msg)],))
    back = wire.decode(frames)
    assert back == msg
    assert type(back) is type(msg)


def test_enums_and_tuples_come_back_typed():
    back = wire.decode(wire.encode(MESSAGES[7]))
    assert back.code is ErrorCode.OVERLOADED
    done = wire.decode(wire.encode(MESSAGES[-1]))
    assert done.status is ReloadStatus.BUSY
    assert wire.decode(wire.encode(MESSAGES[-2])).keep is False
    submit = wire.decode(wire.encode(MESSAGES[4]))
    assert submit.output.shape == (2, 384) and isinstance(submit.output.shape, tuple)
    [unloaded] = wire.decode(wire.encode(MESSAGES[3])).unloaded
    assert unloaded == Unloaded("b", "OSError: gone", 2, 3.5)


def test_large_message_round_trips():
    long_id = "x" * 100_000
    msg = Submit(1, long_id, "m", HANDLE, HANDLE, HANDLE, 0.0, 0, EMPTY)
    assert wire.decode(wire.encode(msg)).request_id == long_id


@pytest.mark.parametrize("frames", [
    [b"\x01"],
    [b"\x01", b"\x91\xcb", b"extra"],
    [b"", msgpack.packb([1.0])],
    [b"\x63", msgpack.packb([1.0])],  # unknown kind
    [bytes((Kind.PING,)), b"\xc1"],  # invalid msgpack
    [bytes((Kind.PING,)), msgpack.packb([1.0, 2.0])],  # wrong arity
    [bytes((Kind.PING,)), msgpack.packb(["1.0"])],  # wrong type
    [bytes((Kind.RESULT,)), msgpack.packb([True, 0.0, 0.0, 1, 1, "r"])],  # bool is not an int
    [bytes((Kind.RESULT,)), msgpack.packb([1, 0.0, 0.0, 1, 1])],  # protocol 1's Result
    [bytes((Kind.RELOAD_DONE,)), msgpack.packb([1, 7, "", "x"])],  # unknown reload status
    [bytes((Kind.COMMIT,)), msgpack.packb([1, "t", "m", 1])],  # an int is not a bool
    [bytes((Kind.ERROR,)), msgpack.packb([1, 99, "x"])],  # unknown error code
])
def test_garbage_raises_wire_error(frames):
    with pytest.raises(wire.WireError):
        wire.decode(frames)


def test_decode_all_reads_a_batch_of_replies_and_isolates_a_bad_one():
    """A worker sends a batch's replies to one frontend as one message of (kind, body) pairs."""
    replies = [MESSAGES[5], MESSAGES[6], Result(8, 1.0, 2.0, 3, 4, "rev-2")]
    frames = [f for msg in replies for f in wire.encode(msg)]
    assert wire.decode_all(frames) == replies
    frames[2:4] = [bytes((Kind.RESULT,)), b"\xc1"]  # the second reply is garbage
    got = wire.decode_all(frames)
    assert got[0] == replies[0] and got[2] == replies[2]
    assert isinstance(got[1], wire.WireError)
    for bad in ([], [b"\x04"], frames[:3]):
        with pytest.raises(wire.WireError):
            wire.decode_all(bad)


def test_encode_is_safe_from_several_threads():
    """The worker encodes heartbeats in its socket thread while the model thread encodes
    results: each must come out whole."""
    import threading

    errors = []

    def run(msg):
        for _ in range(3000):
            if wire.decode(wire.encode(msg)) != msg:
                errors.append(msg)

    threads = [threading.Thread(target=run, args=(m,)) for m in (MESSAGES[1], MESSAGES[3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
