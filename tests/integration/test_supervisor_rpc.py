"""shmserve.supervisor_rpc inside a real supervisord: one process of a group added, replaced,
adopted or removed as the file says, the others left running, the group's config ending equal
to the file's (supervisorctl's `reread` sees nothing to update)."""

from __future__ import annotations

import subprocess
import sys
import time
import xmlrpc.client
from pathlib import Path

import pytest
from supervisor.xmlrpc import SupervisorTransport

BIN = Path(sys.executable).parent


def conf(tmp: Path, programs: dict[str, str]) -> str:
    sections = "".join(f"[program:{name}]\ncommand={command}\nstartsecs=0\n"
                       f"stdout_logfile={tmp}/{name}.log\nredirect_stderr=true\n\n"
                       for name, command in programs.items())
    return (f"[unix_http_server]\nfile={tmp}/s.sock\n\n"
            f"[supervisord]\nlogfile={tmp}/supervisord.log\npidfile={tmp}/s.pid\n\n"
            "[rpcinterface:supervisor]\nsupervisor.rpcinterface_factory = "
            "supervisor.rpcinterface:make_main_rpcinterface\n\n"
            "[rpcinterface:shmserve]\nsupervisor.rpcinterface_factory = "
            "shmserve.supervisor_rpc:make_rpcinterface\n\n"
            f"[supervisorctl]\nserverurl=unix://{tmp}/s.sock\n\n{sections}"
            f"[group:g]\nprograms={','.join(programs)}\n")


@pytest.fixture
def supervisord(tmp_path):
    path = tmp_path / "s.conf"
    path.write_text(conf(tmp_path, {"a": "sleep 300", "b": "sleep 301"}))
    subprocess.run([BIN / "supervisord", "-c", path], check=True)
    proxy = xmlrpc.client.ServerProxy(
        "http://localhost", SupervisorTransport(None, None, f"unix://{tmp_path}/s.sock"))
    deadline = time.monotonic() + 20
    while True:
        try:
            if all(p["statename"] == "RUNNING" for p in proxy.supervisor.getAllProcessInfo()):
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "supervisord did not start"
        time.sleep(0.05)
    yield path, proxy
    proxy("close")()
    subprocess.run([BIN / "supervisorctl", "-c", path, "shutdown"], check=False,
                   capture_output=True)


def states(proxy) -> dict[str, tuple[str, int]]:
    return {p["name"]: (p["statename"], p["pid"]) for p in proxy.supervisor.getAllProcessInfo()}


def command_of(pid: int) -> list[bytes]:
    """The command line `pid` runs, once it has exec'd (a fork still shows supervisord's)."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")[:2]
        if argv[0] == b"sleep" or time.monotonic() > deadline:
            return argv
        time.sleep(0.02)


def wait_running(proxy, name: str) -> int:
    deadline = time.monotonic() + 10
    while (state := states(proxy).get(name, ("", 0)))[0] != "RUNNING":
        assert time.monotonic() < deadline, states(proxy)
        time.sleep(0.05)
    return state[1]


def test_a_process_is_added_replaced_and_removed_while_the_others_run(supervisord):
    path, proxy = supervisord
    tmp = path.parent
    pids = {name: pid for name, (_, pid) in states(proxy).items()}
    assert proxy.shmserve.pending(["g"]) == {"added": [], "removed": [], "changed": []}

    path.write_text(conf(tmp, {"a": "sleep 400", "b": "sleep 301", "c": "sleep 302"}))
    assert proxy.shmserve.pending(["g"]) == {"added": ["g:c"], "removed": [],
                                             "changed": ["g:a"]}
    assert proxy.shmserve.syncProcess("g", "c", False) == "added"
    wait_running(proxy, "c")  # supervisord starts it as any autostart program
    assert proxy.shmserve.syncProcess("g", "b", False) == "unchanged"
    with pytest.raises(xmlrpc.client.Fault, match="STILL_RUNNING"):
        proxy.shmserve.syncProcess("g", "a", False)  # a running process is not replaced
    proxy.supervisor.stopProcess("g:a")
    assert proxy.shmserve.syncProcess("g", "a", False) == "replaced"
    # Stopped by a command, it stays stopped (supervisord autostarted the replacement: an
    # apply started a worker an operator had stopped), until started
    time.sleep(1)  # supervisord's loop ran its transitions meanwhile
    assert states(proxy)["a"] == ("STOPPED", 0)
    proxy.supervisor.startProcess("g:a")
    new_a = wait_running(proxy, "a")
    assert new_a != pids["a"] and states(proxy)["b"] == ("RUNNING", pids["b"])
    assert command_of(new_a) == [b"sleep", b"400"]
    # In the file's order: the group's config is the file's, nothing left to update.
    assert proxy.supervisor.reloadConfig() == [[[], [], []]]

    path.write_text(conf(tmp, {"a": "sleep 400", "c": "sleep 302"}))
    assert proxy.shmserve.pending(["g"])["removed"] == ["g:b"]
    proxy.supervisor.stopProcess("g:b")
    assert proxy.shmserve.syncProcess("g", "b", False) == "removed"
    assert set(states(proxy)) == {"a", "c"}
    assert proxy.supervisor.reloadConfig() == [[[], [], []]]


def test_a_running_process_adopts_new_settings_for_its_next_start(supervisord):
    """nginx is never stopped by apply: its program's new settings (stop timeout, logs) are
    taken while it runs, and used from its next start."""
    path, proxy = supervisord
    pid = states(proxy)["b"][1]
    path.write_text(conf(path.parent, {"a": "sleep 300", "b": "sleep 500"}))
    assert proxy.shmserve.syncProcess("g", "b", True) == "adopted"
    assert states(proxy)["b"] == ("RUNNING", pid)
    assert proxy.supervisor.reloadConfig() == [[[], [], []]]
    proxy.supervisor.stopProcess("g:b")
    proxy.supervisor.startProcess("g:b")
    assert command_of(wait_running(proxy, "b")) == [b"sleep", b"500"]


def test_names_it_does_not_know_are_refused(supervisord):
    _, proxy = supervisord
    with pytest.raises(xmlrpc.client.Fault, match="BAD_NAME"):
        proxy.shmserve.syncProcess("nope", "a", False)
    with pytest.raises(xmlrpc.client.Fault, match="BAD_NAME"):
        proxy.shmserve.syncProcess("g", "z", False)
    assert proxy.shmserve.getAPIVersion() == "1"
