"""wss: the rendezvous serves TLS itself; members verify it by CA file or by a pinned fingerprint."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kafila.net.signaling import SignalingClient, SignalingError
from tests.rendezvous.conftest import Factory

pytestmark = pytest.mark.network


def self_signed(folder: Path, name: str = "127.0.0.1") -> tuple[Path, Path, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kafila test rendezvous")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


async def test_ca_file_and_pinned_fingerprint(start_rendezvous: Factory, tmp_path: Path) -> None:
    cert, key, digest = self_signed(tmp_path)
    server = await start_rendezvous(cert=str(cert), key=str(key))
    assert server.url.startswith("wss://")

    async with await SignalingClient.connect(server.url, ca_file=str(cert)) as client:
        opened = await client.open_session("m", 2, "tls-host", {})
    assert opened.member == 1

    pin = ":".join(f"{b:02X}" for b in digest)
    async with await SignalingClient.connect(server.url, fingerprint=pin) as client:
        assert await client.heartbeat() < 2.0

    with pytest.raises(SignalingError, match="does not match the pinned") as info:
        await SignalingClient.connect(server.url, fingerprint="00" * 32)
    assert info.value.code == "bad_certificate"


async def test_untrusted_certificate_is_refused(start_rendezvous: Factory, tmp_path: Path) -> None:
    cert, key, _ = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _, _ = self_signed(tmp_path / "other")
    server = await start_rendezvous(cert=str(cert), key=str(key))
    with pytest.raises(ssl.SSLCertVerificationError):
        await SignalingClient.connect(server.url)  # system trust does not know it
    with pytest.raises(ssl.SSLCertVerificationError):
        await SignalingClient.connect(server.url, ca_file=str(other_ca))
