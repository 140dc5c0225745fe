"""`--web.config.file`: the exporter-toolkit web configuration (TLS, basic auth, response headers).

The same YAML that node_exporter, the Pushgateway and Prometheus read, so one file serves a whole
fleet. Keys are checked as strictly as exporter-toolkit does (an unknown key is an error naming it
and its line, never ignored); relative file names are relative to the file's directory. The few
exporter-toolkit keys that Python's `ssl` cannot honour the same way (Go cipher suite and curve
names, inline PEM, SAN allow-lists, rate limits) are refused by name rather than half-applied.
The TLS settings keep exporter-toolkit's names; `exporter.web_tls` turns them into `ssl`'s values, so
reading a file without TLS never loads `ssl` (see `exporter.plain_http`).
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import yaml


TLS_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")  # oldest first
# exporter-toolkit's client_auth_type values that Python's ssl can enforce; the two that accept an
# unverified certificate (RequestClientCert, RequireClientCert) have no ssl equivalent
CLIENT_AUTH_TYPES = ("NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
# exporter-toolkit allows only these response headers, some with fixed values
HEADER_VALUES: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")  # what a response header carries as it is: no line breaks, no UTF-8
BCRYPT_HASH = re.compile(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")

TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
            "prefer_server_cipher_suites")
UNSUPPORTED = {
    "tls_server_config.cert": "give the certificate as cert_file",
    "tls_server_config.key": "give the key as key_file",
    "tls_server_config.client_ca": "give the CA as client_ca_file",
    "tls_server_config.cipher_suites": "Python's ssl uses OpenSSL's defaults; set min_version instead",
    "tls_server_config.curve_preferences": "Python's ssl uses OpenSSL's defaults",
    "tls_server_config.client_allowed_sans": "use client_ca_file with a CA that signs only allowed clients",
    "rate_limit": "rate limiting is not implemented; put a reverse proxy in front",
}
SCHEMA: dict[str, Any] = {
    "tls_server_config": {**dict.fromkeys(TLS_KEYS), **dict.fromkeys(k.split(".")[1] for k in UNSUPPORTED if "." in k)},
    "http_server_config": {"http2": None, "headers": None},
    "basic_auth_users": None,
    "rate_limit": None,
}


class WebConfigError(ValueError):
    """A one-line reason why the file cannot be used."""


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    client_auth_type: str = "NoClientCert"  # one of CLIENT_AUTH_TYPES
    min_version: str = "TLS12"  # one of TLS_VERSIONS
    max_version: str = "TLS13"
    prefer_server_ciphers: bool = True


@dataclass(frozen=True)
class WebConfig:
    """What the file says. `users` and `headers` are None where the file names none (the key absent,
    or with nothing after it) and {} only where it says so (`basic_auth_users: {}`, `headers: {}`): a
    reload tells a half-written file from one that turns basic auth or the headers off on purpose."""

    tls: TlsSettings | None = None
    users: Mapping[str, str] | None = None  # user -> bcrypt hash
    headers: Mapping[str, str] | None = None


def load(path: str) -> WebConfig:
    """Reads and checks the file; raises WebConfigError with the key (and line) at fault."""
    import yaml  # here: an exporter without --web.config.file never loads it (0.9 MiB of RSS)

    try:
        text = Path(path).read_text(encoding="utf-8")
        root = yaml.compose(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise WebConfigError(f"cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    except yaml.YAMLError as exc:
        raise WebConfigError(f"not YAML: {' '.join(str(exc).split())}") from None
    if root is None:
        return WebConfig()
    _check_no_duplicate_keys(root)
    _check_keys(root, SCHEMA, "")
    data = yaml.safe_load(text)
    base = Path(path).resolve().parent
    return WebConfig(
        tls=_tls(data.get("tls_server_config"), base),
        users=_users(data.get("basic_auth_users")),
        headers=_headers(data.get("http_server_config")),
    )


def _check_no_duplicate_keys(node: "yaml.Node") -> None:
    """A key given twice is refused, as exporter-toolkit's strict reading does: YAML loaders keep the last one,
    so a second `basic_auth_users:` would drop the first one's users without a word."""
    import yaml  # loaded by load() already

    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.value in first:
                raise WebConfigError(f"line {line}: key {key_node.value!r} appears twice (first on line "
                                     f"{first[key_node.value]})")
            first.setdefault(str(key_node.value), line)
            _check_no_duplicate_keys(value_node)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_no_duplicate_keys(item)


