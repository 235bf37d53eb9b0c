"""Keys and certificates for a throw-away control plane: one CA, the serving cert, an admin client cert."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


def _name(common_name: str, organization: str = "") -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class Pki:
    """Writes ca.crt, the apiserver's serving pair, an admin (system:masters) client pair and the SA keys."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._ca = (x509.CertificateBuilder().subject_name(_name("gpu-health-test-ca"))
                    .issuer_name(_name("gpu-health-test-ca")).public_key(self._ca_key.public_key())
                    .serial_number(x509.random_serial_number()).not_valid_before(now - _DAY)
                    .not_valid_after(now + 30 * _DAY)
                    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                    .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                 content_commitment=False, key_encipherment=False,
                                                 data_encipherment=False, key_agreement=False,
                                                 encipher_only=False, decipher_only=False), critical=True)
                    .sign(self._ca_key, hashes.SHA256()))
        self.ca_file = directory / "ca.crt"
        self.ca_file.write_bytes(self._ca.public_bytes(serialization.Encoding.PEM))
        self.serving = self._issue("kube-apiserver", "", server=True)
        self.admin = self._issue("gpu-health-test-admin", "system:masters", server=False)
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_key = directory / "sa.key"
        _write_key(self.sa_key, sa_key)
        self.sa_pub = directory / "sa.pub"
        self.sa_pub.write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                  serialization.PublicFormat.SubjectPublicKeyInfo))

    def client_pair(self, common_name: str, organization: str) -> tuple[Path, Path]:
        """A client certificate and key from the suite's CA (a kubelet's: system:node:NAME, system:nodes)."""
        return self._issue(common_name, organization, server=False)

    def _issue(self, common_name: str, organization: str, *, server: bool) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(_name(common_name, organization))
                   .issuer_name(self._ca.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - _DAY)
                   .not_valid_after(now + 30 * _DAY)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default"),
                x509.DNSName("kubernetes.default.svc")]), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        cert_path, key_path = self.dir / f"{common_name}.crt", self.dir / f"{common_name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return cert_path, key_path
