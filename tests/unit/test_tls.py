"""TLS's keys (nginx.tls_certificate, nginx.tls_key, nginx.http2): what the config refuses,
what `up` refuses before nginx starts, and the nginx.conf they render (tests/e2e/test_tls.py
serves through it)."""

from __future__ import annotations

import pytest
import trustme

from shmserve import config, render, tls
from shmserve.config import ConfigError
from tests.pki import revocations
from tests.unit.test_render import make_config


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    files = tmp_path_factory.mktemp("pem")
    issued = trustme.CA().issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(files / "cert.pem"))
    issued.private_key_pem.write_to_path(str(files / "key.pem"))
    return files / "cert.pem", files / "key.pem"


def test_tls_needs_both_files_and_paths_nginx_can_quote(tmp_path):
    with pytest.raises(ConfigError, match="nginx.tls_key: TLS needs both files"):
        make_config(tmp_path, nginx={"tls_certificate": "/etc/cert.pem"})
    with pytest.raises(ConfigError, match="nginx.tls_certificate: TLS needs both files"):
        make_config(tmp_path, nginx={"tls_key": "/etc/key.pem"})
    for bad in ('/etc/a".pem', "/etc/$host.pem", "/etc/a\\b.pem", "/etc/a\nb.pem"):
        with pytest.raises(ConfigError, match="nginx.tls_certificate: expected a file path"):
            make_config(tmp_path, nginx={"tls_certificate": bad, "tls_key": "/etc/k.pem"})


def test_up_refuses_a_file_it_cannot_read_or_that_holds_no_pem(tmp_path, pem):
    cert, key = pem
    missing = make_config(tmp_path / "run", nginx={"tls_certificate": str(tmp_path / "no.pem"),
                                                   "tls_key": str(key)})
    with pytest.raises(render.RenderError, match=r"nginx.tls_certificate: cannot read .*no.pem"):
        render.render(missing)
    swapped = make_config(tmp_path / "run", nginx={"tls_certificate": str(key),
                                                   "tls_key": str(cert)})
    with pytest.raises(render.RenderError, match="nginx.tls_certificate: .* holds no PEM "
                                                 "certificate$"):
        render.render(swapped)
    # an encrypted key: nginx -t asked for its pass phrase on the terminal (up and apply waited
    # there), and nginx under supervisord waited for it without ever listening
    for header in ("-----BEGIN ENCRYPTED PRIVATE KEY-----\n",
                   "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"):
        locked = tmp_path / "locked.pem"
        locked.write_text(header + "MIIB\n-----END PRIVATE KEY-----\n")
        encrypted = make_config(tmp_path / "run", nginx={"tls_certificate": str(cert),
                                                         "tls_key": str(locked)})
        with pytest.raises(render.RenderError, match="nginx.tls_key: .*locked.pem is encrypted"):
            render.render(encrypted)


def test_nginx_listens_with_tls_and_http2_as_its_version_takes_it(tmp_path, pem):
    cert, key = pem
    cfg = make_config(tmp_path / "run", nginx={"tls_certificate": str(cert),
                                               "tls_key": str(key)})
    render.render(cfg)  # and nginx -t takes it
    conf = render.nginx_conf(cfg).read_text()
    assert f'ssl_certificate "{cert}";' in conf and f'ssl_certificate_key "{key}";' in conf
    binary = render.nginx_binary(cfg)
    if tls.nginx_version(binary) >= tls.HTTP2_DIRECTIVE:
        assert "http2 on;" in conf and f":{cfg.server.port} ssl default_server" in conf
    else:
        assert f":{cfg.server.port} ssl http2 default_server" in conf
    plain = render.render_nginx(make_config(tmp_path / "run"))
    assert "ssl" not in plain.split("server_name")[0].rsplit("listen", 1)[1]
    assert "ssl_certificate" not in plain
    no_h2 = make_config(tmp_path / "run", nginx={"tls_certificate": str(cert),
                                                 "tls_key": str(key), "http2": False})
    conf = render.render_nginx(no_h2)
    assert f":{no_h2.server.port} ssl default_server" in conf and "http2" not in conf


