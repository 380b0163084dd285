"""TLS on the deployment's port: nginx terminates it (nginx.tls_certificate, nginx.tls_key),
offering HTTP/2 beside HTTP/1.1 (nginx.http2); the frontends behind it speak plain HTTP on
their unix sockets, as without TLS. The CLI's own calls through nginx (`up --wait`, `status`,
the admin commands) trust the configured certificate itself.

Mutual TLS (nginx.tls_client_ca): nginx asks every client for a certificate and checks one
sent against those CAs; a request without one is refused (403) on every route but the probes,
which Kubernetes' kubelet sends without one; a certificate that does not verify is refused
everywhere. The CLI presents nginx.tls_client_certificate."""

from __future__ import annotations

import functools
import re
import ssl
import subprocess
import time
from pathlib import Path

from shmserve.config import Config
from shmserve.layers import REPO_ROOT

# Mozilla's "intermediate" protocols; nginx's default ciphers for them
PROTOCOLS = "TLSv1.2 TLSv1.3"
# nginx 1.25.1 made HTTP/2 a directive of its own (`http2 on;`); `listen ... http2`, the only
# form before it, is deprecated there with a warning at every start
HTTP2_DIRECTIVE = (1, 25, 1)


CERTIFICATE = "-----BEGIN CERTIFICATE-----"


class TlsError(Exception):
    """A certificate or key nginx could not serve; the message names the key and the file."""


def enabled(cfg: Config) -> bool:
    return bool(cfg.nginx.tls_certificate)


def scheme(cfg: Config) -> str:
    """How clients reach nginx: https with TLS, else http."""
    return "https" if enabled(cfg) else "http"


def path(value: str) -> Path:
    """A configured file: relative paths are taken from the repository root (as run_dir)."""
    found = Path(value).expanduser()
    return found if found.is_absolute() else REPO_ROOT / found


def presents_none(cfg: Config) -> bool:
    """Whether nginx asks for a client certificate (nginx.tls_client_ca) and the CLI has none
    to present (nginx.tls_client_certificate): its calls but /ready are refused."""
    return bool(cfg.nginx.tls_client_ca) and not cfg.nginx.tls_client_certificate


# Each TLS file key, the PEM block its file must hold, and what that block is
_FILES = (("nginx.tls_certificate", CERTIFICATE, "certificate"),
          ("nginx.tls_key", "PRIVATE KEY-----", "private key"),
          ("nginx.tls_client_ca", CERTIFICATE, "certificate"),
          ("nginx.tls_client_crl", "-----BEGIN X509 CRL-----", "CRL"),
          ("nginx.tls_client_certificate", CERTIFICATE, "certificate"),
          ("nginx.tls_client_key", "PRIVATE KEY-----", "private key"))
FILE_KEYS = tuple(key for key, _, _ in _FILES)


def files(cfg: Config) -> list[tuple[str, str]]:
    """(key, value) of each TLS file the config names."""
    return [(key, value) for key in FILE_KEYS
            if (value := getattr(cfg.nginx, key.partition(".")[2]))]


def check(cfg: Config) -> None:
    """Refuse, before nginx starts, a certificate or key this user cannot read or that holds
    no PEM block of its kind (nginx's own words for it come later, from `nginx -t`)."""
    if not enabled(cfg):
        return
    for key, marker, kind in _FILES:
        value = getattr(cfg.nginx, key.partition(".")[2])
        if not value:  # the client's files are optional
            continue
        file = path(value)
        try:
            text = file.read_text(errors="replace")
        except OSError as exc:
            raise TlsError(f"{key}: cannot read {file}: {exc.strerror}") from None
        if marker not in text:
            raise TlsError(f"{key}: {file} holds no PEM {kind}")
        # PKCS#8's "BEGIN ENCRYPTED PRIVATE KEY", or a traditional key's "Proc-Type: 4,ENCRYPTED":
        # nginx asks for the pass phrase on the terminal (`nginx -t` in up and apply waited
        # there), and under supervisord it waited forever without listening
        if kind == "private key" and "ENCRYPTED" in text:
            raise TlsError(f"{key}: {file} is encrypted (a pass phrase), which nginx would ask "
                           "for on a terminal: give it unencrypted (`openssl pkey -in KEY -out "
                           "PLAIN.key`, mode 0600)")
    cas, missing = crl_gaps(cfg)
    if cas and len(missing) == len(cas):
        raise TlsError(f"nginx.tls_client_crl: {path(cfg.nginx.tls_client_crl)} holds no CRL "
                       f"(that openssl reads) of a CA of nginx.tls_client_ca ({'; '.join(cas)}):"
                       " nginx would refuse every client certificate (it checks a CRL of each "
                       "CA in a client's chain); give each CA's CRL")


