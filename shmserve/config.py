"""Configuration, loaded once into a frozen typed object: its schema, its checks, and what is
derived from it (the CPU layout; the API keys: shmserve.apikeys).

The layers it is merged from (configs/base.yaml, configs/<env>.yaml, extra files, environment
variables) are `shmserve.layers`. The merged tree is validated into :class:`Config`; any bad
value raises :class:`ConfigError` naming the key. Unknown keys are errors too, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from shmserve import layers
from shmserve.apikeys import api_keys
from shmserve.checks import CHECKS, check_models, check_relations
from shmserve.cores import cpu_layout
from shmserve.layers import REPO_ROOT
from shmserve.protocol import priority_level
from shmserve.typedtree import ConfigError, build


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # KServe v2's gRPC service (and gRPC health checking) on this port of server.host, through
    # nginx to the frontends (frontend.grpc_api); 0: off.
    grpc_port: int = 0
    run_dir: str = "run"  # relative paths are taken from the repository root
    drain_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class NginxConfig:
    binary: str = "nginx"
    worker_processes: int | str = 1  # or auto: one per core, nginx's own rule
    worker_connections: int = 16384  # per process; nginx_options.worker_connections: at least
    # the frontends admit, twice, and a margin
    listen_backlog: int = 4096  # the public port's accept queue
    client_max_body_size: str = "8m"
    client_header_buffer_size: str = "4k"
    large_client_header_buffers: str = "4 16k"
    client_body_timeout_s: int = 30
    client_header_timeout_s: int = 15
    send_timeout_s: int = 60
    proxy_read_timeout_s: int = 120
    # A gRPC ModelStreamInfer stream may wait this long for the client's next request, or the
    # frontend's next answer, before nginx cuts it (client_body_timeout_s and proxy_read_timeout_s
    # cut one idle for 30 s: INTERNAL "RST_STREAM" to a client that kept its stream open).
    grpc_stream_idle_timeout_s: int = 3600
    # GET /health, /ready and KServe's health routes: a frontend that has not answered within
    # this goes to the next one (a frozen frontend must not fail every other probe).
    probe_timeout_s: int = 2
    # Per-client rate limit on every route but the probes, /metrics and /admin (nginx's
    # limit_req): past rate_limit_per_s requests a second, with bursts of rate_limit_burst more,
    # a client gets 429 from nginx at once. The client: its address (ip) or its API key
    # (api_key; requests without one by their address). 0: off. Under 1, a fraction (0.5: one
    # request every 2 s), kept to the nearest request a minute (nginx's r/m).
    rate_limit_per_s: float = 0
    rate_limit_burst: int = 0
    # The client of both limits (this and max_requests_per_client)
    rate_limit_key: str = "ip"
    # Per-client requests in flight at once, on the same routes (nginx's limit_conn; over
    # HTTP/2 each stream counts): past it a client gets 429 from nginx at once, so one client's
    # many slow requests cannot hold every frontend and worker slot. 0: off.
    max_requests_per_client: int = 0
    upstream_keepalive: int = 64
    admin_loopback_only: bool = True
    # Browser origins allowed to call the API (CORS, answered by nginx): ["*"] for any, or
    # origins such as "https://app.example.com"; empty: no CORS headers, preflights are 405.
    cors_allow_origins: list[str] = field(default_factory=list)
    # gzip JSON answers (vectors as JSON) of at least gzip_min_bytes for clients that ask
    # (Accept-Encoding): off by default, as it costs nginx CPU the model shares on a small
    # machine; worth it for clients across a slow network.
    gzip: bool = False
    gzip_level: int = 1
    gzip_min_bytes: int = 1024
    # TLS on server.port, nginx terminating it (shmserve.tls): the certificate (with its chain)
    # and its private key, PEM files; relative paths from the repository root. Empty: plain
    # HTTP. http2: HTTP/2 offered beside HTTP/1.1 (ALPN) on the TLS port.
    tls_certificate: str = ""
    tls_key: str = ""
    http2: bool = True
    # Client certificates (mutual TLS): the CAs whose certificates clients must present on
    # both ports (probes exempt); empty: none asked for. What shmserve's own calls through nginx
    # (the admin commands, status) present: tls_client_certificate and its key.
    tls_client_ca: str = ""
    tls_client_crl: str = ""  # revoked client certificates (PEM CRLs); read at each reload
    tls_client_certificate: str = ""
    tls_client_key: str = ""


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    count: int = 2
    max_inflight: int = 1024  # requests admitted per frontend before 429
    request_timeout_s: float = 30.0  # default deadline of a request
    retry_on_worker_loss: int = 2  # resubmissions to another worker when one dies
    # How long a request waits for a live worker before 503: under httpx's default timeout
    # (5 s), whose users met a ReadTimeout where the 503 would have said why (an outside
    # check).
    no_worker_wait_s: float = 4.0
    # X-Priority / "priority" when a request names none: low, normal, high (-1, 0, 1), in any
    # case as the header takes them (a choice of lower-case names refused HIGH: an outside
    # check), or an integer from -10 to 10; higher runs first. Checked by the rule of
    # frontends.default_priority (shmserve.checks), and made its level by from_tree.
    default_priority: int | str = 0
    # A request of at least this many texts that names no priority runs a step below
    # default_priority: a query (fewer texts) goes before a bulk request's texts; 0: never
    bulk_texts: int = 16
    listen_backlog: int = 4096  # unix-socket accept queue; a full one makes nginx answer 502
    # A frontend whose pings every worker stopped hearing this long (its whole process stuck)
    # is SIGKILLed by the workers, and supervisord restarts it (shmserve.hung). 0: never.
    hung_kill_s: float = 30.0
    # Each frontend's response cache (frontend.respcache), MiB; 0: none. A request whose every
    # input it answered before, with the same weights, is answered without a worker.
    response_cache_mb: float = 0.0
    # A request of at least twice this many texts is cut into parts of as many tokens, at
    # least this many texts each, one for each ready worker of its model with nothing queued,
    # run at once (frontend.dispatch.Dispatcher.run); 0: never. Only while no request of fewer
    # texts came to any frontend for spread_quiet_s: interactive traffic keeps a worker free.
    spread_part_texts: int = 16
    spread_quiet_s: float = 2.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    devices: str | list[int] = "auto"  # auto | cpu | [0, 1, 3]
    # Worker processes per GPU (Triton's instance count): where the host's work per pass bounds
    # a worker, a second one on the same GPU launches while the first copies and replies.
    per_gpu: int = 1
    # CPU workers when no GPU is used, and intra-op threads per CPU worker. auto (both):
    # one worker per usable core up to 8, the cores shared out as threads (`cpu_layout`).
    cpu_workers: int | str = "auto"
    torch_threads: int | str = "auto"
    # auto: where the CPU workers' threads fill exactly the cores this process may use, each
    # worker is pinned to its own (shmserve.cores.worker_cores); off: the scheduler places them
    cpu_affinity: str | bool = "auto"  # off (YAML's bare off: false)
    queue_texts: int = 4096  # bounded queue per worker, in texts
    low_priority_queue_share: float = 0.75  # below-normal priority may fill this share of it
    # Refuse at once (429) a request the worker cannot finish before its deadline at its recent
    # speed, instead of queueing it to answer 504 later (shmserve.admission)
    refuse_past_deadline: bool = True
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    # A worker silent this long (its whole process stuck: heartbeats come from its socket
    # thread) is SIGKILLed by a frontend, so supervisord restarts it (frontend.watchdog); 0: never
    hung_kill_s: float = 30.0
    # A worker whose sockets are not bound this long after its process started (stuck in its
    # imports, or in the device's initialisation, before any heartbeat: no frontend knows its
    # pid to kill it) exits with every thread's traceback (faulthandler), and supervisord
    # starts it again; 0: never
    start_timeout_s: float = 120.0
    # A forward pass running longer than this is reported as stalled (GET /ready, logs); the
    # worker is not killed for it (frontend.watchdog says why); 0: never
    stalled_pass_s: float = 60.0
    cuda_alloc_conf: str = "expandable_segments:True"
    # cuDNN's attention kernels on a GPU: off, as every new (texts, length) shape costs a plan
    # (see gpu_workers.device.configure_cuda)
    cudnn_attention: bool = False
    # A worker given a GPU that CUDA cannot see serves on the CPU (with a warning) instead of
    # refusing to start: for trying a GPU config on a machine without one, and the tests
    cpu_fallback: bool = False
    # CUDA graph shapes a GPU worker records per model (gpu_workers.graphs); 0: no graphs
    cuda_graphs: int = 0
    # How long a worker's model thread may hold the GIL while its socket thread waits, and
    # back (sys.setswitchinterval; Python's default is 5 ms; docs/performance.md)
    switch_interval_ms: float = 0.5
    # A hot reload's loader thread runs this much nicer than the model thread that serves
    # meanwhile (0: as nice; docs/models.md, "Hot reload")
    reload_nice: int = 10
    ready_timeout_s: float = 300.0
    memory_check_batches: int = 100  # device memory is read every N batches (and when idle)
    # torch.cuda.empty_cache() only when it helps (gpu_workers.memory): the device's free share
    # under this at a check, or no pass for this long (0: never)
    empty_cache_free_below: float = 0.05
    empty_cache_idle_s: float = 30.0


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_size: int = 32  # texts per forward
    max_batch_tokens: int = 2048  # padded tokens per forward (batch size x longest)
    max_wait_ms: float = 2.0  # how long the oldest text may wait for company
    max_pad_ratio: float = 1.5  # padded / real tokens a batch may reach (length grouping)
    fair_share_every: int = 4  # a batch after N - 1 that went before an older text starts
    # from the oldest text, any priority (gpu_workers.batcher.FairTurns)
    pass_window: int = 8  # a pass chooses among the oldest N x max_batch_size texts; 0: all
    # A pass run for higher-priority texts takes lower ones up to this many times its higher
    # ones' padded tokens (gpu_workers.batcher.form_pass): their pass stays short
    top_up_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_texts_per_request: int = 2048  # OpenAI's limit of inputs a request
    max_text_chars: int = 100_000
    truncate: bool = True  # False: over-long texts are refused with 413


@dataclass(frozen=True, slots=True)
class VariantConfig:
    """One arm of an A/B split: its own weights, served under the model's name."""

    name: str  # stable id of the arm ("a", "canary"): reloads and weights name it
    source: str
    revision: str = ""  # empty: a digest of the weights
    weight: float = 1.0  # relative share of the model's requests


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    # A directory, or "package:NAME" for a Python package that ships one. Required unless the
    # model has variants, each with its own source.
    source: str = ""
    aliases: list[str] = field(default_factory=list)
    # sparse: SPLADE vectors from a masked-language-model checkpoint (TEI's /embed_sparse).
    # null: correctly shaped zeros without computing, to measure the serving pipeline alone
    task: Literal["embedding", "classification", "rerank", "sparse", "null"] = "embedding"
    pooling: Literal["auto", "mean", "cls", "last", "max", "mean_sqrt_len_tokens",
                     "weightedmean"] = "auto"
    normalize: Literal["auto", "true", "false"] = "auto"
    max_input_tokens: int = 0  # 0: the model's own limit
    # auto: bf16 where the device computes it natively (a GPU from Ampere on, a CPU with
    # AVX512-BF16 or AMX), fp16 on an older GPU (T4, V100), else fp32; the half precision is
    # kept only where a probe of texts run both ways agrees with fp32 to auto_min_cosine
    # (gpu_workers.parity), else the model is served in fp32. int8: dynamic quantization of
    # the linear layers, CPU workers only.
    dtype: Literal["fp32", "bf16", "fp16", "auto", "int8"] = "auto"
    auto_min_cosine: float = 0.999
    revision: str = ""  # empty: a digest of the weights
    # Workers that load this model: GPU indices (as in workers.devices) when workers run on
    # GPUs, worker indexes (0..cpu_workers-1) on CPU workers. Empty: every worker.
    devices: list[int] = field(default_factory=list)
    variants: list[VariantConfig] = field(default_factory=list)  # A/B arms, instead of source
    # A/B: send a client's requests to the same arm: "header:NAME" (a request header) or "user"
    # (the body's `user` field). Empty: each request is routed by weight alone.
    sticky_key: str = ""
    # Embedding models: texts prepended before tokenizing, by name, as sentence-transformers'
    # prompts ({"query": "query: "}); merged over the model's own (its
    # config_sentence_transformers.json). A request names one with `prompt_name`.
    prompts: dict[str, str] = field(default_factory=dict)
    # The prompt for requests that name none: auto (the model's own default_prompt_name, as
    # sentence-transformers applies it), none, or one of the prompts' names.
    default_prompt_name: str = "auto"
    # A reranker that answers yes or no (Qwen3-Reranker): the instruction its prompt carries.
    # Empty: the model card's ("Given a web search query, retrieve relevant passages ...").
    instruction: str = ""


