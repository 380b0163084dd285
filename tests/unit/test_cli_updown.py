"""`up` and `down` one at a time on a run directory (shmserve.state.starting_or_stopping)."""

import threading
import time

from shmserve import cli, state, supervisor_files


def test_up_while_a_down_cleans_up_is_refused_and_says_so(deployment, capsys):
    """Once a `down`'s supervisord had exited, an `up` went ahead while that `down` still
    cleaned up: the `down` then SIGKILLed the new deployment's programs as orphans and removed
    its supervisord's pid file and control socket, leaving a supervisord no command reached
    (an outside check). `down` holds the run directory's up/down lock to its end."""
    deployment.run_dir.mkdir(parents=True)
    with state.starting_or_stopping(deployment, "down", wait=True):
        assert cli.main(["up"]) == 2
        err = capsys.readouterr().err
        assert "a `down` is stopping this deployment" in err and "run `up` again" in err
        # nothing started, nothing rendered
        assert not supervisor_files.supervisord_conf(deployment).exists()
    with state.starting_or_stopping(deployment, "up", wait=False):
        assert cli.main(["up"]) == 2
        assert "`shmserve up` (pid" in capsys.readouterr().err


def test_a_down_waits_for_an_up_that_is_starting(deployment):
    deployment.run_dir.mkdir(parents=True)
    order = []

    def down_side():
        with state.starting_or_stopping(deployment, "down", wait=True):
            order.append("down")

    with state.starting_or_stopping(deployment, "up", wait=False):
        waiting = threading.Thread(target=down_side)
        waiting.start()
        time.sleep(0.3)
        order.append("up ends")
    waiting.join(10)
    assert order == ["up ends", "down"]


def test_no_run_directory_a_down_takes_no_lock_and_a_first_up_does(deployment):
    """(nothing there for a `down` to clean; two first `up`s at once: one is refused)"""
    with state.starting_or_stopping(deployment, "down", wait=True):
        pass
    assert not deployment.run_dir.exists()
    with state.starting_or_stopping(deployment, "up", wait=False):
        assert deployment.run_dir.is_dir()
        try:
            with state.starting_or_stopping(deployment, "up", wait=False):
                raise AssertionError("a second up went ahead")
        except state.Busy as busy:
            assert "`shmserve up` (pid" in str(busy)
    assert not deployment.run_dir.exists()  # a refused first up leaves none


def test_up_while_supervisord_shuts_down_by_other_hands_says_so(deployment, capsys,
                                                                 monkeypatch):
    """(`ctl shutdown`, a SIGTERM to supervisord: no `down` holds the lock) It said "already
    running ... `shmserve apply`" (an outside check)."""
    from shmserve import processes

    monkeypatch.setattr(cli, "supervisord_pid", lambda cfg: 4321)
    monkeypatch.setattr(processes, "shutting_down", lambda cfg: True)
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err
    assert "supervisord (pid 4321" in err and "is shutting down" in err and "apply" not in err


def test_a_run_directory_up_cannot_make_is_named_not_a_traceback(deployment, tmp_path,
                                                                 monkeypatch, capsys):
    """server.run_dir under a file, on a file system that refuses it (/proc), or a file
    itself: `up` printed mkdir's or the lock's traceback and exited 1 (an outside check)."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    for run_dir, said in ((a_file / "run", "cannot create"), ("/proc/shmserve-test-run",
                                                               "cannot create"),
                          (a_file, "is not a directory")):
        monkeypatch.setenv("SHMSERVE__SERVER__RUN_DIR", str(run_dir))
        assert cli.main(["up"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("shmserve: server.run_dir: ") and said in err, err
        assert "Traceback" not in err
    assert a_file.is_file()
    for run_dir in (a_file / "run", a_file):  # `down`: NotADirectoryError's traceback, exit 1
        monkeypatch.setenv("SHMSERVE__SERVER__RUN_DIR", str(run_dir))
        assert cli.main(["down"]) == 0
        assert "not running" in capsys.readouterr().out
    assert a_file.is_file()