def _check_keys(node: "yaml.Node", schema: dict[str, Any], prefix: str) -> None:
    import yaml  # loaded by load() already

    if not isinstance(node, yaml.MappingNode):
        where = prefix.rstrip(".") or "the file"
        raise WebConfigError(f"line {node.start_mark.line + 1}: {where} must be a mapping of keys")
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        if key_node.value not in schema:
            known = ", ".join(k for k in schema if f"{prefix}{k}" not in UNSUPPORTED)
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: unknown key {key!r} (known: {known})")
        if key in UNSUPPORTED:
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: {key!r} is not supported by "
                                 f"stepscope-exporter: {UNSUPPORTED[key]}")
        child = schema[key_node.value]
        empty = isinstance(value_node, yaml.ScalarNode) and value_node.tag.endswith(":null")
        if isinstance(child, dict) and not empty:
            _check_keys(value_node, child, f"{key}.")


def _tls(section: dict[str, Any] | None, base: Path) -> TlsSettings | None:
    if not section:
        return None
    files = {name: _path(section, name, base) for name in ("cert_file", "key_file", "client_ca_file")}
    if not files["cert_file"] or not files["key_file"]:
        missing = "cert_file" if not files["cert_file"] else "key_file"
        raise WebConfigError(f"tls_server_config: missing {missing}")
    auth_name = str(section.get("client_auth_type") or "NoClientCert")
    if auth_name not in CLIENT_AUTH_TYPES:
        raise WebConfigError(f"tls_server_config.client_auth_type {auth_name!r} is not one of "
                             f"{', '.join(CLIENT_AUTH_TYPES)} (certificates that are not verified are not accepted)")
    if files["client_ca_file"] and auth_name == "NoClientCert":
        raise WebConfigError("tls_server_config: client_ca_file is set but client_auth_type is NoClientCert: "
                             "set client_auth_type: RequireAndVerifyClientCert")
    if auth_name != "NoClientCert" and not files["client_ca_file"]:
        raise WebConfigError(f"tls_server_config: client_auth_type {auth_name} needs client_ca_file")
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError("tls_server_config.prefer_server_cipher_suites must be true or false")
    settings = TlsSettings(
        cert_file=files["cert_file"], key_file=files["key_file"], client_ca_file=files["client_ca_file"],
        client_auth_type=auth_name, min_version=_version(section, "min_version", "TLS12"),
        max_version=_version(section, "max_version", "TLS13"), prefer_server_ciphers=prefer,
    )
    if TLS_VERSIONS.index(settings.min_version) > TLS_VERSIONS.index(settings.max_version):
        raise WebConfigError("tls_server_config: min_version is above max_version")
    return settings


def _path(section: dict[str, Any], name: str, base: Path) -> str | None:
    value = section.get(name)
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise WebConfigError(f"tls_server_config.{name} must be a file name")
    return str(base / value)


def _version(section: dict[str, Any], name: str, default: str) -> str:
    value = str(section.get(name) or default)
    if value not in TLS_VERSIONS:
        raise WebConfigError(f"tls_server_config.{name} {value!r} is not one of {', '.join(TLS_VERSIONS)}")
    return value


def _users(section: dict[str, Any] | None) -> dict[str, str] | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise WebConfigError("basic_auth_users must be a mapping of user names to bcrypt hashes")
    users = {}
    for user, hashed in section.items():
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            raise WebConfigError(f"basic_auth_users.{user}: not a bcrypt hash (make one with "
                                 "htpasswd -nBC 10 '' | tr -d ':\\n')")
        users[str(user)] = hashed
    return users


def _headers(section: dict[str, Any] | None) -> dict[str, str] | None:
    http = section or {}
    if not isinstance(http.get("http2", True), bool):
        raise WebConfigError("http_server_config.http2 must be true or false")
    headers = http.get("headers")
    if headers is None:
        return None
    if not isinstance(headers, dict):
        raise WebConfigError("http_server_config.headers must be a mapping of header names to values")
    for name, value in headers.items():
        if name not in HEADER_VALUES:
            raise WebConfigError(f"http_server_config.headers: {name!r} can not be configured (only "
                                 f"{', '.join(HEADER_VALUES)})")
        if value is None:  # `Name:` and nothing after it, as a file cut short mid-write reads
            raise WebConfigError(f"http_server_config.headers.{name}: no value")
        allowed = HEADER_VALUES[name]
        if not HEADER_VALUE.fullmatch(str(value)):
            raise WebConfigError(f"http_server_config.headers.{name}: {value!r} holds characters a response header "
                                 "can not carry (visible ASCII, spaces and tabs only)")
        if allowed and value not in allowed:
            raise WebConfigError(f"http_server_config.headers.{name}: {value!r} is not one of {', '.join(allowed)}")
    return {str(name): str(value) for name, value in headers.items() if value != ""}