@dataclass(frozen=True, slots=True)
class ShmConfig:
    arena_mb: int = 256  # per frontend; tmpfs pages are only used when touched


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "text"] = "json"
    log_inputs: bool = False
    batch_log: bool = True  # one info line per batch at the workers
    flush_interval_ms: float = 200  # log lines are written out this often; 0: at once
    # supervisord rotates each program's log (and its own) at this size, keeping this many
    max_bytes: int = 50 * 1024 * 1024
    backups: int = 5
    # Every program's lines to supervisord's stdout instead of logs/<program>.log (a
    # container's `kubectl logs`, `docker logs`); needs `up --foreground`. Unrotated.
    stdout: bool = False


@dataclass(frozen=True, slots=True)
class AdminConfig:
    # Bearer token for /admin/*; empty turns the admin routes off (404). Prefer the environment
    # (SHMSERVE__ADMIN__TOKEN) to a file; nginx.admin_loopback_only limits them to loopback.
    token: str = ""
    # How long a reload may take (load, warm up, switch) on every worker before it is called
    # off; keep it under nginx.proxy_read_timeout_s so the caller gets the answer.
    reload_timeout_s: float = 100.0


@dataclass(frozen=True, slots=True)
class AuthConfig:
    # Keys a client must send as `Authorization: Bearer <key>` on every inference route (not on
    # /health, /ready, /metrics, the KServe health routes, /openapi.json, nor /admin/*, which
    # has admin.token). Empty (and no file): the routes are open. Prefer the file (a mounted
    # secret: one key a line) or the environment (SHMSERVE__AUTH__API_KEYS='["k1"]').
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: str = ""  # relative: to the repository root