def test_the_clis_calls_trust_the_configured_certificate_alone(tmp_path, pem):
    cert, key = pem
    cfg = make_config(tmp_path, nginx={"tls_certificate": str(cert), "tls_key": str(key)})
    assert tls.client_context(make_config(tmp_path)) is None
    context = tls.client_context(cfg)
    assert context.check_hostname is False and context.cert_store_stats()["x509"] == 1
    assert tls.path("c.pem") == config.REPO_ROOT / "c.pem"  # relative: from the repository


def test_a_certificate_gone_since_up_is_a_clear_cli_error(tmp_path, pem, capsys, monkeypatch):
    cert, key = pem
    gone = tmp_path / "gone.pem"
    gone.write_bytes(cert.read_bytes())
    cfg = make_config(tmp_path, nginx={"tls_certificate": str(gone), "tls_key": str(key)})
    gone.unlink()
    with pytest.raises(tls.TlsError, match=r"nginx.tls_certificate: cannot read .*gone.pem"):
        tls.client_context(cfg)
    from shmserve import cli

    # what main makes of it where a command meets it (status, admin commands): one line, exit 2
    monkeypatch.setattr(cli, "parse", lambda argv: type("Args", (), {
        "run": staticmethod(lambda args: tls.client_context(cfg))})())
    assert cli.main([]) == 2
    assert "shmserve: nginx.tls_certificate: cannot read" in capsys.readouterr().err


@pytest.fixture(scope="module")
def client_pki(tmp_path_factory):
    """A CA for clients, a certificate it issued with its key (mutual TLS), and its CRL."""
    files = tmp_path_factory.mktemp("client")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(files / "client-ca.pem"))
    (files / "client.crl").write_bytes(revocations(ca, []))
    issued = ca.issue_cert("client@example.com")
    issued.cert_chain_pems[0].write_to_path(str(files / "client.pem"))
    issued.private_key_pem.write_to_path(str(files / "client.key"))
    return files


def test_client_certificates_need_tls_and_the_clis_pair(tmp_path, pem, client_pki):
    cert, key = pem
    with pytest.raises(ConfigError, match="nginx.tls_client_ca: client certificates are asked "
                                          "for in the TLS handshake; set nginx.tls_certificate"):
        make_config(tmp_path, nginx={"tls_client_ca": str(client_pki / "client-ca.pem")})
    with pytest.raises(ConfigError, match="nginx.tls_client_key: the CLI's client certificate "
                                          "needs both files"):
        make_config(tmp_path, nginx={"tls_certificate": str(cert), "tls_key": str(key),
                                     "tls_client_certificate": str(client_pki / "client.pem")})
    with pytest.raises(ConfigError, match="nginx.tls_client_crl: revokes client certificates, "
                                          "which only nginx.tls_client_ca asks for"):
        make_config(tmp_path, nginx={"tls_certificate": str(cert), "tls_key": str(key),
                                     "tls_client_crl": "/etc/clients.crl"})
    with pytest.raises(ConfigError, match="nginx.tls_client_ca: expected a file path"):
        make_config(tmp_path, nginx={"tls_certificate": str(cert), "tls_key": str(key),
                                     "tls_client_ca": "/etc/$ca.pem"})
    # a CA file that is a key: refused before nginx starts, naming the key
    swapped = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key),
        "tls_client_ca": str(client_pki / "client.key")})
    with pytest.raises(render.RenderError, match="nginx.tls_client_ca: .* holds no PEM "
                                                 "certificate$"):
        render.render(swapped)
    not_a_crl = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key),
        "tls_client_ca": str(client_pki / "client-ca.pem"),
        "tls_client_crl": str(client_pki / "client-ca.pem")})
    with pytest.raises(render.RenderError, match="nginx.tls_client_crl: .* holds no PEM CRL$"):
        render.render(not_a_crl)


