"""Bearer-token checks: the API keys (auth.api_keys, auth.api_keys_file) every inference route
needs where any is configured, and the admin token (frontend.admin), both looked up by digest."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

from aiohttp import web

from frontend import metrics
from frontend.errors import ApiError
from shmserve.apikeys import api_keys, api_keys_file
from shmserve.config import Config
from shmserve.typedtree import ConfigError

log = logging.getLogger("shmserve.frontend")

# How often a frontend looks at auth.api_keys_file (one stat, at a request's check), and how
# long a file modified since must stay so before it is read (ApiKeys).
KEYS_LOOK_S = 1.0
KEYS_SETTLE_S = 1.0


def key_digests(keys: Iterable[str]) -> frozenset[bytes]:
    """What bearer_matches looks a token up in: each key's SHA-256 digest."""
    return frozenset(hashlib.sha256(key.encode()).digest() for key in keys)


class ApiKeys:
    """The inference routes' keys as digests (key_digests), auth.api_keys_file read again
    when it changed (its inode, size or modification time, looked at every KEYS_LOOK_S at
    most, as a request is checked): a rotated secret takes effect within a second or two,
    without restarting the frontends (it needed `shmserve restart frontends`, and `apply` said
    "nothing to apply" with the old keys in force: an outside check). A file modified in the
    last KEYS_SETTLE_S is taken only once a later look finds it unchanged: one written in
    place was read half-written, the head of a key taken as a key and the keys after it
    refused (an outside check). A file that does not load (empty, a malformed key,
    unreadable) leaves the keys in force and is logged (frontend.api_keys_file_refused), never
    an open server."""

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, frontend: int = 0) -> None:
        self._cfg, self._clock, self._wall = cfg, clock, wall
        # 1 while the file on disk does not load: an alert's (ShmserveApiKeysFileRefused),
        # where only `status` said so; the series at 0 from the start
        self._gauge = metrics.KEYS_FILE_REFUSED.labels(str(frontend))
        self._gauge.set(0)
        self._refused = False
        self._file = api_keys_file(cfg)
        self._stamp = _stamp(self._file)  # before the read: a change during it is read again
        self._seen = self._stamp  # at the last look
        self.digests = key_digests(api_keys(cfg))  # a file that does not load stops start-up
        self._next = clock() + KEYS_LOOK_S

    def current(self) -> frozenset[bytes]:
        if self._file is None or (now := self._clock()) < self._next:
            return self.digests
        self._next = now + KEYS_LOOK_S
        stamp = _stamp(self._file)
        if stamp != self._stamp and (stamp == self._seen or stamp is None or
                                     self._wall() - stamp[2] / 1e9 >= KEYS_SETTLE_S):
            self._read(stamp)
        self._seen = stamp
        return self.digests

    def _read(self, stamp: tuple[int, int, int] | None) -> None:
        # The stamp from before the read: a file written on while read (not renamed into
        # place) has another at the next look, which reads it whole.
        self._stamp = stamp
        try:
            keys = api_keys(self._cfg)
        except ConfigError as exc:  # said once a change
            log.error("frontend.api_keys_file_refused", extra={"fields": {
                "reason": str(exc), "kept_keys": len(self.digests)}})
            self._refused = True
            self._gauge.set(1)
            return
        digests = key_digests(keys)
        # said when the keys changed, or the file loads again (put back as it was: the
        # refusal stayed the last line, an outside check)
        if digests != self.digests or self._refused:
            log.info("frontend.api_keys_reloaded", extra={"fields": {
                "keys": len(digests), "added": len(digests - self.digests),
                "removed": len(self.digests - digests)}})
        self._refused = False
        self._gauge.set(0)
        self.digests = digests


def _stamp(file: Path | None) -> tuple[int, int, int] | None:
    if file is None:
        return None
    try:
        st = os.stat(file)
    except OSError:  # gone (read, and refused, as such)
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def bearer_matches(request: web.Request, digests: frozenset[bytes]) -> bool:
    """Whether the request carries `Authorization: Bearer <a key>`: the token's SHA-256 digest
    looked up among the keys' (key_digests). The time taken shows neither which key matched
    nor how much of a key a guess shares (a digest shares nothing with its key), and does not
    grow with the keys: a constant-time comparison with every key took ~0.06 us a key a
    request, 0.6 ms of a frontend's CPU with 10,000 keys (an outside check). The API keys
    (auth.api_keys) and the admin token (frontend.admin) both check with it."""
    scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
    # A byte that is not UTF-8 reaches here as a lone surrogate (aiohttp's surrogateescape):
    # encoded back to the bytes sent, it simply matches no key (a plain encode raised, a 500
    # and a traceback for any client, a security review).
    # Spaces and tabs around it only, as nginx's rate limit reads a key (nginx.rate_limit_key
    # api_key): str.strip took Unicode spaces too, so one key spelled with U+00A0 around it was
    # one more client to nginx, each with the key's whole rate (an outside check).
    sent_bytes = sent.strip(" \t").encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hashlib.sha256(sent_bytes).digest() in digests


def bearer_refusal(request: web.Request, needs: str, wrong: str) -> str:
    """Why a request's bearer check failed, for its 401: `needs` when it sent no bearer token,
    `wrong` when it sent one that matched none (the same words for both told a client with a
    typo in its key to send the key it had sent: an outside check)."""
    header = request.headers.get("Authorization")
    if header is None:
        return f"{needs}; the request has no Authorization header"
    scheme, _, sent = header.partition(" ")
    if scheme.lower() != "bearer" or not sent.strip():
        return f"{needs}; the request's Authorization header is not 'Bearer <token>'"
    return wrong


def authenticate(request: web.Request, keys: tuple[bytes, ...]) -> None:
    if not bearer_matches(request, keys):
        raise ApiError("unauthorized", bearer_refusal(
            request, "this server needs 'Authorization: Bearer <API key>' (one of "
            "auth.api_keys or auth.api_keys_file)", "the bearer token sent is not one of this "
            "server's API keys (auth.api_keys, auth.api_keys_file)"),
            code="invalid_api_key")  # OpenAI's code for it (clients49: it was null)
