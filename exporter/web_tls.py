"""TLS for the exporter's port: an SSLContext built from `TlsSettings`, rebuilt when its files change.

Certificates are renewed in place (cert-manager, a cron'd certbot); the exporter keeps serving
through a renewal without a restart, and never through a half-written one. OpenSSL loads an expired
certificate without a word and clients that verify it then fail with nothing in the exporter's log,
so its expiry is logged at start and on every reload (an error once it has passed) and published as
`stepscope_exporter_tls_certificate_expiry_timestamp_seconds`, for an alert before it passes.
"""

import logging
import re
import ssl
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from stepscope.contract import families
from stepscope.exporter import web_config
from stepscope.exporter.exposition import render
from stepscope.exporter.file_watch import FileWatch
from stepscope.exporter.metric_families import GaugeMetricFamily
from stepscope.exporter.web_config import TlsSettings

log = logging.getLogger(__name__)
# web_config's names in ssl's terms: the versions oldest first; NoClientCert, VerifyClientCertIfGiven and
# RequireAndVerifyClientCert
TLS_VERSIONS = dict(zip(web_config.TLS_VERSIONS, (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1,
                                                  ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3), strict=True))
VERIFY_MODES = dict(zip(web_config.CLIENT_AUTH_TYPES, (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED),
                        strict=True))
PEM_BEGIN, PEM_END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


