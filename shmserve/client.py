"""A small client of shmserve's native API: texts in, numpy arrays out.

    from shmserve.client import Client
    with Client("http://127.0.0.1:8080") as client:
        matrix = client.embed(["a text", "another"])   # float32 [2, dim]
        vector = client.embed("one text")              # float32 [dim]
        query = client.embed("what is it?", prompt_name="query")   # a model's prompt
        probs, labels = client.classify(["great!", "awful"])     # float32 [2, labels], names
        scores = client.rerank("a query", ["doc one", "doc two"])  # float32 [2], input order
        sparse = client.embed_sparse("a text")   # a sparse model's SPLADE vector:
        sparse.indices, sparse.values            # int64 and float32 [non-zeros]

    async with AsyncClient("http://127.0.0.1:8080") as client:
        matrix = await client.embed(["a text", "another"])

msgpack by default: vectors travel as raw little-endian float32 bytes, read without parsing a
number; ``format="json"`` sends and reads JSON. ``timeout`` (seconds) is sent as
``X-Request-Timeout``, the server's deadline for the request, and the client waits
``ANSWER_MARGIN_S`` longer for the answer, so a deadline that passes comes back as the server's
504. ``api_key`` (default: the ``SHMSERVE_API_KEY`` environment variable) is sent as a bearer
token, for a server with ``auth.api_keys``. An ``https://`` URL (a server with
``nginx.tls_certificate``) is checked against the system's CAs, or ``verify="ca.pem"`` (a
file of the CA, or of a self-signed server's own certificate); ``verify=False`` checks nothing.
``cert`` is the client certificate a server with ``nginx.tls_client_ca`` asks for (mutual
TLS), as requests takes it: a PEM file holding the certificate and its key, or a (certificate,
key) pair of files.

`Client` uses only the standard library: one keep-alive connection (``http.client``), so one
thread per client; a connection the server closed while idle is reopened once (`AsyncClient`
retries once too). `AsyncClient` uses aiohttp, imported when the first one is made: this
package never imports aiohttp (nor torch) at import time, and sync users need not install it.
Every failure raises `ShmserveError`: ``status`` and ``body`` are the server's, or None when no
answer came. A 429, 502 or 503 (overloaded, no frontend or worker yet) is sent again up to
``max_retries`` times (default 2; 0: never), each after the answer's ``Retry-After`` (at most
``MAX_RETRY_WAIT_S``); the last one's is the error's ``retry_after``, in seconds.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import time
import urllib.parse
from typing import Any, Sequence

import msgpack
import numpy as np

from shmserve.answers import (MAX_RETRY_WAIT_S, Answer, ShmserveError,  # noqa: F401
                              SparseVector, _classes, _decode, _matrix, _scores, _sparse,
                              _token_rows, _wait_s)
from shmserve.protocol import priority_level

FORMATS = {"msgpack": "application/msgpack", "json": "application/json"}
RETRY_STATUSES = (429, 502, 503)  # refused before any work: sending it again is safe


# How much longer than the request's deadline the client waits: the server answers 504 at the
# deadline, and that answer (which says so) should arrive before the client gives up.
ANSWER_MARGIN_S = 5.0


class _Base:
    def __init__(self, url: str = "http://127.0.0.1:8080", *, timeout: float = 30.0,
                 format: str = "msgpack", model: str | None = None,
                 api_key: str | None = None, priority: str | int | None = None,
                 max_retries: int = 2, verify: bool | str = True,
                 cert: str | tuple[str, str] | None = None) -> None:
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, not {max_retries!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
        if not timeout > 0:
            raise ValueError("timeout must be > 0 seconds")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port][/prefix], not {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.format = format
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("SHMSERVE_API_KEY")
        if priority is not None and priority_level(priority) is None:
            raise ValueError("priority must be low, normal, high or an integer from -10 to 10, "
                             f"not {priority!r}")
        self.priority = priority  # X-Priority on every request; None: the server's default
        self.max_retries = max_retries
        self._parts = parts
        self._ssl = _ssl_context(verify, cert) if parts.scheme == "https" else None

    def _embed_request(self, texts: str | Sequence[str], model: str | None,
                       request_id: str | None, prompt_name: str | None = None
                       ) -> tuple[bytes, dict[str, str]]:
        body: dict[str, Any] = {"texts": [texts] if isinstance(texts, str) else list(texts)}
        if prompt_name is not None:
            body["prompt_name"] = prompt_name
        return self._request(body, model, request_id)

    def _tokens_request(self, texts: str | Sequence[str], model: str | None,
                        request_id: str | None, prompt_name: str | None
                        ) -> tuple[bytes, dict[str, str]]:
        body: dict[str, Any] = {"inputs": [texts] if isinstance(texts, str) else list(texts)}
        if prompt_name is not None:
            body["prompt_name"] = prompt_name
        return self._request(body, model, request_id)

    def _classify_request(self, texts: Sequence[str], model: str | None,
                          request_id: str | None) -> tuple[bytes, dict[str, str]]:
        return self._request({"input": [texts] if isinstance(texts, str) else list(texts)},
                             model, request_id)

    def _rerank_request(self, query: str, documents: Sequence[str], model: str | None,
                        request_id: str | None) -> tuple[bytes, dict[str, str]]:
        if isinstance(documents, (str, bytes)):  # else each character would be a document
            raise TypeError("documents must be a sequence of strings, not one string")
        return self._request({"query": query, "documents": list(documents)}, model, request_id)

    def _request(self, body: dict[str, Any], model: str | None,
                 request_id: str | None) -> tuple[bytes, dict[str, str]]:
        if model or self.model:
            body["model"] = model or self.model
        return self._encode(body), self._headers(request_id, with_body=True)

    def _encode(self, body: dict[str, Any]) -> bytes:
        if self.format == "msgpack":
            return msgpack.packb(body, use_bin_type=True)
        return json.dumps(body, separators=(",", ":")).encode()

    def _headers(self, request_id: str | None, with_body: bool = False) -> dict[str, str]:
        headers = {"Accept": FORMATS[self.format]}
        if with_body:
            headers["Content-Type"] = FORMATS[self.format]
        if self.timeout <= 3600:
            headers["X-Request-Timeout"] = f"{self.timeout:g}"
        if request_id:
            headers["X-Request-ID"] = request_id
        if self.priority is not None:
            headers["X-Priority"] = str(self.priority)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


class Client(_Base):
    """Blocking client; not thread-safe (one connection). Use as a context manager or close().

    Keyword options (both clients): ``timeout`` (seconds, default 30), ``format`` (msgpack or
    json), ``model`` (the default model of every call), ``api_key`` (a bearer token; default
    the ``SHMSERVE_API_KEY`` environment variable), ``priority`` (low, normal, high or -10 to
    10: the X-Priority header), ``max_retries`` (429/502/503 sent again after Retry-After;
    default 2).
    """

    def __init__(self, url: str = "http://127.0.0.1:8080", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._conn: http.client.HTTPConnection | None = None
        self._used = False  # has the open connection answered a request already?

    def embed(self, texts: str | Sequence[str], *, model: str | None = None,
              request_id: str | None = None, prompt_name: str | None = None) -> np.ndarray:
        """float32 [n, dim] for a list of texts, [dim] for one string. `prompt_name`: one of
        the model's prompts (None: its default prompt, if any)."""
        body, headers = self._embed_request(texts, model, request_id, prompt_name)
        return _matrix(_decode(*self._call("POST", "/predict", body, headers)),
                       isinstance(texts, str))

    def embed_tokens(self, texts: str | Sequence[str], *, model: str | None = None,
                     request_id: str | None = None, prompt_name: str | None = None
                     ) -> list[np.ndarray] | np.ndarray:
        """Every token's last hidden state (TEI's /embed_all; special tokens included, not
        pooled or normalised): a float32 [tokens, dim] array per text, one array for one
        string."""
        body, headers = self._tokens_request(texts, model, request_id, prompt_name)
        return _token_rows(_decode(*self._call("POST", "/embed_all", body, headers)),
                           isinstance(texts, str))

    def embed_sparse(self, texts: str | Sequence[str], *, model: str | None = None,
                     request_id: str | None = None) -> list[SparseVector] | SparseVector:
        """A sparse model's SPLADE vector per text (TEI's /embed_sparse), one for one
        string."""
        body, headers = self._tokens_request(texts, model, request_id, None)
        return _sparse(_decode(*self._call("POST", "/embed_sparse", body, headers)),
                       isinstance(texts, str))

    def classify(self, texts: str | Sequence[str], *, model: str | None = None,
                 request_id: str | None = None) -> tuple[np.ndarray, list[str]]:
        """A classification model's probabilities, float32 [n, labels] ([labels] for one
        string), and the labels' names by column."""
        body, headers = self._classify_request(texts, model, request_id)
        return _classes(_decode(*self._call("POST", "/v1/classify", body, headers)),
                        isinstance(texts, str))

    def rerank(self, query: str, documents: Sequence[str], *, model: str | None = None,
               request_id: str | None = None) -> np.ndarray:
        """A rerank model's (cross-encoder's) score of each document for `query`, float32 [n],
        in the documents' order (np.argsort(-scores) ranks them)."""
        body, headers = self._rerank_request(query, documents, model, request_id)
        return _scores(_decode(*self._call("POST", "/v1/rerank", body, headers)),
                       len(documents))

    def models(self) -> list[str]:
        body = _decode(*self._call("GET", "/v1/models", None, self._headers(None)))
        return [m["id"] for m in body["data"]]

    def ready(self) -> bool:
        """Whether the server answers /ready with 200; False also while it cannot be reached
        (starting), so ``while not client.ready()`` waits for it."""
        try:
            status, _, _, _ = self._exchange("GET", "/ready", None, self._headers(None))
        except ShmserveError:
            return False
        return status == 200

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn, self._used = None, False

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            kind = (http.client.HTTPSConnection if self._parts.scheme == "https"
                    else http.client.HTTPConnection)
            self._conn = kind(self._parts.hostname, self._parts.port,
                              timeout=self.timeout + ANSWER_MARGIN_S,
                              **({"context": self._ssl} if self._ssl is not None else {}))
        return self._conn

    def _call(self, method: str, path: str, body: bytes | None,
              headers: dict[str, str]) -> Answer:
        for _ in range(self.max_retries):
            answer = self._exchange(method, path, body, headers)
            if answer[0] not in RETRY_STATUSES:
                return answer
            time.sleep(_wait_s(answer[3]))
        return self._exchange(method, path, body, headers)

    def _exchange(self, method: str, path: str, body: bytes | None,
                  headers: dict[str, str]) -> Answer:
        target = self._parts.path.rstrip("/") + path
        for _ in range(2):
            conn, reused = self._connection(), self._used
            try:
                conn.request(method, target, body=body, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError,
                    BrokenPipeError) as exc:
                self.close()
                if reused:  # the server closed it while idle; the request never ran
                    continue
                raise ShmserveError(f"{self.url}: connection lost: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, ...
                self.close()
                raise ShmserveError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
            self._used = True
            if response.will_close:
                self.close()
            return (response.status, response.getheader("Content-Type", ""), raw,
                    response.getheader("Retry-After"))
        raise ShmserveError(f"{self.url}: connection lost twice")


class AsyncClient(_Base):
    """asyncio client over one aiohttp session; use ``async with`` or ``await close()``.

    Keyword options: as ``Client``'s (``api_key``, ``timeout``, ``priority``, ...).
    """

    def __init__(self, url: str = "http://127.0.0.1:8080", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        import aiohttp  # here, not at module import: see the module docstring

        self._aiohttp = aiohttp
        self._session: aiohttp.ClientSession | None = None

    async def embed(self, texts: str | Sequence[str], *, model: str | None = None,
                    request_id: str | None = None, prompt_name: str | None = None
                    ) -> np.ndarray:
        """As Client.embed."""
        body, headers = self._embed_request(texts, model, request_id, prompt_name)
        return _matrix(_decode(*await self._call("POST", "/predict", body, headers)),
                       isinstance(texts, str))

    async def embed_tokens(self, texts: str | Sequence[str], *, model: str | None = None,
                           request_id: str | None = None, prompt_name: str | None = None
                           ) -> list[np.ndarray] | np.ndarray:
        """As Client.embed_tokens."""
        body, headers = self._tokens_request(texts, model, request_id, prompt_name)
        return _token_rows(_decode(*await self._call("POST", "/embed_all", body, headers)),
                           isinstance(texts, str))

    async def embed_sparse(self, texts: str | Sequence[str], *, model: str | None = None,
                           request_id: str | None = None
                           ) -> list[SparseVector] | SparseVector:
        """As Client.embed_sparse."""
        body, headers = self._tokens_request(texts, model, request_id, None)
        return _sparse(_decode(*await self._call("POST", "/embed_sparse", body, headers)),
                       isinstance(texts, str))

    async def classify(self, texts: str | Sequence[str], *, model: str | None = None,
                       request_id: str | None = None) -> tuple[np.ndarray, list[str]]:
        """As Client.classify."""
        body, headers = self._classify_request(texts, model, request_id)
        return _classes(_decode(*await self._call("POST", "/v1/classify", body, headers)),
                        isinstance(texts, str))

    async def rerank(self, query: str, documents: Sequence[str], *, model: str | None = None,
                     request_id: str | None = None) -> np.ndarray:
        """As Client.rerank."""
        body, headers = self._rerank_request(query, documents, model, request_id)
        return _scores(_decode(*await self._call("POST", "/v1/rerank", body, headers)),
                       len(documents))

    async def models(self) -> list[str]:
        body = _decode(*await self._call("GET", "/v1/models", None, self._headers(None)))
        return [m["id"] for m in body["data"]]

    async def ready(self) -> bool:
        """As Client.ready."""
        try:
            status, _, _, _ = await self._exchange("GET", "/ready", None, self._headers(None))
        except ShmserveError:
            return False
        return status == 200

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, body: bytes | None,
                    headers: dict[str, str]) -> Answer:
        for _ in range(self.max_retries):
            answer = await self._exchange(method, path, body, headers)
            if answer[0] not in RETRY_STATUSES:
                return answer
            await asyncio.sleep(_wait_s(answer[3]))
        return await self._exchange(method, path, body, headers)

    async def _exchange(self, method: str, path: str, body: bytes | None,
                        headers: dict[str, str]) -> Answer:
        aiohttp = self._aiohttp
        if self._session is None:  # made inside the running loop
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout + ANSWER_MARGIN_S))
        for attempt in range(2):
            try:
                async with self._session.request(
                        method, self.url + path, data=body, headers=headers,
                        ssl=self._ssl if self._ssl is not None else True) as response:
                    raw = await response.read()
                    return (response.status, response.headers.get("Content-Type", ""), raw,
                            response.headers.get("Retry-After"))
            except TimeoutError as exc:
                raise ShmserveError(f"{self.url}: no answer within {self.timeout}s") from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A kept-alive connection the server closed while idle: once more, on a new
                # one, as Client does (inference is idempotent). Not a refused connection.
                if attempt or isinstance(exc, aiohttp.ClientConnectorError):
                    raise ShmserveError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
            except aiohttp.ClientError as exc:
                raise ShmserveError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")


def _ssl_context(verify: bool | str, cert: str | tuple[str, str] | None = None
                 ) -> ssl.SSLContext:
    """What an https server's certificate is checked against: the system's CAs (True), a
    PEM file's (a CA, or a self-signed server's own certificate: trusted as it is), or nothing
    (False); and the client certificate presented, if any (`cert`)."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif verify is True:
        context = ssl.create_default_context()
    elif not isinstance(verify, str) or not os.path.isfile(verify):
        raise ValueError(f"verify must be True, False or a PEM file's path, not {verify!r}")
    else:
        context = ssl.create_default_context(cafile=verify)
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if cert is not None:
        if isinstance(cert, str):
            files: tuple[str, str | None] = (cert, None)
        elif isinstance(cert, (tuple, list)) and len(cert) == 2 and all(
                isinstance(f, str) for f in cert):
            files = (cert[0], cert[1])
        else:
            raise ValueError(f"cert must be a PEM file's path or a (certificate, key) pair, "
                             f"not {cert!r}")
        try:
            context.load_cert_chain(*files)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cert {cert!r}: cannot present it: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    return context
