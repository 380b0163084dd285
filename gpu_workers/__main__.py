"""``python -m gpu_workers --config RUN_DIR/config.json --index I`` (supervisord runs this)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

# Other daemons' "reopen your logs" (logrotate's habit: `supervisorctl signal USR1 all`): this
# one logs to supervisord, and their default action killed it without a drain. Ignored.
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def main() -> int:
    # First, before the imports (torch: seconds) and the model's load: a USR1 or USR2 in them
    # killed the worker as it started (an outside check: "terminated by SIGUSR1; not
    # expected" at 1.5 to 4 s of its start), where serve()'s own came too late.
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="gpu_workers")
    parser.add_argument("--config", required=True, help="the resolved config.json in the run dir")
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args()

    from shmserve import logs, program_config

    # config.json, or the config it ran before an apply that has not reached it yet
    cfg, before_apply = program_config.load(args.config, f"worker-{args.index}")
    # Thread counts must be set before torch does any work: nginx, the frontends and the
    # workers share few cores.
    threads = str(cfg.workers.torch_threads)
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", cfg.workers.cuda_alloc_conf)
    logs.configure(cfg.logging, f"worker-{args.index}")
    pin(cfg, args.index)  # before torch starts its threads, which inherit the affinity
    if cfg.workers.start_timeout_s:
        # Until its sockets are bound (gpu_workers.worker cancels it): a hang in the imports or
        # in the device's initialisation, before any heartbeat, was never killed. faulthandler's
        # timer runs in a C thread, so a main thread stuck in C code holding the GIL still ends.
        faulthandler.dump_traceback_later(cfg.workers.start_timeout_s, exit=True)
    sys.setswitchinterval(cfg.workers.switch_interval_ms / 1000.0)

    from gpu_workers.device import DeviceError
    from shmserve.models import ModelSourceError

    log = logging.getLogger("shmserve.worker")
    if before_apply:
        log.warning("worker.config_before_apply", extra={"fields": {"config": before_apply}})
    try:
        return serve(cfg, args.index)
    except (DeviceError, ModelSourceError) as exc:
        # A configuration this worker cannot serve (a GPU it cannot see, a model it cannot
        # load): the message says what to change, and a traceback at every restart only
        # buried it. `up --wait` reads the `exception` field's last line (shmserve.startwait).
        logs.failed(log, "worker.failed", exc, traceback=False)
        return 1
    except Exception as exc:
        logs.failed(log, "worker.failed", exc)
        return 1


def pin(cfg, index: int) -> None:
    """A CPU worker's own cores, where workers.cpu_affinity auto finds them (shmserve.cores)."""
    from shmserve import cores, topology

    if cfg.workers.cpu_affinity != "auto" or topology.worker_devices(cfg)[index] != topology.CPU:
        return
    mine = cores.worker_cores(index, cfg.workers.cpu_workers, cfg.workers.torch_threads)
    if mine:
        os.sched_setaffinity(0, mine)
        logging.getLogger("shmserve.worker").info("worker.pinned", extra={"fields": {
            "cores": mine}})


def serve(cfg, index: int) -> int:
    """Load and serve until a signal stops it (SIGTERM, SIGINT, SIGHUP: a drain)."""
    import signal

    from gpu_workers.device import DeviceLost
    from gpu_workers.intake import Unwell
    from gpu_workers.worker import Worker

    log = logging.getLogger("shmserve.worker")
    worker = Worker(cfg, index)

    def stop(*_) -> None:
        """Serving: only a flag, the model loop drains and exits. Loading: at once, as nothing
        is admitted before it is ready; the load (imports, weights, warm-up: seconds, more on
        large models) went on to its end first, and a stop or restart waited for it."""
        worker.stopping.set()
        if not worker.status.ready:
            raise SystemExit(0)

    # SIGHUP (`supervisorctl signal HUP`) killed the worker without a drain: it drains as a stop
    # does, and supervisord starts it again.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    loading, answered = False, False
    try:
        worker.serve()
        answered = True
    except SystemExit:
        loading = answered = True
    except (DeviceLost, Unwell):
        answered = True  # what it held answered (DeviceLost: its pass 500) UNAVAILABLE
        raise
    finally:
        worker.close(answered)
    log.info("worker.stopped", extra={"fields": {"worker": index, "while_loading": loading}})
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exited:  # argparse's
        code = exited.code if isinstance(exited.code, int) else 2
    # Skip the interpreter's teardown: with a model loaded it spent ~1 s of CPU freeing
    # modules and tensors one by one (strace: no system call in the main thread), and every
    # stop and restart of a worker waited for it. By now the worker has closed its sockets
    # and shared memory (Worker.close), and its metrics live in files; only logs need a flush.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