@dataclass(frozen=True, slots=True)
class TracingConfig:
    # OTLP/HTTP traces endpoint (http://collector:4318/v1/traces); empty: no tracing
    otlp_endpoint: str = ""
    service_name: str = "shmserve"
    sample_ratio: float = 1.0  # requests without a sampling decision of their caller's


@dataclass(frozen=True, slots=True)
class Config:
    models: list[ModelConfig]
    # Model directories must lie under one of these (relative: to the repository root);
    # "package:NAME" sources are installed code and always allowed.
    model_roots: list[str] = field(default_factory=lambda: ["models"])
    server: ServerConfig = ServerConfig()
    nginx: NginxConfig = NginxConfig()
    frontends: FrontendConfig = FrontendConfig()
    workers: WorkerConfig = WorkerConfig()
    batching: BatchingConfig = BatchingConfig()
    limits: LimitsConfig = LimitsConfig()
    shm: ShmConfig = ShmConfig()
    logging: LoggingConfig = LoggingConfig()
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    tracing: TracingConfig = TracingConfig()

    @property
    def run_dir(self) -> Path:
        path = Path(self.server.run_dir)
        return path if path.is_absolute() else REPO_ROOT / path

    @property
    def model_root_paths(self) -> list[Path]:
        return [p if p.is_absolute() else REPO_ROOT / p for p in map(Path, self.model_roots)]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def load(env: str | None = None, extra: str | Path | None = None,
         environ: Mapping[str, str] | None = None) -> Config:
    """Merge the layers (shmserve.layers) and validate them; an error names the layer that
    set the key it is about."""
    tree = layers.merged(env, extra, environ)
    try:
        return from_tree(tree)
    except ConfigError as exc:
        raise layers.located(exc, env, extra, os.environ if environ is None else environ
                             ) from None


