"""wss: the rendezvous serves TLS itself; members verify it by CA file or by a pinned fingerprint."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kafila.cli import build_parser
from kafila.cli.rendezvous import main
from kafila.net.signaling import SignalingClient, SignalingError
from kafila.rendezvous.server import RendezvousServer, ServerConfig, TlsError
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


def tls_files(folder: Path, case: str) -> tuple[str, str, str]:
    """(cert, key, what the refusal says) for one way a certificate or key can be unusable."""
    cert, key, _ = self_signed(folder)
    (folder / "other").mkdir()
    _, other_key, _ = self_signed(folder / "other")
    garbage = folder / "garbage.pem"
    garbage.write_text("garbage\n")
    encrypted = folder / "encrypted.pem"
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    scheme = serialization.BestAvailableEncryption(b"secret")
    encrypted.write_bytes(
        private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, scheme)
    )
    missing = str(folder / "missing.pem")
    return {
        "missing cert": (missing, str(key), f"cannot load --cert {missing}: No such file or directory"),
        "missing key": (str(cert), missing, f"cannot load --key {missing}: No such file or directory"),
        "garbage cert": (
            str(garbage),
            str(key),
            f"cannot load --cert {garbage}: it holds no PEM certificate",
        ),
        "garbage key": (str(cert), str(garbage), f"cannot load --key {garbage}: it holds no PEM private key"),
        "mismatched key": (
            str(cert),
            str(other_key),
            f"cannot load --cert {cert} / --key {other_key}: the key does not belong to the certificate",
        ),
        "encrypted key": (str(cert), str(encrypted), f"cannot load --key {encrypted}: it is encrypted"),
    }[case]


@pytest.mark.parametrize(
    "case", ["missing cert", "missing key", "garbage cert", "garbage key", "mismatched key", "encrypted key"]
)
async def test_an_unusable_certificate_or_key_is_named_before_anything_is_bound(
    tmp_path: Path, case: str
) -> None:
    cert, key, said = tls_files(tmp_path, case)
    config = ServerConfig(host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, cert=cert, key=key)
    server = RendezvousServer(config)
    with pytest.raises(TlsError) as info:
        await server.start()
    assert str(info.value).startswith(said)
    assert server.udp.local == {} and server.http_port == 0  # no socket was bound first


def test_the_cli_logs_the_tls_refusal_and_exits_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cert, key, said = tls_files(tmp_path, "garbage key")
    ports = ["--port", "0", "--udp-port", "0", "--udp-alt-port", "0"]
    argv = ["rendezvous", "--host", "127.0.0.1", *ports, "--cert", cert, "--key", key, "--log-format", "json"]
    args = build_parser("rendezvous").parse_args(argv)
    assert main(args) == 2
    events = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    assert [(e["event"], e["level"]) for e in events] == [("tls_config", "error")]
    assert events[0]["error"] == said
