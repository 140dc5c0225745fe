"""Keeps Python's `ssl`, and with it OpenSSL's libssl and libcrypto, out of an exporter serving plain HTTP.

asyncio imports `ssl` as it is imported, whether or not any listener uses TLS: 4.2 MiB of RSS for an
exporter that has none configured, about a twelfth of what the exporter holds on an H100 node, where
issue 20's budget is nvitop-exporter's RSS. The listener's scheme is chosen at start (a reload cannot
switch it), so the choice is final. What else wants `ssl` in such a process takes the same path as on
a Python built without it: asyncio, http.client and urllib check for the ImportError.
"""

import sys


def keep_ssl_unloaded() -> None:
    """Marks `ssl` absent, so `import ssl` raises ImportError: None in sys.modules is the import system's
    documented way to say so. Does nothing where `ssl` was already imported."""
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]