def nginx_values(cfg: Config, binary: str, grpc: bool = False) -> dict[str, str]:
    """nginx.conf's TLS placeholders: the listen parameters and the server's directives
    (none without TLS), the probes' paths, and the refusal of a request without a client
    certificate (client_refusal). `grpc`: the gRPC port's server, HTTP/2 always, cleartext
    (h2c) without TLS."""
    probes = GRPC_OPEN_PROBES if grpc else OPEN_PROBES
    refusal = client_refusal(cfg, "shmserve_grpc_no_client_cert" if grpc
                             else "shmserve_no_client_cert", probes, preflights=not grpc,
                             errors=GRPC_ERRORS if grpc else HTTP_ERRORS)
    return {**_server_values(cfg, binary, grpc), "probe_paths": probes,
            "client_cert_map": refusal[0], "client_cert_check": refusal[1]}


def _server_values(cfg: Config, binary: str, grpc: bool) -> dict[str, str]:
    http2 = grpc or cfg.nginx.http2
    directive = http2 and nginx_version(binary) >= HTTP2_DIRECTIVE
    if not enabled(cfg):
        if grpc:
            return {"listen_tls": "" if directive else " http2",
                    "tls": "        http2 on;" if directive else "        # no TLS: h2c"}
        return {"listen_tls": "", "tls": "        # no TLS: nginx.tls_certificate is not set"}
    lines = [f'ssl_certificate "{path(cfg.nginx.tls_certificate)}";',
             f'ssl_certificate_key "{path(cfg.nginx.tls_key)}";',
             f"ssl_protocols {PROTOCOLS};",
             *session_lines(cfg),
             "ssl_session_tickets off;",
             *(["http2 on;"] if directive else []),
             *client_lines(cfg)]
    return {"listen_tls": " ssl" + (" http2" if http2 and not directive else ""),
            "tls": "\n".join(f"        {line}" for line in lines)}


def session_lines(cfg: Config) -> list[str]:
    """TLS session resumption: a day's sessions cached, but none under mutual TLS. A resumed
    session keeps the client certificate's verification from its first handshake, and the
    cache outlives a reload: a certificate revoked by a new nginx.tls_client_crl (`shmserve
    restart nginx`) kept its 200s on resumed connections, TLS 1.2 and 1.3 alike (an outside
    check). Without a cache every connection verifies its certificate against the CRL read
    last; clients keeping their connections alive pay the full handshake once each."""
    if cfg.nginx.tls_client_ca:
        return ["ssl_session_cache off;  # mutual TLS: no resumption (tls.session_lines)"]
    return ["ssl_session_cache shared:shmserve_tls:10m;", "ssl_session_timeout 1d;"]


def client_lines(cfg: Config) -> list[str]:
    """nginx's directives asking for client certificates (nginx.tls_client_ca). `optional`:
    a client may send none, so the probes answer a kubelet; a request without one is refused
    by client_refusal's check; one that does not verify is nginx's 495 everywhere."""
    if not cfg.nginx.tls_client_ca:
        return []
    # with a CRL, OpenSSL asks one of every CA in a chain (nginx: CRL_CHECK_ALL): the file
    # holds each issuing CA's
    crl = [f'ssl_crl "{path(cfg.nginx.tls_client_crl)}";'] if cfg.nginx.tls_client_crl else []
    return [f'ssl_client_certificate "{path(cfg.nginx.tls_client_ca)}";',
            "ssl_verify_client optional;",
            f"ssl_verify_depth {VERIFY_DEPTH};", *crl]


