"""A frontend's stop signal, whenever it comes."""

import subprocess
import sys

from tests.conftest import tiny_overrides
from tests.integration.conftest import run_config
from tests.stack import REPO

# A frontend whose signal comes while it makes its app (loading its tokenizers), after its
# stop handlers were installed and before its event loop runs.
EARLY = """
import os, signal, sys
import frontend.app
from frontend import __main__ as frontend_main
made = frontend.app.create_app
def create_app(*args):
    os.kill(os.getpid(), signal.{signal})
    return made(*args)
frontend.app.create_app = create_app
sys.argv = ["frontend", "--config", sys.argv[1], "--index", "0"]
sys.exit(frontend_main.main())
"""


def test_a_stop_signal_before_the_loop_runs_is_not_lost(tmp_path, tiny_model):
    """uvloop drops a signal that arrives after add_signal_handler but before its loop runs
    (its wakeup fd is set only then): a `down` right after an `up` signalled a frontend still
    loading, which then served on until supervisord's SIGKILL (a fresh-clone CI run)."""
    cfg = run_config(tmp_path, tiny_overrides(tiny_model))
    for stop in ("SIGTERM", "SIGHUP"):
        done = subprocess.run([sys.executable, "-c", EARLY.format(signal=stop),
                               str(cfg.run_dir / "config.json")], cwd=REPO,
                              capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, (stop, done.returncode, done.stderr[-2000:])
        assert '"message":"frontend.stopped"' in done.stdout, done.stdout[-2000:]