class TlsContextSource:
    """Serves an SSLContext for the settings' files and rebuilds it when any of them changes.

    Checked at most once a second on new connections (`FileWatch`: time, size and inode, as a Secret
    volume's link swap needs); a broken replacement keeps the old context and logs why, so a half-written
    renewal never takes the endpoint down. An encrypted key is
    refused (ValueError) instead of letting OpenSSL prompt for a passphrase on the terminal.
    """

    def __init__(self, settings: TlsSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._files = [FileWatch(path) for path in self._paths()]
        self._context = self._build()
        self._expiry = self._note_expiry()
        self._publish: Callable[[bytes], None] | None = None

    def publish_expiry(self, publish: Callable[[bytes], None]) -> None:
        """Publishes the certificate's expiry through `publish` now and after each reload."""
        self._publish = publish
        self._publish_expiry()

    def context(self) -> ssl.SSLContext:
        """The current context, rebuilt first when a file changed. A failed rebuild or a missing file is
        logged once, not on every connection until the files are fixed (before: a line a second)."""
        with self._lock:
            changes = [(watch.path, watch.poll()) for watch in self._files]
            gone = [path for path, change in changes if change == "gone"]
            if gone:
                log.error("TLS file %s unreadable, keeping the loaded certificate", ", ".join(gone))
            elif any(change == "changed" for _path, change in changes):
                self._reload()
        return self._context

    def _reload(self) -> None:
        try:
            self._context = self._build()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.error("TLS reload failed, keeping the loaded certificate: %s", exc)
            return
        log.info("reloaded TLS certificate %s", self._settings.cert_file)
        self._expiry = self._note_expiry()
        self._publish_expiry()

    def listening_context(self) -> ssl.SSLContext:
        """A context for the listening socket that hands each handshake the current context.

        The server-name callback runs on every ClientHello (with or without SNI), so a renewed
        certificate serves the next connection without restarting the listener.
        """
        context = self._build()

        def use_current(ssl_object: ssl.SSLObject, _server_name: str | None, _context: ssl.SSLContext) -> None:
            ssl_object.context = self.context()

        context.sni_callback = use_current  # type: ignore[assignment]
        return context

    def _paths(self) -> list[str]:
        settings = self._settings
        return [settings.cert_file, settings.key_file, *([settings.client_ca_file] if settings.client_ca_file else [])]

    def _build(self) -> ssl.SSLContext:
        settings = self._settings
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = TLS_VERSIONS[settings.min_version]
        context.maximum_version = TLS_VERSIONS[settings.max_version]
        if settings.prefer_server_ciphers:
            context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        try:
            context.load_cert_chain(settings.cert_file, settings.key_file, password=self._refuse_passphrase)
        except ssl.SSLError as error:
            raise self._chain_error(error) from None
        if settings.client_ca_file:
            try:
                context.load_verify_locations(cafile=settings.client_ca_file)
            except ssl.SSLError as error:
                raise ValueError(f"client CA file {settings.client_ca_file!r} holds no PEM certificate "
                                 f"({_openssl_reason(error)})") from None
        context.verify_mode = VERIFY_MODES[settings.client_auth_type]
        return context

    def _chain_error(self, error: ssl.SSLError) -> ValueError:
        """load_cert_chain's error, naming the file at fault: OpenSSL's (`[SSL] PEM lib`) names neither, so
        the certificate is loaded alone to tell a bad certificate from a bad or mismatched key."""
        cert_file, key_file = self._settings.cert_file, self._settings.key_file
        reason = _openssl_reason(error)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_file)
        except ssl.SSLError:
            return ValueError(f"certificate file {cert_file!r} is not a PEM certificate ({reason})")
        if error.reason == "KEY_VALUES_MISMATCH":
            return ValueError(f"key file {key_file!r} is not the key of certificate file {cert_file!r} ({reason})")
        return ValueError(f"key file {key_file!r} is not a PEM private key ({reason})")

    def _note_expiry(self) -> float | None:
        """The certificate's notAfter (Unix seconds), logged: an error once passed, info before."""
        path = self._settings.cert_file
        try:
            expiry = certificate_expiry(path)
        except (OSError, ValueError, IndexError) as exc:
            log.warning("cannot read the expiry of TLS certificate %s: %s", path, exc)
            return None
        when = datetime.fromtimestamp(expiry, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        if expiry <= time.time():
            log.error("TLS certificate %s expired at %s: clients that verify it refuse to connect; renew it "
                      "(it reloads without a restart)", path, when)
        else:
            log.info("TLS certificate %s is valid until %s", path, when)
        return expiry

    def _publish_expiry(self) -> None:
        if self._publish is None:
            return
        gauge = GaugeMetricFamily(families.TLS_CERTIFICATE_EXPIRY,
                                  "When the served TLS certificate expires (its notAfter), in Unix seconds.")
        if self._expiry is not None:
            gauge.add_metric([], self._expiry)
        self._publish(render([gauge]))

    def _refuse_passphrase(self) -> bytes:
        raise ValueError(f"the key in {self._settings.key_file} is encrypted: give an unencrypted key "
                         "(openssl pkey -in KEY -out PLAIN_KEY)")


def _openssl_reason(error: ssl.SSLError) -> str:
    """OpenSSL's words without the line of CPython's C source they were raised on."""
    return re.sub(r" \(_ssl\.c:\d+\)$", "", str(error))


def certificate_expiry(path: str) -> float:
    """The notAfter of the first certificate in a PEM file, in Unix seconds (the leaf, which is served).

    Python's ssl has no public way to read a certificate it has not received from a peer, so this
    walks the DER: Certificate > TBSCertificate > [version], serial, signature, issuer, validity.
    """
    text = Path(path).read_text(encoding="ascii", errors="replace")
    start = text.index(PEM_BEGIN)
    der = ssl.PEM_cert_to_DER_cert(text[start:text.index(PEM_END, start) + len(PEM_END)])
    _, certificate, _ = _der_element(der, 0)
    _, tbs, _ = _der_element(der, certificate)
    tag, _, offset = _der_element(der, tbs)
    if tag == 0xA0:  # the explicit version; absent in v1 certificates
        tbs = offset
    for _ in range(3):  # serial, signature algorithm, issuer
        tbs = _der_element(der, tbs)[2]
    _, validity, _ = _der_element(der, tbs)
    not_after = _der_element(der, _der_element(der, validity)[2])
    return _der_time(not_after[0], der[not_after[1]:not_after[2]])


def _der_element(der: bytes, offset: int) -> tuple[int, int, int]:
    """(tag, where its content starts, where it ends) of the DER element at `offset`."""
    tag, length = der[offset], der[offset + 1]
    start = offset + 2
    if length & 0x80:
        size = length & 0x7F
        length, start = int.from_bytes(der[start:start + size], "big"), start + size
    return tag, start, start + length


def _der_time(tag: int, value: bytes) -> float:
    """UTCTime (0x17, YYMMDDHHMMSSZ; years 50-99 are 19xx) or GeneralizedTime (0x18, YYYYMMDDHHMMSSZ)."""
    text = value.decode("ascii")
    if tag == 0x17:
        text = ("19" if int(text[:2]) >= 50 else "20") + text
    elif tag != 0x18:
        raise ValueError(f"validity is not a time (DER tag {tag:#x})")
    return datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()