# A client certificate's chain, up to a root the CA file holds: leaf, intermediates, root
VERIFY_DEPTH = 3
# The probes a request without a client certificate may still reach, as the HTTP and gRPC
# servers' probe locations name them (a kubelet sends none). Not /metrics nor /openapi.json,
# which are open without an API key (frontend.app.OPEN_PATHS): Prometheus presents one.
# A model's name holds no '?' nor '#': matched against a raw target (as_written), ".+" ran on
# into the query, so /v2/models/M/infer?/ready was a probe to the rate limit's key while nginx
# and the frontend served POST /v2/models/M/infer, unlimited (an outside check).
OPEN_PROBES = r"/(health|ready|v2/health/live|v2/health/ready|v2/models/[^?#]+/ready)"
# The error pages' internal locations (nginx.conf's ^~ /_shmserve_errors/, grpc.conf's
# /_shmserve_grpc_error/), which an error page's internal redirect reaches and a client cannot
HTTP_ERRORS = "/_shmserve_errors/"
GRPC_ERRORS = "/_shmserve_grpc_error/"
GRPC_OPEN_PROBES = (r"/(grpc\.health\.v1\.Health/Check|"
                    r"inference\.GRPCInferenceService/(ServerLive|ServerReady|ModelReady))")


def as_written(paths: str) -> str:
    """A regex of request targets ($request_uri) that are `paths` (a regex) as the client wrote
    them, with any query string: no %-escape, // or dot segment, which nginx decodes and
    resolves into the $uri its locations match, while proxy_pass hands a frontend the target
    as sent (/v1/models/%2e%2e%2F%2e%2e%2Fhealth: /health to nginx, GET /v1/models/{model} to
    aiohttp). What nginx leaves open by path (mutual TLS's probes, the rate limit's probes and
    scrapes) is open only so. `paths` must match no '?' nor '#' (OPEN_PROBES)."""
    return rf"^(?![^?]*(%|//|/\.\.?(/|\?|$))){paths}(\?.*)?$"


def client_refusal(cfg: Config, variable: str, probes: str,
                   preflights: bool, errors: str) -> tuple[str, str]:
    """(maps at nginx's http level, the check in a server) refusing a request that sent no
    client certificate (nginx's 496) but on `probes` (a regex of paths), the error pages'
    internal redirects and (`preflights`) the CORS preflights nginx answers itself; comments
    without nginx.tls_client_ca."""
    if not cfg.nginx.tls_client_ca:
        return ("    # no client certificates asked for: nginx.tls_client_ca is not set",
                "        # no client certificates asked for (nginx.tls_client_ca)")
    # A probe as nginx reads it ($uri) must be one as the client wrote it too (as_written: an
    # outside check reached GET /v1/models/{model} without a certificate).
    # The key ends with $ssl_client_verify, as "FAILED:<reason>" holds spaces (the 495 page
    # nginx answers for one was refused again, and its own HTML 400 came back).
    # A browser sends a CORS preflight without its certificate (the Fetch standard counts one
    # among the credentials a preflight leaves out): every location but /admin/ answers it at
    # nginx with CORS headers alone (nginx.cors_allow_origins), no frontend seeing it.
    # The error pages (`errors`, the server's internal location) pass: nginx's 496 page is an
    # internal redirect that comes here again. Only that location's own prefix, with its '/':
    # "/_shmserve_error" alone let /v1/models/%2e%2e%2F%2e%2e%2F_shmserve_errorX, which nginx
    # reads as /_shmserve_errorX (location /), reach GET /v1/models/{model} without a
    # certificate (an outside check); a client's /_shmserve_errors/... is nginx's own 404.
    preflight = "$shmserve_cors_preflight" if preflights else ""
    answered = '\n        "~^1\\|1?/(?!admin/)" "";' if preflights else ""
    return (f"""    map $request_uri ${variable}_raw {{
        volatile;
        "~{as_written(probes)}" 1;
        default "";
    }}
    map "{preflight}|${variable}_raw$uri $ssl_client_verify" ${variable} {{
        volatile;  # read again on an error page's internal redirect
        "~ SUCCESS$" "";{answered}
        "~^\\|1?{re.escape(errors)}" "";
        "~^\\|1{probes} NONE$" "";
        default 1;
    }}""", f"""        # no client certificate (nginx.tls_client_ca), and not a probe: 403
        if (${variable}) {{
            return 496;
        }}""")


