"""A frontend's API keys: auth.api_keys_file read again when it changes (frontend.auth.ApiKeys),
so a rotated secret takes effect without a restart, and a file that does not load keeps the
keys in force."""

import hashlib
import os
import time

import pytest

from frontend import auth, metrics
from shmserve import apikeys, config
from shmserve.typedtree import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def settled() -> float:
    """A wall clock past every file's settling (KEYS_SETTLE_S): each change read at its look."""
    return time.time() + 10 * auth.KEYS_SETTLE_S


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("old-key-0001\n")
    return path


def keyed(path):
    return config.load(environ={"SHMSERVE__AUTH__API_KEYS": '["inline-key-00"]',
                                "SHMSERVE__AUTH__API_KEYS_FILE": str(path)})


def rewrite(path, text: str) -> None:
    """As a secret is rotated (a mounted Kubernetes secret, `mv` into place): a new inode."""
    (path.parent / "new").write_text(text)
    os.replace(path.parent / "new", path)


def test_a_changed_file_is_read_at_the_next_look_and_not_before(keys_file, caplog):
    clock = Clock()
    keys = auth.ApiKeys(keyed(keys_file), clock, settled)
    assert keys.current() == {digest("inline-key-00"), digest("old-key-0001")}
    rewrite(keys_file, "# rotated\nnew-key-0002\n")
    clock.now += auth.KEYS_LOOK_S / 2
    assert digest("old-key-0001") in keys.current()  # one stat a second, not one a request
    clock.now += auth.KEYS_LOOK_S
    with caplog.at_level("INFO", logger="shmserve.frontend"):
        assert keys.current() == {digest("inline-key-00"), digest("new-key-0002")}
    reloaded = [r for r in caplog.records if r.msg == "frontend.api_keys_reloaded"]
    assert [r.fields for r in reloaded] == [{"keys": 2, "added": 1, "removed": 1}]
    assert "new-key-0002" not in caplog.text and "old-key-0001" not in caplog.text


def test_a_file_edited_in_place_is_read_again(keys_file):
    """Not renamed: the same inode, its size or modification time changed."""
    clock = Clock()
    keys = auth.ApiKeys(keyed(keys_file), clock, settled)
    with open(keys_file, "a") as file:
        file.write("added-key-0003\n")
    clock.now += auth.KEYS_LOOK_S
    assert digest("added-key-0003") in keys.current() and digest("old-key-0001") in keys.digests


def test_a_file_just_written_is_taken_only_once_a_look_finds_it_unchanged(keys_file):
    """Written in place, the file may be read half-way: its head of a key was a key, the keys
    after it refused (an outside check). Modified within KEYS_SETTLE_S, it waits a look."""
    clock = Clock()
    keys = auth.ApiKeys(keyed(keys_file), clock)  # the real wall clock: just written
    with open(keys_file, "w") as file:
        file.write("old-key-0001\nnew-key-00")  # the writer not done yet
        file.flush()
        clock.now += auth.KEYS_LOOK_S
        assert keys.current() == {digest("inline-key-00"), digest("old-key-0001")}
        file.write("02\n")  # and a look later it has written on: it waits again
        file.flush()
        clock.now += auth.KEYS_LOOK_S
        assert digest("new-key-00") not in keys.current()
    clock.now += auth.KEYS_LOOK_S
    assert digest("new-key-00") not in keys.current()  # changed since the last look
    clock.now += auth.KEYS_LOOK_S
    assert keys.current() == {digest("inline-key-00"), digest("old-key-0001"),
                              digest("new-key-0002")}


def test_a_file_that_settled_before_the_first_look_is_read_at_it(keys_file):
    """An idle frontend's first request after a change does not wait for a second look."""
    clock = Clock()
    keys = auth.ApiKeys(keyed(keys_file), clock)
    rewrite(keys_file, "new-key-0002\n")
    past = time.time() - 2 * auth.KEYS_SETTLE_S
    os.utime(keys_file, (past, past))
    clock.now += 60
    assert keys.current() == {digest("inline-key-00"), digest("new-key-0002")}


@pytest.mark.parametrize("broken", ["", "# no key\n", "bad key\n", None])
def test_a_file_that_does_not_load_keeps_the_keys_in_force(keys_file, caplog, broken):
    """Never an open server, nor one whose keys are gone: the keys stay, said once."""
    clock = Clock()
    keys = auth.ApiKeys(keyed(keys_file), clock, settled)
    before = keys.current()
    if broken is None:
        keys_file.unlink()
    else:
        rewrite(keys_file, broken)
    with caplog.at_level("ERROR", logger="shmserve.frontend"):
        for _ in range(3):
            clock.now += auth.KEYS_LOOK_S
            assert keys.current() == before
    refused = [r for r in caplog.records if r.msg == "frontend.api_keys_file_refused"]
    assert len(refused) == 1 and refused[0].fields["kept_keys"] == 2
    assert "api_keys_file" in refused[0].fields["reason"]
    gauge = metrics.KEYS_FILE_REFUSED.labels("0")._value
    assert gauge.get() == 1  # shmserve_api_keys_file_refused: the alert's
    rewrite(keys_file, "old-key-0001\n")  # put back as it was: said, though no key changed
    clock.now += auth.KEYS_LOOK_S
    with caplog.at_level("INFO", logger="shmserve.frontend"):
        assert keys.current() == before
    assert caplog.records[-1].msg == "frontend.api_keys_reloaded" and gauge.get() == 0
    rewrite(keys_file, "mended-key-0004\n")  # a new key: read at the next look
    clock.now += auth.KEYS_LOOK_S
    assert keys.current() == {digest("inline-key-00"), digest("mended-key-0004")}


def test_a_file_changing_while_read_is_read_again_at_the_next_look(keys_file, monkeypatch):
    clock = Clock()
    keys = auth.ApiKeys(keyed(keys_file), clock, settled)
    read = apikeys.api_keys

    def half_written(cfg):  # the writer goes on while the frontend reads
        got = read(cfg)
        with open(keys_file, "a") as file:
            file.write("late-key-0005\n")
        return got
    monkeypatch.setattr(auth, "api_keys", half_written)
    with open(keys_file, "a") as file:
        file.write("first-key-0006\n")
    clock.now += auth.KEYS_LOOK_S
    keys.current()
    monkeypatch.setattr(auth, "api_keys", read)
    clock.now += auth.KEYS_LOOK_S
    assert digest("late-key-0005") in keys.current()


def test_without_a_file_the_configured_keys_stand_and_nothing_is_looked_at(monkeypatch):
    clock = Clock()
    keys = auth.ApiKeys(config.load(environ={"SHMSERVE__AUTH__API_KEYS": '["inline-key-00"]'}),
                        clock)
    open_server = auth.ApiKeys(config.load(environ={}), clock)
    monkeypatch.setattr(auth, "_stamp", lambda *_: pytest.fail("a look without a file"))
    clock.now += 5 * auth.KEYS_LOOK_S
    assert keys.current() == {digest("inline-key-00")}
    assert open_server.current() == frozenset()  # open


def test_a_file_that_does_not_load_at_start_stops_the_frontend(keys_file):
    cfg = keyed(keys_file)
    keys_file.write_text("")
    with pytest.raises(ConfigError, match="holds no key"):
        auth.ApiKeys(cfg)