def from_tree(tree: Mapping[str, Any], read_keys: bool = True) -> Config:
    """The config in a parsed tree, checked. `read_keys` False: auth.api_keys_file is not
    read (the CLI's reading of a running deployment, which needs no key: a key file broken
    since `up` made status, reload and split act on the default config, an outside check)."""
    cfg = build(Config, tree, CHECKS)
    workers, threads = cpu_layout(cfg.workers.cpu_workers, cfg.workers.torch_threads)
    cfg = dataclasses.replace(cfg, workers=dataclasses.replace(
        cfg.workers, cpu_workers=workers, torch_threads=threads), frontends=dataclasses.replace(
        cfg.frontends, default_priority=priority_level(cfg.frontends.default_priority)))
    _check_run_dir(cfg)
    check_models(cfg)
    # a key file that cannot be read, or a malformed key, stops start-up
    keys = api_keys(cfg) if read_keys else cfg.auth.api_keys_file or cfg.auth.api_keys
    if cfg.admin.token and not _TOKEN.fullmatch(cfg.admin.token):  # "a" was taken (a review)
        raise ConfigError("admin.token: expected 8 to 512 printable ASCII characters (it travels "
                          "as a bearer token), neither starting nor ending with a space")
    limited = cfg.nginx.rate_limit_per_s or cfg.nginx.max_requests_per_client
    if limited and cfg.nginx.rate_limit_key == "api_key" and not keys:
        raise ConfigError("nginx.rate_limit_key: api_key needs auth.api_keys (or "
                          "auth.api_keys_file): on an open server any token is served, so a "
                          "client could send a new one with every request; use ip")
    if limited and cfg.nginx.rate_limit_key == "certificate" \
            and not cfg.nginx.tls_client_ca:
        raise ConfigError("nginx.rate_limit_key: certificate needs nginx.tls_client_ca (mutual "
                          "TLS): without it no client presents one; use ip")
    check_relations(cfg)
    return cfg


