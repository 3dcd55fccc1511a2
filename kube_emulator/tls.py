"""The API server's TLS: a certificate authority of its own and a serving certificate it signed.

Every real API server speaks HTTPS only, and its kubeconfig carries the CA that signed it
(``certificate-authority-data``).  So does the emulator: a client that skipped verification,
lost the CA on the way to a port-forward's websocket, or sent a token over plain HTTP (which
client-go refuses to do) fails here as it would on a cluster, not only there.

Each emulator makes a fresh CA (ECDSA P-256, valid for a week) and a serving certificate for
its host (an IP address or a name in the subjectAltName, as client certificate checks need).
The private keys live in memory and in files only for the moment ``ssl`` loads them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass

#: How long the emulator's certificates hold (an emulator lives for a test run).
VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True)
class ServerTls:
    """What the server serves with (``context``) and what its clients trust (``ca_pem``)."""

    context: ssl.SSLContext
    ca_pem: bytes


def _name(common_name: str):  # -> x509.Name
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str):  # -> x509.GeneralName
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_ca(common_name: str = "kube-emulator-ca"):  # -> (private key, certificate)
    """A self-signed CA that may sign server certificates, and nothing else of ours."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def serving_tls(hosts: tuple[str, ...]) -> ServerTls:
    """A new CA and a certificate for ``hosts`` (the first is the common name) it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, ca_cert = make_ca()
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    chain = cert.public_bytes(pem) + ca_cert.public_bytes(pem)
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, chain, key_pem)
    return ServerTls(context=context, ca_pem=ca_cert.public_bytes(pem))


def _load_chain(context: ssl.SSLContext, chain: bytes, key_pem: bytes) -> None:
    """``ssl`` loads certificates from files only: a private file, gone once loaded."""
    fd, path = tempfile.mkstemp(prefix="kube-emulator-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as fh:  # mkstemp's mode is 0600
            fh.write(key_pem + chain)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