def test_client_certificates_are_asked_for_on_both_ports_and_probes_stay_open(
        tmp_path, pem, client_pki):
    from tests.stack import free_port

    cert, key = pem
    ca = client_pki / "client-ca.pem"
    crl = client_pki / "client.crl"
    cfg = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key), "tls_client_ca": str(ca),
        "tls_client_crl": str(crl)}, server={"grpc_port": free_port()})
    render.render(cfg)  # and nginx -t takes it (the CRL too)
    conf = render.nginx_conf(cfg).read_text()
    http, grpc = conf.split("upstream frontends_grpc")
    for server, variable in ((http, "$shmserve_no_client_cert"),
                             (grpc, "$shmserve_grpc_no_client_cert")):
        assert f'ssl_client_certificate "{ca}";' in server
        assert "ssl_verify_client optional;" in server  # so a kubelet's probe gets through
        assert f'ssl_crl "{crl}";' in server
        assert f"if ({variable}) {{\n            return 496;" in server
        # no session resumed past a new CRL (a reload keeps the cache): none cached
        assert "ssl_session_cache off;" in server and "shared:shmserve_tls" not in server
        # the error pages pass the check by their internal location's prefix alone: with
        # "/_shmserve_error", /v1/models/%2e%2e%2F%2e%2e%2F_shmserve_errorX reached a frontend
        errors = "/_shmserve_grpc_error/" if server is grpc else "/_shmserve_errors/"
        assert f'"~^\\|1?{errors}" "";' in server, server
    # the probes the refusal leaves open are the probe locations' own paths
    assert f"location ~ ^{tls.OPEN_PROBES}$ {{" in http
    assert f'"~^\\|1{tls.OPEN_PROBES} NONE$" "";' in http
    assert f"location ~ ^{tls.GRPC_OPEN_PROBES}$ {{" in grpc
    assert "error_page 496 =403 /_shmserve_errors/${shmserve_error_set}496." in http
    # on the gRPC port UNAUTHENTICATED, counted as the HTTP port's 403
    assert "error_page 496 = /_shmserve_grpc_error/403/496;" in grpc
    assert "add_header grpc-status 16 always;" in grpc.split("/_shmserve_grpc_error/403/496 {")[1]
    without = render.render_nginx(make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key)}))
    assert "ssl_verify_client" not in without and "return 496" not in without
    assert "ssl_session_cache shared:shmserve_tls:10m;" in without


def test_the_clis_calls_present_the_configured_client_certificate(tmp_path, pem, client_pki):
    cert, key = pem
    nginx = {"tls_certificate": str(cert), "tls_key": str(key),
             "tls_client_ca": str(client_pki / "client-ca.pem")}
    context = tls.client_context(make_config(tmp_path, nginx={
        **nginx, "tls_client_certificate": str(client_pki / "client.pem"),
        "tls_client_key": str(client_pki / "client.key")}))
    assert context.cert_store_stats()["x509"] == 1  # still trusting the server's alone
    mismatched = make_config(tmp_path, nginx={
        **nginx, "tls_client_certificate": str(client_pki / "client.pem"),
        "tls_client_key": str(key)})  # the server's key
    with pytest.raises(tls.TlsError, match=r"nginx.tls_client_certificate: cannot present "
                                           r".*client.pem with .*key.pem"):
        tls.client_context(mismatched)


def test_a_rate_limit_by_certificate_counts_each_clients_subject(tmp_path):
    """nginx.rate_limit_key certificate: the verified certificate's subject is the client, so
    two certificates from one address are two clients, and one's renewal (a new certificate,
    the same subject) the same one. No frontend runs here: what passes the limit gets 502."""
    import requests

    from tests.pki import client_certificate, issue
    from tests.unit.test_nginx_pages import nginx_of

    server = issue(tmp_path)
    with pytest.raises(ConfigError, match="rate_limit_key: certificate needs "
                                          "nginx.tls_client_ca"):
        make_config(tmp_path / "run", nginx={**server, "rate_limit_per_s": 1,
                                             "rate_limit_key": "certificate"})
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "clients.pem"))
    alice, bob = (client_certificate(ca, tmp_path, name) for name in ("alice", "bob"))
    (tmp_path / "renewed").mkdir()
    renewed = client_certificate(ca, tmp_path / "renewed", "alice")
    cfg = make_config(tmp_path / "run", frontends={"count": 1}, nginx={
        **server, "tls_client_ca": str(tmp_path / "clients.pem"), "rate_limit_per_s": 1 / 60,
        "rate_limit_burst": 1, "rate_limit_key": "certificate"})
    url = f"https://127.0.0.1:{cfg.server.port}"

    def status(path: str, client: tuple[str, str] | None) -> int:
        return requests.post(url + path, json={}, cert=client, verify=str(tmp_path / "ca.pem"),
                             timeout=30).status_code
    with nginx_of(cfg):
        assert [status("/v1/embeddings", alice) for _ in range(3)] == [502, 502, 429]
        assert status("/v1/embeddings", renewed) == 429  # the same subject
        assert [status("/v1/embeddings", bob) for _ in range(3)] == [502, 502, 429]
        assert status("/v1/embeddings", None) == 403  # refused before any limit


