"""``shmserve status``: each process's state and memory, per worker its queue and speed, the
deployment's readiness; once, or refreshed (--watch) as a table or JSON lines. The sampling and
the table are shmserve.status; this is the command around them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shmserve import (__version__, apikeys, config, nginxrun, processes, remote, render,
                      restart_record, tls, topology)
from shmserve import status as statusview
from shmserve.config import Config
from shmserve.prechecks import CliError
from shmserve.startwait import process_info

supervisord_pid = processes.supervisord_pid


class _Stopped(Exception):
    """The deployment's supervisord went away while `status` watched it."""


def keys_file_warnings(cfg: Config) -> list[str]:
    """auth.api_keys_file as it is now, where it does not load: in --json's warnings too (an
    outside check's monitoring read `ready` and no warning)."""
    try:
        apikeys.api_keys(cfg)
    except config.ConfigError as exc:
        return [f"{exc}: the frontends keep the keys they read; one that starts now exits "
                "until it is put right"]
    return []


def nginx_file_warnings(cfg: Config) -> list[str]:
    """What nginx would meet in its files now, restarted (`restart nginx --all-at-once`, or by
    supervisord after a crash), though it runs on what it read last: `nginx -t` of its config
    (a CRL or certificate file broken since, which a reload refuses and a start cannot pass:
    an outside check's nginx, killed, stayed down, status having said nothing), and the TLS
    files' certificates and CRLs past or near their dates (tls.expiry_warnings)."""
    refused = render.nginx_start_refusal(cfg)
    return (([refused] if refused else []) + tls.crl_warnings(cfg)
            + tls.expiry_warnings(cfg, time.time()))


def status(args: argparse.Namespace) -> int:
    """0: every process runs and GET /ready says ready; 1: not so (or supervisord is gone but
    processes it started live on); 3: not running at all."""
    cfg = processes.deployment(args)
    if args.watch is not None and args.watch <= 0:
        raise CliError("--watch needs a positive number of seconds")
    if args.count is not None and args.watch is None:
        raise CliError("--count counts --watch's refreshes; add --watch")
    about = {"version": __version__, "url": remote.base_url(cfg), "run_dir": str(cfg.run_dir)}
    if cfg.server.grpc_port:
        about["grpc_port"] = cfg.server.grpc_port

    def say(state: str, message: str) -> None:
        """Not running: the message, or with --json one line of JSON saying so."""
        print(json.dumps({**about, "state": state, "state_text": message}) if args.json
              else f"shmserve: {message}", flush=True)

    if supervisord_pid(cfg) is None:
        if message := unsupervised(cfg):
            # where they serve: the config they were started with, not this shell's (its
            # default port was named beside the message's right one, an outside check)
            about["url"] = remote.base_url(processes.as_started(cfg))
            say("unsupervised", message)
            return 1
        say("not_running", processes.not_running(cfg))
        return 3
    from shmserve.apply import APPLY_STATES, apply_state

    if (applying := apply_state(cfg)) is not None:
        about["apply"] = applying
        if not args.json:
            print(f"shmserve: warning: {APPLY_STATES[applying]}", file=sys.stderr, flush=True)
    from shmserve import versions

    # Once, not every refresh: a worker that does not answer costs the timeout.
    if change := versions.protocol_change(cfg, timeout=0.5):  # an upgrade half taken
        about["protocol_change"] = change
        if not args.json:
            print(f"shmserve: warning: {change}", file=sys.stderr, flush=True)
    keys = keys_file_warnings(cfg)  # (said on stderr already where the config did not load)
    if warnings := keys + nginx_file_warnings(cfg):  # once, as the protocol's
        about["warnings"] = warnings
        if not args.json:
            for warning in warnings[len(keys) if getattr(args, "unloadable", False) else 0:]:
                print(f"shmserve: warning: {warning}", file=sys.stderr, flush=True)
    title = f"shmserve {__version__} at {remote.where(cfg)} (run_dir {cfg.run_dir})"

    silent = False  # nginx did not answer the last sample
    context = tls.client_context(cfg)  # once: the certificate file was read at every request

    def take() -> statusview.Sample:
        nonlocal silent
        if supervisord_pid(cfg) is None:  # stopped while watched (`down` in another shell)
            raise _Stopped
        # Longer than nginx takes to move a scrape off a frozen frontend (twice
        # nginx.probe_timeout_s: /ready's wait alone was, and a status read nginx's /metrics as
        # not answering, then waited on the frozen frontend's socket: ~10 s, an outside
        # check), so one frozen frontend is not reported as nginx not answering; after a sample
        # nginx did not answer in that time, short (every sample, a rate's two included, cost
        # the whole wait with nginx stuck: ~18 s for one status, an outside check), still long
        # enough to see it answer again.
        wait = render.metrics_timeout_s(cfg.nginx) + 2.0
        sample = statusview.take(
            remote.base_url(cfg), lambda url: remote.http(url, timeout=0.5 if silent else wait,
                                                          context=context),
            lambda: process_info(cfg), lambda: supervisord_pid(cfg),
            lambda target: from_a_frontend(cfg, target, wait),
            lambda procs: restart_record.stopped_by_restart(cfg, procs))
        silent = sample.ready_code is None
        # each frame's own: a watch started during an apply said "running" to its end, and
        # one started before never said it (an outside check)
        if (now := apply_state(cfg)) is None:
            about.pop("apply", None)
        else:
            about["apply"] = now
        return sample

    try:
        last = statusview.run(take, title, sys.stdout, args.watch, args.count,
                              as_json=args.json, about=about)
    except _Stopped:
        say("not_running", processes.not_running(cfg))
        return 3
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `shmserve status | head`: the reader left; leave quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    running = all(p["statename"] == "RUNNING" for p in last.processes)
    return 0 if running and last.ready_code == 200 and last.ready.get("status") == "ready" else 1


def from_a_frontend(cfg: Config, target: str, timeout: float) -> tuple[int | None, bytes]:
    """GET `target` from the first frontend that answers it on its socket (not through nginx)."""
    for index in range(cfg.frontends.count):
        code, body = remote.get_unix(str(topology.frontend_socket(cfg, index)), target, timeout)
        if code == 200:
            return code, body
    return None, b""


def unsupervised(cfg: Config) -> str | None:
    """With supervisord not running: what it left running, if anything (`status`, `ctl`)."""
    left = leftovers(cfg)
    if not left:
        return None
    served = processes.as_started(cfg).server  # where they were started, not this shell's
    return (f"supervisord is not running (run_dir {cfg.run_dir}; killed?), but processes it "
            f"started live on, unsupervised and maybe still serving on {served.host}:"
            f"{served.port}: pids {', '.join(map(str, left))}; `shmserve down` stops them, "
            "`shmserve up` replaces them")


def leftovers(cfg: Config) -> list[int]:
    """Processes a dead supervisord left running: its programs (processes.orphans) and nginx,
    found by its config (what `up` and `down` kill)."""
    nginx = nginxrun.find(render.nginx_conf(cfg)) if render.nginx_conf(cfg).exists() else []
    return sorted(set(processes.orphans(cfg)) | set(nginx))
