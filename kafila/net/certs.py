"""A fresh self-signed certificate per member process, for the TLS 1.3 inside QUIC.

Nobody trusts it by itself: the link binds its fingerprint to the session secret (kafila.net.auth).
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Identity:
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    @property
    def fingerprint(self) -> bytes:
        return fingerprint(self.certificate)


def fingerprint(cert: x509.Certificate) -> bytes:
    """SHA-256 of the DER certificate."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def make_identity(name: str = "kafila-member") -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .sign(key, hashes.SHA256())
    )
    return Identity(cert, key)