def test_apply_says_who_mutual_tls_refuses_or_serves_from_now_on(tmp_path):
    """An apply turning mTLS on (or to another CA), off, or dropping the CLI's certificate
    while it stays on, says so (nothing else changes where clients reach the deployment)."""
    from shmserve import moves

    tls_on = {"tls_certificate": "/etc/s.pem", "tls_key": "/etc/s.key"}
    mtls = {**tls_on, "tls_client_ca": "/etc/clients.pem"}
    cli = {"tls_client_certificate": "/etc/cli.pem", "tls_client_key": "/etc/cli.key"}

    def said(old: dict, new: dict) -> str:
        lines: list[str] = []
        same = {"port": 18443}  # (make_config picks a free port each time)
        moves.check(make_config(tmp_path, nginx=old, server=same),
                    make_config(tmp_path, nginx=new, server=same),
                    move=False, dry_run=False, say=lambda text, *_: lines.append(text))
        return "\n".join(lines)
    assert "nginx asks clients for a certificate /etc/clients.pem issued" in said(tls_on, mtls)
    assert "nginx asks clients for a certificate /etc/other.pem" in said(
        mtls, {**mtls, "tls_client_ca": "/etc/other.pem"})
    assert "nginx asks clients for no certificate from now on" in said(mtls, tls_on)
    assert "this CLI presents no client certificate from now on" in said({**mtls, **cli}, mtls)
    assert said(mtls, mtls) == said({**mtls, **cli}, {**mtls, **cli}) == ""


def test_status_warns_of_certificates_and_crls_past_or_near_their_dates(tmp_path, pem,
                                                                         client_pki):
    """tls.expiry_warnings, what `shmserve status` says: a CRL past its nextUpdate refuses
    every client certificate at its next handshake (an outside check met it as an outage)."""
    import time

    from cryptography import x509

    cert, key = pem
    cfg = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key),
        "tls_client_ca": str(client_pki / "client-ca.pem"),
        "tls_client_crl": str(client_pki / "client.crl")})
    now = time.time()
    assert tls.expiry_warnings(cfg, now) == []  # a CRL of 30 days, certificates of years
    day = 86400
    warned = tls.expiry_warnings(cfg, now + 25 * day)  # the CRL's nextUpdate in ~5 days
    assert len(warned) == 1 and warned[0].startswith(
        f"nginx.tls_client_crl: {client_pki / 'client.crl'} holds a CRL whose nextUpdate is ")
    assert ("in 5.0 days, when nginx refuses every client certificate its CA issued, at its "
            "next handshake") in warned[0] and "`shmserve restart nginx`" in warned[0]
    ends = x509.load_pem_x509_crl((client_pki / "client.crl").read_bytes()
                                  ).next_update_utc.timestamp()
    assert ", in 5 h 5" in tls.expiry_warnings(cfg, ends - 5 * 3600 - 330)[0]
    assert ", in 3 min, when" in tls.expiry_warnings(cfg, ends - 200)[0]  # not "0.0 days"
    warned = tls.expiry_warnings(cfg, now + 31 * day)
    assert len(warned) == 1 and "holds a CRL past its nextUpdate" in warned[0]
    ends = x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc.timestamp()
    warned = tls.expiry_warnings(cfg, ends - 3 * day)
    assert any(w.startswith(f"nginx.tls_certificate: {cert} holds a certificate whose "
                            "notAfter is ") and "in 3.0 days, when clients refuse the server"
               in w for w in warned), warned
    past = tls.expiry_warnings(cfg, ends + day)
    assert any(w.startswith("nginx.tls_certificate:") and "past its notAfter" in w
               for w in past), past
    # the earliest of a file's blocks: a CRL file of two, the second ending first
    from tests.pki import revocations

    both = tmp_path / "two.crl"
    both.write_bytes((client_pki / "client.crl").read_bytes()
                     + revocations(trustme.CA(), [], next_update_days=2))
    two = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key),
        "tls_client_ca": str(client_pki / "client-ca.pem"), "tls_client_crl": str(both)})
    assert ["in 2.0 days" in w for w in tls.expiry_warnings(two, now)] == [True]


