"""The value rules of every config key beyond its type (shmserve.config's dataclasses give
the types): key path -> (predicate, what is expected), for shmserve.typedtree.build; and the
rules of the models list as a whole (`check_models`)."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from shmserve.protocol import priority_level
from shmserve.typedtree import Check, ConfigError

# A browser's Origin header: scheme, host, optional port. Pasted into nginx.conf, so nothing
# else may pass.
_ORIGIN = re.compile(r"https?://([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(:[0-9]{1,5})?")

def _bytes(size: str) -> int:
    """nginx's size (digits, then k or m) in bytes."""
    unit = {"k": 1 << 10, "m": 1 << 20}.get(size[-1].lower(), 1)
    return int(size.rstrip("kKmM")) * unit


# Range checks beyond the types: key path -> (predicate, what is expected).
_POSITIVE_INT: Check = (lambda v: v >= 1, "an integer >= 1")
DAY_S = 86400
_SECONDS_A_DAY: Check = (lambda v: 1 <= v <= DAY_S, f"whole seconds from 1 to {DAY_S}")
# Every other duration is at most a day too: one is rendered (server.drain_timeout_s into
# supervisord's stopwaitsecs: 1.0e+12 passed as 1000000000005, an outside check) or waited on,
# where a timer past what the OS or asyncio takes fails at its first wait, not at `up`.
_UP_TO_A_DAY: Check = (lambda v: 0 <= v <= DAY_S, f"a number from 0 to {DAY_S}")
_NEVER_OR_UP_TO_A_DAY: Check = (lambda v: 0 <= v <= DAY_S,
                                f"a number from 0 (never) to {DAY_S}")
_OVER_0_UP_TO_A_DAY: Check = (lambda v: 0 < v <= DAY_S, f"a number over 0, up to {DAY_S}")
_TLS_FILE: Check = (lambda v: re.fullmatch(r'[^\x00-\x1f\x7f"\\$]*', v) is not None,
                    "a file path without control characters, double quotes, backslashes or $, "
                    "or empty (no TLS)")