@functools.lru_cache(maxsize=4)
def nginx_version(binary: str) -> tuple[int, ...]:
    """`binary`'s version, from `nginx -v` (0, 0, 0 where it says none)."""
    done = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=30,
                          check=False)
    found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", done.stderr + done.stdout)
    return tuple(int(part) for part in found.groups()) if found else (0, 0, 0)


def client_context(cfg: Config) -> ssl.SSLContext | None:
    """What the CLI's calls through nginx trust: the configured certificate itself (a
    self-signed one, or a leaf issued by any CA), whatever names it holds, as they reach it at
    the listen address (loopback for a wildcard one); None without TLS."""
    if not enabled(cfg):
        return None
    file = path(cfg.nginx.tls_certificate)
    try:
        context = ssl.create_default_context(cafile=str(file))
    except (OSError, ssl.SSLError) as exc:  # gone, or replaced by something else, since `up`
        raise TlsError(f"nginx.tls_certificate: cannot read {file} to check the server's "
                       f"certificate against: {getattr(exc, 'strerror', None) or exc}") from None
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf alone is trusted
    if cfg.nginx.tls_client_certificate:
        cert, key = path(cfg.nginx.tls_client_certificate), path(cfg.nginx.tls_client_key)
        try:
            context.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"nginx.tls_client_certificate: cannot present {cert} with "
                           f"{key}: {getattr(exc, 'strerror', None) or exc}") from None
    return context


# Warned of this long before a date: renewing a certificate or a CRL takes an operator.
EXPIRY_WARNING_DAYS = {"certificate": 14, "CRL": 7}
_BLOCK = re.compile(r"-----BEGIN (CERTIFICATE|X509 CRL)-----.+?-----END \1-----", re.DOTALL)


# Each TLS file whose dates matter: its kind, what follows its end, and what puts it right.
_RELOAD = "then `shmserve restart nginx`"
DATED = (("nginx.tls_certificate", "certificate", "clients refuse the server", _RELOAD),
         ("nginx.tls_client_ca", "certificate",
          "nginx refuses every client certificate it issued", _RELOAD),
         ("nginx.tls_client_crl", "CRL",
          "nginx refuses every client certificate its CA issued, at its next handshake",
          _RELOAD),
         ("nginx.tls_client_certificate", "certificate",
          "nginx refuses the CLI's calls but /ready", "the CLI reads it at each command"))


def expiries(cfg: Config) -> list[tuple[str, str, float]]:
    """(key, kind, epoch seconds) of each dated TLS file the config names: the earliest
    notAfter of its certificates, or nextUpdate of its CRLs (a chain, several CAs or CRLs:
    every PEM block read, by the openssl command; nothing where it is missing)."""
    return [(key, kind, when) for key, kind, when in dated_files(cfg) if when is not None]


def dated_files(cfg: Config) -> list[tuple[str, str, float | None]]:
    """As `expiries`, with each file named that holds no date the openssl command reads
    (gone, unreadable, no PEM block of its kind, a block that does not parse) as None: nginx
    refuses such a file at its next reload or start."""
    found = []
    for key, kind, _, _ in DATED:
        value = getattr(cfg.nginx, key.partition(".")[2])
        if value and (key != "nginx.tls_certificate" or enabled(cfg)):
            dates = _dates(path(value), kind)
            found.append((key, kind, min(dates) if dates else None))
    return found


