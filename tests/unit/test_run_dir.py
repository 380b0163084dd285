"""The run directory `shmserve up` renders into: private, with its folders, and refused (naming
the key) where it cannot be made or belongs to another user."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shmserve import config, render
from shmserve.config import REPO_ROOT
from tests.unit.test_render import free_port, make_config


def test_run_dir_is_private_and_has_its_folders(tmp_path):
    cfg = make_config(tmp_path / "run")
    render.render(cfg)
    assert cfg.run_dir.stat().st_mode & 0o777 == 0o700
    # it may hold API keys and the admin token given in the config or the environment (README)
    assert (cfg.run_dir / "config.json").stat().st_mode & 0o777 == 0o600
    for sub in ("sockets", "logs", "metrics", "nginx/temp", "nginx/errors"):
        assert (cfg.run_dir / sub).is_dir(), sub


def test_a_run_dir_that_cannot_be_made_names_the_key(tmp_path):
    (tmp_path / "a-file").write_text("")
    for run_dir in (tmp_path / "a-file", tmp_path / "a-file" / "run"):
        with pytest.raises(render.RenderError, match=r"server.run_dir: cannot make .*a-file"):
            render.render(make_config(run_dir))


def test_a_run_dir_of_another_user_is_refused_and_a_subdirectory_of_it_works():
    """A Kubernetes emptyDir as the pod's non-root user sees it: root's, group-writable through
    fsGroup (2777). It cannot be made private, so render says to use a subdirectory; the
    subdirectory render makes itself is the user's own, 0700."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to render as another user")
    uid = 10001
    base = Path(tempfile.mkdtemp(prefix="shmserve-owner-"))
    try:
        base.chmod(0o755)
        volume = base / "volume"
        volume.mkdir()
        os.chown(volume, 0, uid)
        volume.chmod(0o2777)

        def render_as_user(run_dir: Path) -> subprocess.CompletedProcess:
            code = ("from shmserve import config, render; "
                    "render.render(config.load(environ={'SHMSERVE_ENV': 'dev', "
                    f"'SHMSERVE__SERVER__RUN_DIR': {str(run_dir)!r}, "
                    f"'SHMSERVE__SERVER__PORT': '{free_port()}'}}))")
            return subprocess.run([setpriv, "--reuid", str(uid), "--regid", str(uid),
                                   "--clear-groups", sys.executable, "-c", code],
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

        refused = render_as_user(volume)
        assert refused.returncode != 0
        assert (f"server.run_dir: {volume} belongs to uid 0" in refused.stderr
                and f"such as {volume / 'run'}" in refused.stderr), refused.stderr
        assert volume.stat().st_mode & 0o7777 == 0o2777  # left as it was
        done = render_as_user(volume / "run")
        assert done.returncode == 0, done.stderr
        made = (volume / "run").stat()
        assert made.st_uid == uid and made.st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(base)


def test_a_run_dir_under_another_users_directory_is_refused(tmp_path):
    """The owner of a directory above the run directory can rename it and put its own
    config.json in its place (an outside check did, as a second local user: the first user's
    restarted workers served its config). Refused, for root as for anyone; a directory of
    one's own, or root's, above it is fine."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    tmp_path.chmod(0o755)
    theirs = tmp_path / "o"  # short: a socket path's length is checked first
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 10002, 10002)
    for run_dir in (theirs / "run", theirs / "d" / "run"):
        with pytest.raises(render.RenderError, match=rf"server.run_dir: {theirs} belongs to uid "
                           rf"10002, who could replace {run_dir} and the config every process "
                           r"reads; put the run directory where every directory above it is "
                           r"this user's or root's"):
            render.render(make_config(run_dir))
        assert not run_dir.exists()  # nothing made
    # a symlink in a directory of one's own, to a directory under theirs: the target counts
    link = tmp_path / "l"
    link.symlink_to(theirs)
    with pytest.raises(render.RenderError, match=rf"{link} belongs to uid 10002"):
        render.render(make_config(link / "run"))
    # the run directory itself theirs: refused (root could chmod it, its owner still owns it),
    # and no subdirectory of it is suggested
    with pytest.raises(render.RenderError, match=rf"{theirs} belongs to uid 10002, not to this "
                       r"user \(uid 0\).*a directory of this user's"):
        render.render(make_config(theirs))
    render.render(make_config(tmp_path / "mine" / "run"))  # root's all the way up: made


def test_another_users_cli_on_a_private_run_dir_says_so_without_a_traceback(tmp_path):
    """`shmserve down` or `status` by a user who cannot read the deployment's run directory
    printed a PermissionError traceback (an outside check, as a second local user)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run the CLI as another user")
    tmp_path.chmod(0o755)
    env = {**os.environ, "SHMSERVE_ENV": "dev", "SHMSERVE__SERVER__RUN_DIR": str(tmp_path / "run"),
           "SHMSERVE__SERVER__PORT": str(free_port())}
    render.render(config.load(environ=env))  # root's, 0700
    for command in ("down", "status"):
        done = subprocess.run([setpriv, "--reuid", "10001", "--regid", "10001", "--clear-groups",
                               sys.executable, "-m", "shmserve.cli", command], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode == 2 and "permission denied (is this deployment, its " \
            "server.run_dir, another user's?)" in done.stderr, done.stderr
