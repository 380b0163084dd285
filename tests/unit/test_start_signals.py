"""USR1 and USR2 (other daemons' "reopen your logs") are ignored from the first line of a
frontend's and a worker's main(), before their imports and model load: set only in serve(),
one sent while they started (1.5 to 4 s of it, an outside check) killed them."""

from __future__ import annotations

import signal
import sys

import pytest

import frontend.__main__ as frontend_main
import gpu_workers.__main__ as worker_main
from shmserve import config


class Seen(Exception):
    pass


@pytest.mark.parametrize("module", [frontend_main, worker_main], ids=["frontend", "worker"])
def test_reopen_signals_are_ignored_before_the_config_is_read(module, monkeypatch):
    seen = {}

    def load_resolved(*args, **kwargs):
        seen.update({sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)})
        raise Seen

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    monkeypatch.setattr(config, "load_resolved", load_resolved)
    monkeypatch.setattr(sys, "argv", ["prog", "--config", "/nonexistent.json", "--index", "0"])
    try:
        with pytest.raises(Seen):
            module.main()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert seen == {signal.SIGUSR1: signal.SIG_IGN, signal.SIGUSR2: signal.SIG_IGN}
