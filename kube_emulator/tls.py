"""The API server's TLS: a certificate authority of its own and a serving certificate it signed.

Every real API server speaks HTTPS only, and its kubeconfig carries the CA that signed it
(``certificate-authority-data``).  So does the emulator: a client that skipped verification,
lost the CA on the way to a port-forward's websocket, or sent a token over plain HTTP (which
client-go refuses to do) fails here as it would on a cluster, not only there.

Each emulator makes a fresh CA (ECDSA P-256, valid for a week), a serving certificate for its
host (an IP address or a name in the subjectAltName, as clients check), and client
certificates for users who authenticate with one instead of a token.  The private keys live
in memory, and in a file only for the moment ``ssl`` loads the server's.
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
    """A self-signed CA that may sign certificates, and nothing else of ours."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(common_name), _name(common_name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _builder(subject, issuer, public_key):  # cryptography's types, imported lazily
    """A certificate of ``subject``'s key, signed by ``issuer``, valid from now for :data:`VALIDITY`."""
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


@dataclass(frozen=True)
class Credential:
    """A certificate the CA issued, and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


class CertificateAuthority:
    """A CA of the emulator's own: it signs the serving certificate and the users' client
    certificates (a user is the certificate's common name, its groups the organizations, as
    the real API server reads them).  Its key never leaves the process."""

    def __init__(self, common_name: str = "kube-emulator-ca") -> None:
        self._key, self.cert = make_ca(common_name)

    @property
    def pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue_server(self, hosts: tuple[str, ...]) -> Credential:
        """For ``hosts`` (the first is the common name), each in the subjectAltName."""
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        return self._issue(
            _name(hosts[0]),
            ExtendedKeyUsageOID.SERVER_AUTH,
            x509.SubjectAlternativeName([_san(h) for h in hosts]),
        )

    def issue_client(self, user: str, groups: tuple[str, ...] = ()) -> Credential:
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        subject = x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, user)])
        return self._issue(subject, ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(self, subject, usage, *extensions) -> Credential:  # cryptography's types, imported lazily
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(subject, self.cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
        )
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        pem = serialization.Encoding.PEM
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return Credential(builder.sign(self._key, hashes.SHA256()).public_bytes(pem), key_pem)


@dataclass(frozen=True)
class ServerTls:
    """What the server serves with (``context``, which also asks clients for a certificate
    and trusts those ``ca`` issued) and the CA its clients trust."""

    context: ssl.SSLContext
    ca: CertificateAuthority


def serving_tls(hosts: tuple[str, ...]) -> ServerTls:
    """A new CA, and the server's side of TLS for ``hosts`` with a certificate it signed."""
    ca = CertificateAuthority()
    server = ca.issue_server(hosts)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, server.cert_pem + ca.pem, server.key_pem)
    context.verify_mode = ssl.CERT_OPTIONAL  # a bearer token is enough; a client certificate, if any, must be ours
    context.load_verify_locations(cadata=ca.pem.decode())
    return ServerTls(context=context, ca=ca)


def peer_identity(peercert: dict | None) -> tuple[str, tuple[str, ...]] | None:
    """The user and groups of a verified client certificate (``ssl``'s ``getpeercert()``),
    as the API server reads them: common name and organizations; None without one."""
    if not peercert:
        return None
    fields = [attr for rdn in peercert.get("subject", ()) for attr in rdn]
    users = [value for key, value in fields if key == "commonName"]
    groups = tuple(value for key, value in fields if key == "organizationName")
    return (users[0], groups) if users else None


def _load_chain(context: ssl.SSLContext, chain: bytes, key_pem: bytes) -> None:
    """``ssl`` loads certificates from files only: a private file, gone once loaded."""
    fd, path = tempfile.mkstemp(prefix="kube-emulator-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as fh:  # mkstemp's mode is 0600
            fh.write(key_pem + chain)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