def test_a_tls_file_broken_since_nginx_read_it_is_named_by_restart_and_status(
        tmp_path, pem, client_pki):
    """A CRL file broken under a running nginx: `restart nginx` refuses it naming the key and
    the file (it named nginx.conf), and status warns that a restarted nginx would not start
    (an outside check's nginx, killed, stayed down with status saying nothing)."""
    from shmserve.status_cli import nginx_file_warnings

    cert, key = pem
    crl = tmp_path / "clients.crl"
    crl.write_bytes((client_pki / "client.crl").read_bytes())
    cfg = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key),
        "tls_client_ca": str(client_pki / "client-ca.pem"), "tls_client_crl": str(crl)})
    render.render(cfg)
    assert nginx_file_warnings(cfg) == []
    crl.write_text("-----BEGIN X509 CRL-----\nnot base64 at all\n-----END X509 CRL-----\n")
    with pytest.raises(render.RenderError, match=rf"\(check nginx.tls_client_crl \({crl}\)\): "):
        render.check_nginx(cfg, render.nginx_binary(cfg))
    warned = nginx_file_warnings(cfg)
    assert len(warned) == 1 and warned[0].startswith(
        "nginx runs on the files it read last, but would not start on them now"), warned
    assert f"nginx.tls_client_crl ({crl})" in warned[0]


def test_a_crl_of_no_ca_of_the_clients_is_refused_and_one_missing_is_warned_of(
        tmp_path, pem, client_pki):
    """nginx checks a CRL of each CA in a client's chain: a certificate, or another CA's CRL,
    where the CRL goes passes nginx -t and refuses every client (an outside check); refused
    before nginx takes it (up, apply, restart nginx), and a CA of several without its CRL is
    warned of by status."""
    from shmserve.status_cli import nginx_file_warnings
    from tests.pki import revocations

    cert, key = pem
    other = tmp_path / "other.crl"
    other.write_bytes(revocations(trustme.CA(), []))
    nginx = {"tls_certificate": str(cert), "tls_key": str(key),
             "tls_client_ca": str(client_pki / "client-ca.pem")}
    wrong = make_config(tmp_path / "run", nginx={**nginx, "tls_client_crl": str(other)})
    with pytest.raises(render.RenderError, match=r"nginx.tls_client_crl: .*other.crl holds no "
                       r"CRL \(that openssl reads\) of a CA of nginx.tls_client_ca \(OU=.+\): "
                       "nginx would refuse every client certificate"):
        render.render(wrong)
    good = make_config(tmp_path / "run", nginx={**nginx,
                                                "tls_client_crl": str(client_pki / "client.crl")})
    render.render(good)
    assert tls.crl_gaps(good)[1] == [] and nginx_file_warnings(good) == []
    # the CRL file changed under the running nginx: status says so
    crl = tmp_path / "moving.crl"
    crl.write_bytes((client_pki / "client.crl").read_bytes())
    moving = make_config(tmp_path / "run2", nginx={**nginx, "tls_client_crl": str(crl)})
    render.render(moving)
    crl.write_bytes(other.read_bytes())
    warned = nginx_file_warnings(moving)
    assert len(warned) == 1 and "holds no CRL (that openssl reads) of a CA" in warned[0] and \
        warned[0].endswith("(`restart nginx` refuses it)"), warned
    # two CAs, the CRL of one: warned of, naming the other; not refused
    cas = tmp_path / "two-cas.pem"
    cas.write_bytes((client_pki / "client-ca.pem").read_bytes() + trustme.CA().cert_pem.bytes())
    two = make_config(tmp_path / "run3", nginx={**nginx, "tls_client_ca": str(cas),
                                                 "tls_client_crl": str(client_pki / "client.crl")})
    render.render(two)
    (warning,) = tls.crl_warnings(two)
    second = tls.crl_gaps(two)[0][1]
    assert f"holds no CRL of {second} (a CA of nginx.tls_client_ca)" in warning


