"""TLS for the exporter's port: an SSLContext built from `TlsSettings`, rebuilt when its files change.

Certificates are renewed in place (cert-manager, a cron'd certbot); the exporter keeps serving
through a renewal without a restart, and never through a half-written one.
"""

import logging
import os
import ssl
import threading
import time

from exporter.web_config import TlsSettings

log = logging.getLogger(__name__)


class TlsContextSource:
    """Serves an SSLContext for the settings' files and rebuilds it when any of them changes.

    Checked at most once a second on new connections; a broken replacement keeps the old context
    and logs why, so a half-written renewal never takes the endpoint down. An encrypted key is
    refused (ValueError) instead of letting OpenSSL prompt for a passphrase on the terminal.
    """

    def __init__(self, settings: TlsSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._checked_at = 0.0
        self._stamp = self._file_stamp()
        self._context = self._build()

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked_at >= 1.0:
            with self._lock:
                self._checked_at = now
                try:
                    stamp = self._file_stamp()
                except OSError as exc:
                    log.error("TLS files unreadable, keeping the loaded certificate: %s", exc)
                    return self._context
                if stamp != self._stamp:
                    try:
                        self._context = self._build()
                        self._stamp = stamp
                        log.info("reloaded TLS certificate %s", self._settings.cert_file)
                    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                        log.error("TLS reload failed, keeping the loaded certificate: %s", exc)
        return self._context

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

    def _files(self) -> list[str]:
        settings = self._settings
        return [settings.cert_file, settings.key_file, *([settings.client_ca_file] if settings.client_ca_file else [])]

    def _file_stamp(self) -> tuple[float, ...]:
        return tuple(os.stat(path).st_mtime for path in self._files())

    def _build(self) -> ssl.SSLContext:
        settings = self._settings
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = settings.min_version
        context.maximum_version = settings.max_version
        if settings.prefer_server_ciphers:
            context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        context.load_cert_chain(settings.cert_file, settings.key_file, password=self._refuse_passphrase)
        if settings.client_ca_file:
            context.load_verify_locations(cafile=settings.client_ca_file)
        context.verify_mode = settings.client_auth
        return context

    def _refuse_passphrase(self) -> bytes:
        raise ValueError(f"the key in {self._settings.key_file} is encrypted: give an unencrypted key "
                         "(openssl pkey -in KEY -out PLAIN_KEY)")
