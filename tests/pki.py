"""Certificates for the TLS tests (trustme): a server's, clients', and a CA's revocations."""

from __future__ import annotations

from pathlib import Path

import trustme


def issue(files: Path) -> dict[str, str]:
    """A certificate for 127.0.0.1 issued by a test CA (trustme), its key and the CA's file,
    which clients trust; the nginx keys that serve it."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    for blob in issued.cert_chain_pems:  # the leaf, then its chain: as nginx wants it
        blob.write_to_path(str(files / "chain.pem"), append=True)
    issued.private_key_pem.write_to_path(str(files / "key.pem"))
    ca.cert_pem.write_to_path(str(files / "ca.pem"))
    return {"tls_certificate": str(files / "chain.pem"), "tls_key": str(files / "key.pem")}


def client_certificate(ca: trustme.CA, files: Path, name: str) -> tuple[str, str]:
    """A client certificate `ca` issued to `name`, and its key: (certificate file, key file)."""
    # the same subject for the same name (trustme's default unit is new each time)
    issued = ca.issue_cert(f"{name}@example.com", common_name=name,
                           organization_name="shmserve tests", organization_unit_name="clients")
    issued.cert_chain_pems[0].write_to_path(str(files / f"{name}.pem"))
    issued.private_key_pem.write_to_path(str(files / f"{name}.key"))
    return str(files / f"{name}.pem"), str(files / f"{name}.key")


def revocations(ca: trustme.CA, certificates: list[str], next_update_days: float = 30
                ) -> bytes:
    """A CRL (PEM) `ca` signed, revoking `certificates` (their files), its nextUpdate
    `next_update_days` from now."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), None)
    issuer = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = x509.CertificateRevocationListBuilder().issuer_name(issuer.subject).last_update(
        now - datetime.timedelta(days=1)).next_update(
        now + datetime.timedelta(days=next_update_days))
    for file in certificates:
        serial = x509.load_pem_x509_certificate(Path(file).read_bytes()).serial_number
        builder = builder.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(
            serial).revocation_date(now - datetime.timedelta(hours=1)).build())
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
