"""Locust load profile for shmserve: real English sentences from the shared corpus.

Environment:
  SHMSERVE_BENCH_CORPUS   path to a JSON list of strings (default ../shared/bench/corpus.json)
  SHMSERVE_BENCH_TEXTS    texts per request (default 1), or "mixed": 1 to 16, at random
  SHMSERVE_BENCH_API      openai (JSON /v1/embeddings, float) | msgpack (/predict, msgpack) |
                          grpc (KServe v2's ModelInfer on server.grpc_port, tritonclient.grpc)
  SHMSERVE_BENCH_GRPC     host:port of the gRPC port, with SHMSERVE_BENCH_API=grpc (-H is not
                          read then: locust needs one, any URL)
  SHMSERVE_BENCH_MODEL    model name sent with each request (default: the server's default)
                          (grpc: all-MiniLM-L6-v2, KServe names its model)
  SHMSERVE_API_KEY        sent as `Authorization: Bearer` (a server with auth.api_keys set)

Run by scripts/bench.py; also usable directly:
  locust -f scripts/locustfile.py --headless -u 32 -r 32 -t 30s -H http://127.0.0.1:8080
  SHMSERVE_BENCH_API=grpc SHMSERVE_BENCH_GRPC=127.0.0.1:8001 locust -f scripts/locustfile.py \
      --headless -u 32 -r 32 -t 30s -H http://unused
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
from pathlib import Path

import msgpack
from locust import FastHttpUser, constant, events, task

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("SHMSERVE_BENCH_CORPUS", REPO.parent / "shared/bench/corpus.json"))
APIS = ("openai", "msgpack", "grpc")


def _settings() -> tuple[bool, int, str]:
    """SHMSERVE_BENCH_TEXTS and SHMSERVE_BENCH_API, refused in one line when wrong: a typo in
    the API ran the openai profile without a word, one in the texts raised a traceback (an
    outside check)."""
    texts = os.environ.get("SHMSERVE_BENCH_TEXTS", "1")
    api = os.environ.get("SHMSERVE_BENCH_API", "openai")
    if api not in APIS:
        raise SystemExit(f"SHMSERVE_BENCH_API={api!r}: one of {', '.join(APIS)}")
    if texts != "mixed" and not (texts.isascii() and texts.isdecimal() and int(texts) >= 1):
        raise SystemExit(f"SHMSERVE_BENCH_TEXTS={texts!r}: a count of texts per request "
                         "(1 or more), or mixed")
    return texts == "mixed", 16 if texts == "mixed" else int(texts), api


MIXED, TEXTS_PER_REQUEST, API = _settings()
MODEL = os.environ.get("SHMSERVE_BENCH_MODEL")
AUTH = ({"Authorization": f"Bearer {os.environ['SHMSERVE_API_KEY']}"}
        if os.environ.get("SHMSERVE_API_KEY") else {})

_corpus = json.loads(CORPUS.read_text())
_lock = threading.Lock()
_cursor = itertools.count()


_rng = random.Random(0)


def next_texts() -> list[str]:
    """Consecutive corpus texts, shared by all users, so the server sees the corpus in order."""
    with _lock:
        count = _rng.randint(1, TEXTS_PER_REQUEST) if MIXED else TEXTS_PER_REQUEST
        start = next(_cursor) * TEXTS_PER_REQUEST
    return [_corpus[(start + i) % len(_corpus)] for i in range(count)]


_texts_sent = [0, 0]  # texts, and the successful requests that carried them


@events.request.add_listener
def _count_texts(request_type, name, response_time, response_length, exception=None,
                 context=None, **kwargs) -> None:
    if exception is None and context:
        _texts_sent[0] += context.get("texts", 0)
        _texts_sent[1] += 1


_resets_at_spawn = [False]


@events.init.add_listener
def _on_init(environment, **kwargs) -> None:
    _resets_at_spawn[0] = bool(environment.reset_stats)


@events.reset_stats.add_listener  # the web UI's reset
def _reset_texts(**kwargs) -> None:
    _texts_sent[:] = [0, 0]


@events.spawning_complete.add_listener
def _reset_texts_when_spawned(user_count, **kwargs) -> None:
    # --reset-stats resets locust's own counts here, without firing reset_stats; the text
    # count must restart with them, or texts/s counts the ramp-up's texts over the window.
    if _resets_at_spawn[0]:
        _texts_sent[:] = [0, 0]


@events.quitting.add_listener
def _report_texts(environment, **kwargs) -> None:
    out = os.environ.get("SHMSERVE_BENCH_TEXTS_OUT")
    if out:
        # Texts per successful request, from both counts taken together: locust's CSV is
        # written on a timer and may miss the last second's requests. One file per process:
        # with --processes, each worker process counts its own users' texts.
        Path(f"{out}.{os.getpid()}").write_text(
            json.dumps({"texts": _texts_sent[0], "requests": _texts_sent[1]}))


class EmbeddingUser(FastHttpUser):
    # A closed loop: each user sends its next request at once. (The open loop, Poisson
    # arrivals at a rate, is benchkit.open_loop_window: locust's users pace, they do not arrive.)
    wait_time = constant(0)
    abstract = API == "grpc"  # GrpcEmbeddingUser (below) runs instead

    def on_start(self) -> None:
        # Every status is an answer the task judges itself (below: anything but 200 is a
        # failure). geventhttpclient would raise on an error status instead, and to describe
        # it decode the body as UTF-8: a msgpack error body raised UnicodeDecodeError, and the
        # request was counted neither as a request nor as a failure.
        self.client.client.valid_response_codes = frozenset(range(100, 600))

    @task
    def embed(self) -> None:
        texts = next_texts()
        if API == "msgpack":
            body = {"texts": texts} | ({"model": MODEL} if MODEL else {})
            with self.client.post("/predict", data=msgpack.packb(body), name="predict",
                                  headers={"Content-Type": "application/msgpack",
                                           "Accept": "application/msgpack", **AUTH},
                                  catch_response=True, context={"texts": len(texts)}) as resp:
                if resp.status_code != 200:
                    resp.failure(f"status {resp.status_code}")
        else:
            body = {"input": texts, "encoding_format": "float"} | (
                {"model": MODEL} if MODEL else {})
            with self.client.post("/v1/embeddings", json=body, name="embeddings", headers=AUTH,
                                  catch_response=True, context={"texts": len(texts)}) as resp:
                if resp.status_code != 200:
                    resp.failure(f"status {resp.status_code}")


if API == "grpc":
    import time

    import gevent
    import numpy as np
    import tritonclient.grpc as triton_grpc
    from locust import User
    from tritonclient.utils import InferenceServerException

    # grpcio's blocking calls run on gevent's pool of real threads, one a user at most (grpcio's
    # own gevent mode, grpc.experimental.gevent, hung under locust), so the users' calls overlap.
    gevent.get_hub().threadpool.maxsize = 1024

    class GrpcEmbeddingUser(User):
        """KServe v2's ModelInfer over gRPC, one call a task, as EmbeddingUser's requests."""

        wait_time = constant(0)

        def on_start(self) -> None:
            self.grpc = triton_grpc.InferenceServerClient(os.environ["SHMSERVE_BENCH_GRPC"])
            self.headers = {k.lower(): v for k, v in AUTH.items()}

        def _infer(self, tensors: list) -> Exception | None:
            """One call, in a thread of gevent's pool: its error returned, not raised (the pool
            prints the traceback of every exception raised in it: 7 MB of stderr in 5 s against
            a closed port, an outside check), with its status and message in its text (locust
            shows an exception by its repr)."""
            try:
                self.grpc.infer(MODEL or "all-MiniLM-L6-v2", tensors, headers=self.headers)
            except InferenceServerException as exc:
                return RuntimeError(f"{exc.status()}: {exc.message()}")
            return None

        @task
        def embed(self) -> None:
            texts = next_texts()
            tensor = triton_grpc.InferInput("text", [len(texts)], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
            started = time.perf_counter()
            error = gevent.get_hub().threadpool.apply(self._infer, ([tensor],))
            self.environment.events.request.fire(
                request_type="grpc", name="ModelInfer", exception=error,
                response_time=(time.perf_counter() - started) * 1000, response_length=0,
                context={"texts": len(texts)})