MAX_CONNECTIONS = 1 << 20  # an nginx worker's, as Linux's default nr_open allows descriptors
CHECKS: dict[str, Check] = {
    "server.port": (lambda v: 1 <= v <= 65535, "a port from 1 to 65535"),
    "server.grpc_port": (lambda v: 0 <= v <= 65535, "a port from 1 to 65535, or 0 (no gRPC)"),
    "server.drain_timeout_s": _UP_TO_A_DAY,
    # Pasted into nginx.conf: nothing but a value may pass (no `;`, no second directive).
    "server.host": (lambda v: re.fullmatch(r"[A-Za-z0-9.-]{1,253}|[0-9A-Fa-f:.]{2,45}", v)
                    is not None, "an IPv4 or IPv6 address or a host name"),
    # Written into supervisord.conf (nginx's command line, quoted for a shell, not for ini)
    "nginx.binary": (lambda v: re.fullmatch(r"[^\x00-\x1f\x7f;#]+", v) is not None,
                     "a program name or path without control characters, ; or # (it is "
                     "written into supervisord.conf)"),
    "nginx.client_max_body_size": (lambda v: re.fullmatch(r"[0-9]{1,9}[kKmMgG]?", v)
                                   is not None, "a size such as 8m (digits, then k, m or g)"),
    # At least 1k: nginx takes 0 (and `nginx -t` passes it), then resets every connection
    # unanswered (an outside check); a count of 0 buffers it refuses only at `nginx -t`.
    # At most 1m: nginx allocates the first buffer for every connection as it opens, so 1500m
    # passed `nginx -t` and would take 1.5 GB a connection (an outside check).
    "nginx.client_header_buffer_size": (
        lambda v: re.fullmatch(r"[0-9]{1,9}[kKmM]?", v) is not None
        and 1024 <= _bytes(v) <= 1 << 20,
        "a size from 1k to 1m such as 4k (digits, then k or m)"),
    "nginx.large_client_header_buffers": (
        lambda v: re.fullmatch(r"[1-9][0-9]{0,3} [0-9]{1,9}[kKmM]?", v) is not None
        and 1024 <= _bytes(v.split()[1]) <= 1 << 20,
        "a count of at least 1 and a size from 1k to 1m (digits, then k or m), such as 4 16k"),
    # Bounded where nginx takes them: a billion worker_connections passed `nginx -t` (a
    # warning only), and then every nginx worker failed its allocation and served nothing (an
    # outside check); values past nginx's own limits were refused by `nginx -t` alone.
    "nginx.worker_connections": (lambda v: 1 <= v <= MAX_CONNECTIONS,
                                 f"an integer from 1 to {MAX_CONNECTIONS}"),
    "nginx.listen_backlog": (lambda v: 1 <= v <= 65535, "an integer from 1 to 65535"),
    "nginx.client_body_timeout_s": _SECONDS_A_DAY,
    "nginx.client_header_timeout_s": _SECONDS_A_DAY,
    "nginx.send_timeout_s": _SECONDS_A_DAY,
    "nginx.proxy_read_timeout_s": _SECONDS_A_DAY,
    "nginx.grpc_stream_idle_timeout_s": _SECONDS_A_DAY,
    "nginx.probe_timeout_s": _SECONDS_A_DAY,
    "nginx.rate_limit_per_s": (lambda v: v == 0 or 1 / 60 <= v <= 1_000_000,
                               "0 (off) or requests a second, at least 1/60 (one a minute)"),
    "nginx.rate_limit_burst": (lambda v: 0 <= v <= 1_000_000, "an integer >= 0"),
    "nginx.rate_limit_key": (lambda v: v in ("ip", "api_key", "certificate"),
                             "ip, api_key or certificate"),
    "nginx.max_requests_per_client": (lambda v: 0 <= v <= 1_000_000,
                                      "0 (off) or an integer from 1 to 1000000"),
    "nginx.upstream_keepalive": (lambda v: 1 <= v <= 65536, "an integer from 1 to 65536"),
    "nginx.worker_processes": (lambda v: v == "auto" or (isinstance(v, int) and 1 <= v <= 1024),
                               "auto or an integer from 1 to 1024"),
    "nginx.cors_allow_origins": (lambda v: v == ["*"] or all(_ORIGIN.fullmatch(o) for o in v),
                                 'empty, ["*"] alone, or origins such as '
                                 'https://app.example.com[:port] (no path)'),
    "nginx.gzip_level": (lambda v: 1 <= v <= 9, "an integer from 1 to 9"),
    # written into nginx.conf between double quotes, where $ starts a variable
    "nginx.tls_certificate": _TLS_FILE,
    "nginx.tls_key": _TLS_FILE,
    "nginx.tls_client_ca": _TLS_FILE,
    "nginx.tls_client_crl": _TLS_FILE,
    "nginx.tls_client_certificate": _TLS_FILE,
    "nginx.tls_client_key": _TLS_FILE,
    "nginx.gzip_min_bytes": (lambda v: 0 <= v <= 1 << 30, "an integer >= 0"),
    "frontends.count": (lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
    # nginx's worker_connections are made from it: a number past nginx's was named as theirs
    "frontends.max_inflight": (lambda v: 1 <= v <= 1_000_000, "an integer from 1 to 1000000"),
    "frontends.request_timeout_s": _OVER_0_UP_TO_A_DAY,
    "frontends.retry_on_worker_loss": (lambda v: v >= 0, "an integer >= 0"),
    "frontends.no_worker_wait_s": _UP_TO_A_DAY,
    "frontends.response_cache_mb": (lambda v: 0 <= v <= 1 << 20, "a number of MiB from 0 to "
                                    "1048576 (0: no cache)"),
    "frontends.spread_part_texts": (lambda v: v >= 0, "an integer >= 0 (0: never spread)"),
    "frontends.spread_quiet_s": _UP_TO_A_DAY,
    "frontends.bulk_texts": (lambda v: v >= 0, "an integer >= 0 (0: never)"),
    # a socket's listen(): past a C int it failed every frontend's start
    "frontends.listen_backlog": (lambda v: 1 <= v <= 65535, "an integer from 1 to 65535"),
    "frontends.default_priority": (lambda v: priority_level(v) is not None,
                                   "low, normal, high or an integer from -10 to 10"),
    "workers.low_priority_queue_share": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "workers.devices": (lambda v: v in ("auto", "cpu") or (isinstance(v, list) and v
                        and all(d >= 0 for d in v) and len(set(v)) == len(v)),
                        "auto, cpu or a list of distinct GPU indices (several workers on one "
                        "GPU: workers.per_gpu)"),
    # Written into supervisord.conf (a worker's environment=), which reads a newline as the
    # value's end ("supervisord did not start: No closing quotation" named no key), a double
    # quote as its quote's, a space then ; or # as a comment: PyTorch's option:value pairs'
    # characters only (an outside check)
    "workers.cuda_alloc_conf": (
        lambda v: re.fullmatch(r"[A-Za-z0-9_.:,+<>\[\] -]{0,512}", v) is not None,
        "PyTorch's option:value pairs, such as expandable_segments:True (letters, digits, "
        "spaces and _ . : , + - < > [ ]: it is written into supervisord.conf)"),
    "workers.cuda_graphs": (lambda v: 0 <= v <= 4096, "an integer from 0 to 4096"),
    "workers.reload_nice": (lambda v: 0 <= v <= 19, "an integer from 0 to 19"),
    "workers.per_gpu": (lambda v: 1 <= v <= 16, "an integer from 1 to 16"),
    "workers.cpu_workers": (lambda v: v == "auto" or (isinstance(v, int) and 1 <= v <= 64),
                            "auto or an integer from 1 to 64"),
    # written into the workers' OMP_NUM_THREADS: a count past any machine's cores only
    # oversubscribes them, and a huge one failed the workers' start, not the config's check
    "workers.torch_threads": (lambda v: v == "auto" or (isinstance(v, int) and 1 <= v <= 1024),
                              "auto or an integer from 1 to 1024"),
    # YAML reads a bare off as false
    "workers.cpu_affinity": (lambda v: v in ("auto", "off") or v is False, "auto or off"),
    "workers.queue_texts": _POSITIVE_INT,
    "workers.heartbeat_interval_s": _OVER_0_UP_TO_A_DAY,
    "workers.heartbeat_timeout_s": _OVER_0_UP_TO_A_DAY,
    "workers.hung_kill_s": _NEVER_OR_UP_TO_A_DAY,
    "workers.start_timeout_s": _NEVER_OR_UP_TO_A_DAY,
    "frontends.hung_kill_s": _NEVER_OR_UP_TO_A_DAY,
    "workers.stalled_pass_s": _NEVER_OR_UP_TO_A_DAY,
    "workers.ready_timeout_s": _OVER_0_UP_TO_A_DAY,
    "workers.memory_check_batches": _POSITIVE_INT,
    "workers.empty_cache_free_below": (lambda v: 0 <= v <= 1, "a number from 0 to 1 (0: never)"),
    "workers.empty_cache_idle_s": _NEVER_OR_UP_TO_A_DAY,
    "workers.switch_interval_ms": (lambda v: 0.01 <= v <= 100, "a number from 0.01 to 100"),
    "batching.max_batch_size": _POSITIVE_INT,
    "batching.max_batch_tokens": _POSITIVE_INT,
    "batching.max_wait_ms": (lambda v: v >= 0, "a number >= 0"),
    "batching.max_pad_ratio": (lambda v: v >= 1, "a number >= 1"),
    "batching.fair_share_every": _POSITIVE_INT,
    "batching.pass_window": (lambda v: v >= 0, "an integer >= 0 (0: the whole queue)"),
    "batching.top_up_ratio": (lambda v: v >= 0, "a number >= 0 (0: none)"),
    "logging.flush_interval_ms": (lambda v: 0 <= v <= 1000 * DAY_S,
                                  f"a number from 0 to {1000 * DAY_S} (a day)"),
    # rendered into supervisord.conf as each log's size
    "logging.max_bytes": (lambda v: 1024 <= v <= 1 << 40,
                          f"an integer from 1024 to {1 << 40} (bytes: 1 TiB)"),
    "logging.backups": (lambda v: 0 <= v <= 1000, "an integer from 0 to 1000"),
    "limits.max_texts_per_request": _POSITIVE_INT,
    "limits.max_text_chars": _POSITIVE_INT,
    "shm.arena_mb": (lambda v: 1 <= v <= 65536, "an integer from 1 to 65536"),
    "admin.reload_timeout_s": _OVER_0_UP_TO_A_DAY,
    "tracing.otlp_endpoint": (lambda v: v == "" or _otlp_url(v),
                              "empty, or the collector's OTLP/HTTP traces URL, path included: "
                              "http(s)://HOST[:PORT]/v1/traces"),
    "tracing.service_name": (lambda v: 1 <= len(v) <= 128, "1 to 128 characters"),
    "tracing.sample_ratio": (lambda v: 0 <= v <= 1, "a number from 0 to 1"),
}

def _otlp_url(value: str) -> bool:
    """A URL the exporter can post to: http(s), a host, a port in range, a path (it posts to
    the URL as given: a collector answers a base URL's / with 404). An outside check's
    `http:///v1/traces`, a port 99999 or `abc`, and `http://[::1/v1/traces` passed `up` with
    tracing dead (and the last made `shmserve config` fail with a traceback)."""
    if re.search(r"\s", value):
        return False
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError out of range or not a number
    except ValueError:
        return False
    return (parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
            and parts.path not in ("", "/"))


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # fullmatch: "$" lets a final newline by
# A model's name or alias: what requests send as `model`, and a label in logs and metrics.
MODEL_NAME_MAX = 256
_MODEL_NAME = re.compile(rf"[^\s\x00-\x1f\x7f]{{1,{MODEL_NAME_MAX}}}")
# A revision label goes into the X-Model-Revision header: visible ASCII, no spaces.
REVISION = re.compile(r"[\x21-\x7e]{1,128}")
REVISION_RULE = "1 to 128 visible ASCII characters (no spaces; it is sent as a header)"
# A/B weights are relative; bounded so that their sum stays a finite number.
MAX_WEIGHT = 1e9
_STICKY = re.compile(r"(user|header:[A-Za-z0-9-]{1,64})?")


def check_models(cfg: Any) -> None:
    """What the types cannot say of `cfg.models` (a shmserve.config.Config): names unique, a
    source or variants, sane A/B arms, labels that can be headers; ConfigError naming the key."""
    if not cfg.models:
        raise ConfigError("models: at least one model is required")
    seen: set[str] = set()
    for i, model in enumerate(cfg.models):
        key = f"models[{i}]"
        # each name by its own key (models[0] for an alias's fault was no help: an outside
        # check)
        named = ((f"{key}.name", model.name),
                 *((f"{key}.aliases[{j}]", alias) for j, alias in enumerate(model.aliases)))
        for where, name in named:
            if not _MODEL_NAME.fullmatch(name):
                raise ConfigError(f"{where}: model names and aliases are 1 to 256 characters "
                                  f"without spaces or control characters, got {name!r}")
            if name in seen:
                raise ConfigError(f"{where}: the name {name!r} is used twice")
            seen.add(name)
        for where, revision in ((f"{key}.revision", model.revision), *(
                (f"{key}.variants[{j}].revision", v.revision)
                for j, v in enumerate(model.variants))):
            if revision and not REVISION.fullmatch(revision):
                raise ConfigError(f"{where}: expected {REVISION_RULE}, got {revision!r}")
        if model.max_input_tokens < 0:
            raise ConfigError(f"{key}.max_input_tokens: expected an integer >= 0 (0: the "
                              f"model's own limit), got {model.max_input_tokens}")
        if model.task != "embedding" and (model.pooling, model.normalize) != ("auto", "auto"):
            raise ConfigError(f"{key}: pooling and normalize apply to embedding models, not "
                              f"task {model.task}")
        for where, name in named:
            if "@" in name:  # an alias "ab@a" took requests meant for model ab's variant a
                raise ConfigError(f"{where}: '@' is reserved (it joins a model and its "
                                  "variant)")
        if bool(model.source) == bool(model.variants):
            raise ConfigError(f"{key}: give either source or variants (an A/B split), not "
                              f"{'both' if model.source else 'neither'}")
        if model.variants and model.revision:
            raise ConfigError(f"{key}.revision: with variants, each variant has its revision")
        if len(set(model.devices)) != len(model.devices) or any(d < 0 for d in model.devices):
            raise ConfigError(f"{key}.devices: expected distinct indices >= 0, "
                              f"got {model.devices}")
        if not _STICKY.fullmatch(model.sticky_key):
            raise ConfigError(f"{key}.sticky_key: expected 'user' or 'header:NAME', "
                              f"got {model.sticky_key!r}")
        if model.sticky_key and not model.variants:
            raise ConfigError(f"{key}.sticky_key: only a model with variants is split")
        if not 0 < model.auto_min_cosine <= 1:
            raise ConfigError(f"{key}.auto_min_cosine: expected a number in (0, 1], "
                              f"got {model.auto_min_cosine}")
        if any(not name.strip() for name in model.prompts):
            # a request's prompt_name "" means no prompt: such a prompt could never be named
            raise ConfigError(f"{key}.prompts: a prompt's name must not be empty")
        if not model.default_prompt_name.strip():
            raise ConfigError(f"{key}.default_prompt_name: auto, none or a prompt's name, "
                              "got an empty string")
        names = [v.name for v in model.variants]
        for j, variant in enumerate(model.variants):
            if not _NAME.fullmatch(variant.name):
                raise ConfigError(f"{key}.variants[{j}].name: letters, digits and . _ - only, "
                                  f"got {variant.name!r}")
            if not 0 <= variant.weight <= MAX_WEIGHT:
                raise ConfigError(f"{key}.variants[{j}].weight: expected a number from 0 to "
                                  f"{MAX_WEIGHT:g}")
        if len(set(names)) != len(names):
            raise ConfigError(f"{key}.variants: names must differ, got {names}")
        labels = [v.revision for v in model.variants if v.revision]
        if len(set(labels)) != len(labels):
            # The arms' revision is what tells them apart in metrics and KServe's versions (the
            # second arm of two "same" could not be reached by version, an outside check).
            raise ConfigError(f"{key}.variants: revisions must differ, got {labels}")
        if model.variants and sum(v.weight for v in model.variants) <= 0:
            raise ConfigError(f"{key}.variants: the weights must not all be 0")


def check_relations(cfg: Any) -> None:
    """What no key can say alone: timeouts and capacities that must fit one another;
    ConfigError naming the key, every rule broken in one message (one at a time, a fix of the
    first met the second: an outside check's short nginx.proxy_read_timeout_s)."""
    errors: list[str] = []
    if 0 < cfg.frontends.hung_kill_s <= 2 * cfg.workers.heartbeat_interval_s:
        errors.append(f"frontends.hung_kill_s: {cfg.frontends.hung_kill_s:g} must be over "
                      "twice workers.heartbeat_interval_s "
                      f"({cfg.workers.heartbeat_interval_s:g}), how often a frontend pings "
                      "each worker; or 0 (never)")
    if 0 < cfg.workers.hung_kill_s <= cfg.workers.heartbeat_timeout_s:
        errors.append(f"workers.hung_kill_s: {cfg.workers.hung_kill_s:g} must be over "
                      f"workers.heartbeat_timeout_s ({cfg.workers.heartbeat_timeout_s:g}), "
                      "or 0 (never)")
    if cfg.workers.heartbeat_timeout_s <= cfg.workers.heartbeat_interval_s:
        errors.append(f"workers.heartbeat_timeout_s: {cfg.workers.heartbeat_timeout_s:g} "
                      "must be over workers.heartbeat_interval_s "
                      f"({cfg.workers.heartbeat_interval_s:g}), or every worker is taken "
                      "for dead between two heartbeats")
    if cfg.batching.max_wait_ms >= 1000 * cfg.frontends.request_timeout_s:
        errors.append(f"batching.max_wait_ms: {cfg.batching.max_wait_ms:g} must be under "
                      f"frontends.request_timeout_s ({cfg.frontends.request_timeout_s:g} s): "
                      "a lone request would wait for company past its deadline (504)")
    low_share = int(cfg.workers.queue_texts * cfg.workers.low_priority_queue_share)
    if low_share < cfg.limits.max_texts_per_request:
        # A request larger than a worker's whole queue would get a 429 (retry later) forever.
        low = "" if cfg.workers.queue_texts < cfg.limits.max_texts_per_request else (
            f" x workers.low_priority_queue_share ({cfg.workers.low_priority_queue_share:g}) = "
            f"{low_share}, what a low-priority request may queue,")
        errors.append(f"workers.queue_texts: {cfg.workers.queue_texts}{low} is under "
                      f"limits.max_texts_per_request ({cfg.limits.max_texts_per_request}): "
                      "a request that large could never be queued")
    if cfg.server.grpc_port == cfg.server.port:
        errors.append(f"server.grpc_port: {cfg.server.grpc_port} is server.port too; gRPC "
                      "needs a port of its own (or 0: no gRPC)")
    if bool(cfg.nginx.tls_certificate) != bool(cfg.nginx.tls_key):
        given, missing = (("nginx.tls_certificate", "nginx.tls_key") if cfg.nginx.tls_certificate
                          else ("nginx.tls_key", "nginx.tls_certificate"))
        errors.append(f"{missing}: TLS needs both files; {given} is set and {missing} "
                      "is not (or set neither: plain HTTP)")
    if cfg.nginx.tls_client_ca and not cfg.nginx.tls_certificate:
        errors.append("nginx.tls_client_ca: client certificates are asked for in the TLS "
                      "handshake; set nginx.tls_certificate and nginx.tls_key too (or "
                      "leave nginx.tls_client_ca empty)")
    if cfg.nginx.tls_client_crl and not cfg.nginx.tls_client_ca:
        errors.append("nginx.tls_client_crl: revokes client certificates, which only "
                      "nginx.tls_client_ca asks for; set it too (or leave both empty)")
    if bool(cfg.nginx.tls_client_certificate) != bool(cfg.nginx.tls_client_key):
        given, missing = (("nginx.tls_client_certificate", "nginx.tls_client_key")
                          if cfg.nginx.tls_client_certificate
                          else ("nginx.tls_client_key", "nginx.tls_client_certificate"))
        errors.append(f"{missing}: the CLI's client certificate needs both files; {given} "
                      f"is set and {missing} is not (or set neither)")
    for key, value in (("admin.reload_timeout_s", cfg.admin.reload_timeout_s),
                       ("frontends.request_timeout_s", cfg.frontends.request_timeout_s)):
        if value >= cfg.nginx.proxy_read_timeout_s:
            errors.append(f"{key}: {value:g} must be under nginx.proxy_read_timeout_s "
                          f"({cfg.nginx.proxy_read_timeout_s}), or nginx cuts the call "
                          "before its answer")
    if errors:
        raise ConfigError(ConfigError.AND.join(errors))
