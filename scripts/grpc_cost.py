#!/usr/bin/env python3
"""What a call costs the server over gRPC against HTTP: the CPU time the frontends and nginx
spend a call (from /proc, so the load generator's own CPU and the machine's drift in speed do
not enter it), and the calls a second, for Triton's two clients against one stack.

One stack of the config (--env, default dev; gRPC on a free port) serves both; each round runs
the same calls over HTTP (tritonclient.http, binary tensors) and then over gRPC
(tritonclient.grpc), from --clients threads, each call --texts corpus sentences. Printed: each
round's figures and the median of the gRPC/HTTP ratios with their range.

  .venv/bin/python scripts/grpc_cost.py                     # 1 text a call, 4 rounds
  .venv/bin/python scripts/grpc_cost.py --texts 32 --calls 800
  .venv/bin/python scripts/grpc_cost.py --rev a15a9b6       # another revision's code (a
                                                            # worktree): run it and this one
                                                            # in turn to compare the two
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import CORPUS, positive, spread  # noqa: E402
from benchmachine import cpu_description  # noqa: E402
from benchstacks import (OwnStack, check_ports, checkout, require, revision,  # noqa: E402
                         run_main, stop_on_term)


def server_processes(stack: OwnStack) -> dict[str, list]:
    """The stack's frontends and nginx (its workers too), by kind."""
    import psutil

    found: dict[str, list] = {"frontends": [], "nginx": []}
    run_dir = str(Path(stack.tmp.name) / "run")
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or ())
        if run_dir not in command:
            continue
        if "-m frontend" in command:
            found["frontends"].append(proc)
        elif "nginx" in command:
            found["nginx"] += [proc, *proc.children(recursive=True)]
    return found


def cpu_seconds(processes: list) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def run(kind: str, port: int, texts: list[bytes], calls: int, clients: int,
        processes: dict[str, list]) -> dict[str, float]:
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    module = triton_grpc if kind == "grpc" else triton_http
    each = calls // clients
    failed: list[str] = []
    stop = threading.Event()  # set by an interrupt: the clients end, then the stack stops

    def work() -> None:
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            tensor = module.InferInput("text", [len(texts)], "BYTES")
            data = np.array(texts, dtype=object)
            if kind == "grpc":
                tensor.set_data_from_numpy(data)
            else:
                tensor.set_data_from_numpy(data, binary_data=True)
            for _ in range(each):
                if stop.is_set():
                    break
                try:
                    client.infer("all-MiniLM-L6-v2", [tensor])
                except Exception as exc:  # counted and shown: a failed call is no measurement
                    failed.append(str(exc)[:200])
        finally:
            # closed here: left to interpreter exit, after a Ctrl-C, the HTTP client's
            # __del__ printed a gevent traceback a thread
            client.close()

    threads = [threading.Thread(target=work) for _ in range(clients)]
    before = {k: cpu_seconds(v) for k, v in processes.items()}
    started = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C: the clients stop calling before the stack goes down
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(10)
        raise
    elapsed = time.perf_counter() - started
    if failed:
        raise SystemExit(f"grpc_cost: {len(failed)} {kind} calls failed, first: {failed[0]}")
    done = each * clients
    out = {f"{k}_ms": (cpu_seconds(v) - before[k]) / done * 1000 for k, v in processes.items()}
    out["server_ms"] = out["frontends_ms"] + out["nginx_ms"]
    out["calls_s"] = done / elapsed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="dev")
    parser.add_argument("--texts", type=positive, default=1, help="corpus texts a call")
    parser.add_argument("--calls", type=positive, default=2000, help="calls a side a round")
    parser.add_argument("--clients", type=positive, default=8)
    parser.add_argument("--rounds", type=positive, default=4)
    parser.add_argument("--rev", type=revision,
                        help="run the stack's code from this git revision (a worktree)")
    args = parser.parse_args()
    if args.calls < args.clients:  # no call a client: a ZeroDivisionError once the stack was up
        parser.error(f"--calls {args.calls}: at least --clients ({args.clients}), each client "
                     "makes calls / clients of them")
    require("tritonclient.grpc", "tritonclient.http", "psutil")
    stop_on_term()
    check_ports(2)
    from tests.stack import free_port

    sentences = json.loads(CORPUS.read_text())
    texts = [s.encode() for s in sentences[:args.texts]]
    grpc_port = free_port()
    with checkout(args.rev) as repo, \
            OwnStack(args.env, None, {"server": {"grpc_port": grpc_port}}, repo) as stack:
        processes = server_processes(stack)
        ports = {"http": stack.port, "grpc": grpc_port}
        for kind in ports:  # warm both paths
            run(kind, ports[kind], texts, args.clients * 10, args.clients, processes)
        ratios = []
        print(f"# {cpu_description()}; {args.texts} text(s) a call, {args.clients} clients, "
              f"{args.calls} calls a side a round; code of {args.rev or 'this checkout'}")
        print("| round | HTTP server CPU ms/call | gRPC server CPU ms/call | HTTP calls/s "
              "| gRPC calls/s |")
        print("|---|---|---|---|---|")
        for index in range(args.rounds):
            http = run("http", ports["http"], texts, args.calls, args.clients, processes)
            grpc = run("grpc", ports["grpc"], texts, args.calls, args.clients, processes)
            ratios.append(grpc["server_ms"] / http["server_ms"])
            print(f"| {index} | {http['server_ms']:.3f} (nginx {http['nginx_ms']:.3f}) | "
                  f"{grpc['server_ms']:.3f} (nginx {grpc['nginx_ms']:.3f}) | "
                  f"{http['calls_s']:.0f} | {grpc['calls_s']:.0f} |", flush=True)
        print(f"gRPC/HTTP server CPU a call: median {spread(ratios)}")
    return 0


if __name__ == "__main__":
    run_main(main)
