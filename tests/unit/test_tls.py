"""TLS's keys (nginx.tls_certificate, nginx.tls_key, nginx.http2): what the config refuses,
what `up` refuses before nginx starts, and the nginx.conf they render (tests/e2e/test_tls.py
serves through it)."""

from __future__ import annotations

import pytest
import trustme

from shmserve import config, render, tls
from shmserve.config import ConfigError
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