_TOKEN = re.compile(r"[\x21-\x7e][\x20-\x7e]{6,510}[\x21-\x7e]")  # admin.token (fullmatch)


# A path written into nginx.conf (quoted: there a backslash escapes, $ names a variable) and
# supervisord.conf (unquoted: % expands, " ;" and " #" start a comment, quotes are stripped):
# spaces and any letter are fine (a checkout in "my models" or "modèles": an outside check)
_SAFE_PATH = re.compile(r"[^\x00-\x1f\x7f\"'\\$%;#{}`]+")


def _check_run_dir(cfg: Config) -> None:
    """The run directory is rendered into and made private (0700): never the repository root
    (its templates, supervisord.conf and nginx/nginx.conf, would be overwritten) nor a folder
    above it. Its path is written into both files: checked with the config, before anything is
    rendered (at rendering, a match's $ let a path ending in a newline by)."""
    if not _SAFE_PATH.fullmatch(str(cfg.run_dir)):
        raise ConfigError(f"server.run_dir: {str(cfg.run_dir)!r} may not hold control "
                          "characters nor any of \" ' \\ $ % ; # { } ` (it is written into "
                          "nginx's and supervisord's configs); a relative run_dir is under the "
                          "checkout: set server.run_dir (SHMSERVE__SERVER__RUN_DIR) to a path "
                          "without them")
    run_dir, root = cfg.run_dir.resolve(), REPO_ROOT.resolve()
    if run_dir == root or run_dir in root.parents:
        raise ConfigError(f"server.run_dir: {cfg.server.run_dir!r} is {run_dir}, the repository "
                          "root or a folder above it, where rendering would overwrite the "
                          "templates (supervisord.conf, nginx/nginx.conf) and make it private "
                          "(0700); choose a directory of its own, such as run")


def from_args(args) -> Config:
    """The config a command line names with ``--env`` and ``--config`` (shmserve.cli)."""
    return load(env=args.env, extra=args.config)


def load_resolved(path: str | Path, read_keys: bool = False) -> Config:
    """Read the validated config that ``shmserve up`` wrote into the run directory. Without
    the key file (`read_keys`: as from_tree's) but where asked: only a frontend needs the keys,
    and a worker or the reaper restarted while the file was emptied (a secret's rotation) failed
    to start on it, every worker down (an outside check)."""
    return from_tree(json.loads(Path(path).read_text()), read_keys)
