"""The bearer tokens pushes may send: every line of --ingest-token-file, re-read when the file changes.

Kubernetes updates a mounted Secret in place (external-secrets, Vault and `kubectl apply` rotate it
while the exporters run), and training pods read the token at their start. An exporter that read the
file once refused every pod started after a rotation until it was restarted, and a restart refused the
pods started before it. So the file lists every token still in use, one per line, the newest first
(clients send the first line): rotating is writing `NEW` above `OLD`, then, once the pods holding `OLD`
have ended, dropping it. The file is looked at once a second at most (`file_watch`). An edit that
does not load (half-written, empty, gone, a token no header can carry) keeps the tokens loaded and logs
why once: a broken Secret must neither open the push API nor lock every training pod out.
"""

import logging
import threading
import time
from collections.abc import Callable

from stepscope.exporter.file_watch import FileWatch

log = logging.getLogger(__name__)
MAX_TOKEN_BYTES = 8192  # half the request head the exporter takes (http_exchange.MAX_HEAD_BYTES)
MAX_FILE_BYTES = 8 * MAX_TOKEN_BYTES  # a few tokens during a rotation, not a dictionary


def read_tokens(path: str) -> tuple[str, ...]:
    """The tokens in the file at `path`, one per non-blank line, surrounding whitespace dropped; ValueError
    with a one-line reason when the file cannot be read, is not UTF-8 text, holds no token or one too long,
    or one an `Authorization` header cannot carry: an exporter could never be sent it, a client never send it."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"longer than {MAX_FILE_BYTES} bytes: not a list of tokens")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read it as UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not tokens:
        raise ValueError("the file is empty")
    for number, token in enumerate(tokens, start=1):
        if len(token.encode()) > MAX_TOKEN_BYTES:
            raise ValueError(f"the token on line {number} is longer than {MAX_TOKEN_BYTES} bytes: not a token")
        check_token(token)
    return tokens


def first_token(path: str) -> str:
    """The token a client sends from the file at `path`: its first (the newest, during a rotation)."""
    return read_tokens(path)[0]


def check_token(token: str) -> None:
    """ValueError naming the first character of `token` that an HTTP header cannot carry (a header is
    Latin-1 text without control characters; http.client raises UnicodeEncodeError on the rest)."""
    for character in token:
        if not (character == "\t" or " " <= character <= "~" or "\xa0" <= character <= "\xff"):
            raise ValueError(f"the token holds {character!r} (U+{ord(character):04X}), which an HTTP header cannot "
                             "carry: use printable ASCII")


class IngestTokens:
    """The tokens a push may carry: fixed, or those of a file as it is now (`from_file`)."""

    def __init__(self, tokens: tuple[str, ...], path: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tokens = tuple(token.encode() for token in tokens)
        self._file = FileWatch(path, clock) if path is not None else None
        self._lock = threading.Lock()  # one reload at a time; readers take the tuple as it is

    @classmethod
    def from_file(cls, path: str, clock: Callable[[], float] = time.monotonic) -> "IngestTokens":
        """The tokens of the file at `path`, kept up to date; ValueError (one line) when it does not load now."""
        return cls(read_tokens(path), path, clock)

    def matches(self, presented: str) -> bool:
        """Whether `presented` is one of the tokens now (compared in constant time)."""
        self._refresh()
        import hmac  # here: an exporter without an ingest token never loads hashlib (0.74 MiB of RSS)

        candidate = presented.encode()
        return any([hmac.compare_digest(candidate, token) for token in self._tokens])

    def _refresh(self) -> None:
        if self._file is None:
            return
        with self._lock:
            change = self._file.poll()
            if change == "gone":
                log.error("--ingest-token-file %s is gone; keeping the %d loaded tokens", self._file.path,
                          len(self._tokens))
            elif change == "changed":
                self._reload(self._file.path)

    def _reload(self, path: str) -> None:
        try:
            tokens = read_tokens(path)
        except ValueError as exc:
            log.error("--ingest-token-file %s: %s; keeping the %d loaded tokens", path, exc, len(self._tokens))
            return
        self._tokens = tuple(token.encode() for token in tokens)
        log.info("reloaded --ingest-token-file %s: %d tokens", path, len(tokens))
