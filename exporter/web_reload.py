"""The web config file's basic-auth users and response headers, re-read when the file changes.

exporter-toolkit reads its web config on every request, so Prometheus users rotate a password or add
a header by editing the file, without a restart; the exporter does the same, looking at the file
at most once a second (`file_watch`) (a scrape with cached credentials still costs no bcrypt). An
edit that does not load (half-saved, a wrong key, a bad hash) keeps what was loaded and logs why: a
broken file must neither lock Prometheus out nor open the endpoint. Nor does a file that parses but
drops what was configured: an editor that truncates before it writes leaves an empty file, then
`basic_auth_users:` with nothing after it, for a moment. So a reload that would remove every user,
every header or TLS is refused the same way; basic auth and the headers go only when the file says
so (`basic_auth_users: {}`, `headers: {}`), or with a restart. `tls_server_config` is read at start (a
listener cannot switch between HTTP and HTTPS); its certificate files reload (web_tls).
"""

import logging
from collections.abc import Mapping

from stepscope.exporter.file_watch import FileWatch
from stepscope.exporter.web_auth import BcryptUsers, Client
from stepscope.exporter.web_auth_known import KnownGroups
from stepscope.exporter.web_config import WebConfig, WebConfigError, load

log = logging.getLogger(__name__)


class WebConfigSource:
    """The latest web config that loaded from `path`."""

    def __init__(self, path: str, loaded: WebConfig) -> None:
        self._path = path
        self._config = loaded
        self._file = FileWatch(path)

    def current(self) -> WebConfig:
        change = self._file.poll()
        if change == "gone":
            log.error("--web.config.file %s is gone; keeping the loaded users and headers", self._path)
        elif change == "changed":
            self._reload()
        return self._config

    def headers(self) -> Mapping[str, str]:
        """The response headers of `http_server_config.headers` now."""
        return self.current().headers or {}

    def _reload(self) -> None:
        try:
            config = load(self._path)
            _check_nothing_dropped(self._config, config)
        except WebConfigError as exc:
            log.error("--web.config.file %s: %s; keeping the loaded users and headers", self._path, exc)
            return
        if config.tls != self._config.tls:
            log.warning("--web.config.file %s: tls_server_config changed; restart the exporter to apply it "
                        "(its certificate files reload by themselves)", self._path)
        self._config = WebConfig(tls=self._config.tls, users=config.users, headers=config.headers)
        log.info("reloaded --web.config.file %s: %d users, %d headers", self._path, len(config.users or {}),
                 len(config.headers or {}))


def _check_nothing_dropped(loaded: WebConfig, config: WebConfig) -> None:
    """WebConfigError when `config` would silently remove users, headers or TLS that `loaded` has."""
    if loaded.tls is not None and config.tls is None:
        raise WebConfigError("tls_server_config is gone (TLS can be turned off only by a restart)")
    if loaded.users and config.users is None:
        raise WebConfigError("basic_auth_users is gone or empty (to turn basic auth off, say "
                             "basic_auth_users: {})")
    if loaded.headers and config.headers is None:
        raise WebConfigError("http_server_config.headers is gone or empty (to remove them, say headers: {})")


class ReloadingUsers:
    """Basic auth by the users the web config file lists now; open while it lists none (as
    exporter-toolkit: no `basic_auth_users`, no authentication)."""

    def __init__(self, source: WebConfigSource, known: KnownGroups | None = None) -> None:
        self._source = source
        self._config = source.current()
        self._bcrypt = BcryptUsers(self._config.users or {}, known=known)

    async def allows(self, header: str | None, client: Client) -> bool:
        config = self._source.current()
        if config is not self._config:
            self._config = config
            self._bcrypt.replace_users(config.users or {})
        return not config.users or await self._bcrypt.allows(header, client)