def test_restart_nginx_warns_of_a_ca_without_its_crl(tmp_path, pem, client_pki, monkeypatch,
                                                     capsys):
    """The reload is what starts refusing the clients of a CA the CRL file has no CRL of:
    `restart nginx` says so (only status did: an outside check)."""
    from shmserve import nginx_reload

    cert, key = pem
    cas = tmp_path / "two-cas.pem"
    cas.write_bytes((client_pki / "client-ca.pem").read_bytes() + trustme.CA().cert_pem.bytes())
    cfg = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key), "tls_client_ca": str(cas),
        "tls_client_crl": str(client_pki / "client.crl")})
    monkeypatch.setattr(nginx_reload, "check_nginx_conf", lambda cfg: None)
    monkeypatch.setattr(nginx_reload, "process_info",
                        lambda cfg: [{"name": "nginx", "statename": "STOPPED"}])
    monkeypatch.setattr(nginx_reload, "run_ctl", lambda cfg, *args: 0)
    assert nginx_reload.reload_nginx(cfg) == 0
    err = capsys.readouterr().err
    assert "shmserve: warning: nginx.tls_client_crl: " in err and \
        "nginx refuses every certificate it issued" in err, err



def test_nginx_would_not_start_on_a_tls_file_gone_bad_is_scraped(tmp_path, pem, client_pki):
    """The reaper's gauges: shmserve_nginx_start_refused (ShmserveNginxWouldNotStart) is 1
    while `nginx -t` refuses the files as on disk (a CRL garbled, a chain cut part way, a key
    that is no key: an outside check found a per-file date reading blind to the last two), and
    the expiry series of a file that reads no date is NaN (it kept its last date, which said
    all was well: a review)."""
    import math
    import shutil
    import threading

    from shmserve import reaper, render

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pem[0], cert)
    shutil.copy(pem[1], key)
    crl = tmp_path / "client.crl"
    shutil.copy(client_pki / "client.crl", crl)
    cfg = make_config(tmp_path / "run", nginx={
        "tls_certificate": str(cert), "tls_key": str(key),
        "tls_client_ca": str(client_pki / "client-ca.pem"), "tls_client_crl": str(crl)})
    render.render(cfg)
    done = threading.Event()
    done.set()  # one look, then return

    def scraped() -> tuple[float, float]:
        reaper.watch_nginx_files(cfg, done)
        reaper.watch_tls_dates(cfg, done)
        return (reaper.NGINX_REFUSED._value.get(),
                reaper.TLS_EXPIRY.labels("nginx.tls_client_crl", "crl")._value.get())

    refused, when = scraped()
    assert refused == 0 and when > 1e9
    good_crl, good_cert = crl.read_bytes(), cert.read_bytes()
    crl.write_text("-----BEGIN X509 CRL-----\nnot a CRL\n-----END X509 CRL-----\n")
    refused, when = scraped()
    assert refused == 1 and math.isnan(when)
    crl.write_bytes(good_crl)
    assert scraped()[0] == 0
    # the leaf whole, a second block cut part way: its date reads, nginx refuses it
    cert.write_bytes(good_cert + good_cert[:300])
    assert scraped()[0] == 1
    cert.write_bytes(good_cert)
    key.write_text("garbage key\n")
    assert scraped()[0] == 1 and "tls_key" in render.nginx_start_refusal(cfg)