def expiry_warnings(cfg: Config, now: float) -> list[str]:
    """What `shmserve status` warns of in the TLS files nginx reads (and the CLI presents): a
    certificate past its notAfter or within EXPIRY_WARNING_DAYS of it (the server's: clients
    refuse it; a client CA's: nginx refuses every client it issued), a CRL past its nextUpdate
    or near it (nginx then refuses every client certificate at its next handshake: an outside
    check met that outage as kept-alive connections ended). Alerts: the reaper's gauge
    shmserve_tls_expiry_timestamp_seconds."""
    said = {key: (then, action) for key, _, then, action in DATED}
    warnings = []
    for key, kind, when in expiries(cfg):
        then, action = said[key]
        file = path(getattr(cfg.nginx, key.partition(".")[2]))
        days = (when - now) / 86400
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when))
        field = "nextUpdate" if kind == "CRL" else "notAfter"
        if days < 0:
            warnings.append(f"{key}: {file} holds a {kind} past its {field} ({date}): "
                            f"{then}; renew it ({action})")
        elif days < EXPIRY_WARNING_DAYS[kind]:
            warnings.append(f"{key}: {file} holds a {kind} whose {field} is {date}, in "
                            f"{_left(when - now)}, when {then}: renew it before ({action})")
    return warnings


def _left(seconds: float) -> str:
    """A time left as days, or hours and minutes under a day ("in 0.0 days" said 6 minutes)."""
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    hours, minutes = divmod(int(seconds // 60), 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"


def _dates(file: Path, kind: str) -> list[float]:
    """notAfter of each certificate, or nextUpdate of each CRL, in a PEM file (epoch
    seconds); none where the file or the openssl command cannot be read."""
    dates = []
    for value in _each(file, kind, "-nextupdate" if kind == "CRL" else "-enddate"):
        try:
            dates.append(float(ssl.cert_time_to_seconds(value)))
        except ValueError:  # "NONE": a CRL without a next update
            pass
    return dates


def _names(file: Path, kind: str) -> list[str]:
    """The issuer of each CRL, or the subject of each certificate, in a PEM file (RFC 2253)."""
    return _each(file, kind, "-issuer" if kind == "CRL" else "-subject",
                 "-nameopt", "RFC2253")


def _each(file: Path, kind: str, *option: str) -> list[str]:
    """One field (`option`, as `openssl x509` or `openssl crl` prints it: NAME=value) of each
    certificate or CRL (`kind`) in a PEM file; none where the file or the openssl command
    cannot be read, or a block does not parse."""
    try:
        blocks = [m.group(0) for m in _BLOCK.finditer(file.read_text(errors="replace"))
                  if (m.group(1) == "X509 CRL") == (kind == "CRL")]
    except OSError:
        return []
    values = []
    for block in blocks:
        try:
            done = subprocess.run(["openssl", "crl" if kind == "CRL" else "x509", "-noout",
                                   *option], input=block, capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return values
        name, sep, value = done.stdout.strip().partition("=")
        if done.returncode == 0 and sep:
            values.append(value.strip())
    return values


def crl_gaps(cfg: Config) -> tuple[list[str], list[str]]:
    """(the CAs of nginx.tls_client_ca, those of them nginx.tls_client_crl holds no CRL of),
    by subject and issuer names: nginx checks a CRL for every CA in a client's chain
    (OpenSSL's CRL_CHECK_ALL), so each certificate such a CA issued is refused, and with
    none of them every client is ("FAILED:unable to get certificate CRL": an outside check
    put a certificate, then another CA's CRL, where the CRL goes: nginx -t took both).
    Nothing where the openssl command cannot read them."""
    if not (cfg.nginx.tls_client_ca and cfg.nginx.tls_client_crl):
        return [], []
    cas = _names(path(cfg.nginx.tls_client_ca), "certificate")
    issuers = set(_names(path(cfg.nginx.tls_client_crl), "CRL"))
    return cas, [ca for ca in cas if ca not in issuers]


def crl_warnings(cfg: Config) -> list[str]:
    """`shmserve status`'s: CAs of nginx.tls_client_ca the CRL file has no CRL of (crl_gaps;
    none of them is refused by `check`)."""
    cas, missing = crl_gaps(cfg)
    if not missing or len(missing) == len(cas):
        return []
    return [f"nginx.tls_client_crl: {path(cfg.nginx.tls_client_crl)} holds no CRL of "
            f"{', '.join(missing)} (a CA of nginx.tls_client_ca): nginx refuses every "
            "certificate it issued (nginx checks a CRL of each CA in a client's chain)"]
