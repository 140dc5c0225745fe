"""Throwaway certificates made with the openssl command: a self-signed server certificate for
127.0.0.1, and a CA with a client certificate it signed (for client-certificate TLS)."""

import subprocess
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_cert(directory: Path, common_name: str) -> tuple[Path, Path]:
    """A self-signed certificate valid for IP 127.0.0.1, and its unencrypted key."""
    cert, key = directory / "tls.crt", directory / "tls.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={common_name}",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert))
    return cert, key


def make_client_cert(directory: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, client certificate, client key): a client certificate the CA signed."""
    ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", str(ca_key), "-out", str(ca_cert))
    client_key, request, client_cert = directory / "client.key", directory / "client.csr", directory / "client.crt"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=prometheus", "-keyout", str(client_key),
             "-out", str(request))
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "1", "-out", str(client_cert))
    return ca_cert, client_cert, client_key
