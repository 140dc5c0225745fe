"""Flags with aliases and `STEPSCOPE_*` environment variables, validated by argparse types.

A setting is one canonical flag (the Prometheus convention, `--web.listen-address`), its aliases
(the flags of earlier releases, `--listen-address`) and the environment variables that set it
when no flag does. Precedence: a flag, then a variable, then the default. Two spellings of one
setting given at the same level with different values are an error, never a silent pick. A bad
value ends with one line on stderr and exit code 2, naming what the user wrote: the flag, or the
variable when the value came from the environment.
"""

import argparse
import ipaddress
import os
import re
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

ENV_PREFIX = "STEPSCOPE_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")

Convert = Callable[[str], Any]


@dataclass(frozen=True)
class Source:
    """Where a setting's value came from: `flag` (a command-line option) or `env` (a variable)."""

    level: str
    name: str
    value: Any


class _Setting(argparse.Action):
    """A valued flag; remembers which spelling set it so aliases that disagree are caught."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, envs: Sequence[str], raw_default: str | None,
                 convert: Convert | None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=None, type=convert, **kwargs)
        self.envs = tuple(envs)
        self.raw_default = raw_default
        self.convert = convert or (lambda text: text)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _record(parser, namespace, self.dest, Source("flag", option_string or self.dest, values))


class _Toggle(argparse.Action):
    """An on/off flag: `--x` and `--no-x` (plus aliases), and boolean variables; a variable named after
    an alias that turns the setting off (STEPSCOPE_NO_X) reads the other way round."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, values_by_flag: dict[str, bool],
                 envs: Sequence[str], inverted_envs: Sequence[str], raw_default: bool | None,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=None, **kwargs)
        self.values_by_flag = values_by_flag
        self.envs = (*envs, *inverted_envs)
        self.inverted_envs = frozenset(inverted_envs)
        self.raw_default = raw_default
        self.convert = boolean

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        assert option_string is not None
        _record(parser, namespace, self.dest, Source("flag", option_string, self.values_by_flag[option_string]))


def _record(parser: argparse.ArgumentParser, namespace: argparse.Namespace, dest: str, source: Source) -> None:
    sources: dict[str, Source] = namespace.__dict__.setdefault("_sources", {})
    earlier = sources.get(dest)
    if earlier is not None and earlier.name != source.name and earlier.value != source.value:
        parser.error(f"{earlier.name} and {source.name} set the same thing to different values: give one of them")
    sources[dest] = source
    setattr(namespace, dest, source.value)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line, and which fills unset settings from the environment.
    Flags are never abbreviated: a prefix that matches today may be ambiguous after the next release."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        sources: dict[str, Source] = parsed.__dict__.setdefault("_sources", {})
        for action in self._actions:
            if isinstance(action, (_Setting, _Toggle)) and action.dest not in sources:
                self._from_environment(parsed, action, sources)
        return parsed

    def _from_environment(self, parsed: argparse.Namespace, action: "_Setting | _Toggle",
                          sources: dict[str, Source]) -> None:
        found: Source | None = None
        for env in action.envs:
            if env not in os.environ:
                continue
            try:
                value = action.convert(os.environ[env])
            except argparse.ArgumentTypeError as exc:
                self.error(f"environment variable {env}={os.environ[env]!r}: {exc}")
            if env in getattr(action, "inverted_envs", ()):
                value = not value
            if found is not None and found.value != value:
                self.error(f"{found.name} and {env} set the same thing to different values: set one of them")
            found = found or Source("env", env, value)
        if found is not None:
            sources[action.dest] = found
            setattr(parsed, action.dest, found.value)
        elif isinstance(action.raw_default, str):
            setattr(parsed, action.dest, action.convert(action.raw_default))
        else:
            setattr(parsed, action.dest, action.raw_default)


def source_of(args: argparse.Namespace, dest: str) -> Source | None:
    """The flag or variable that set `dest`; None when it has its default."""
    return args.__dict__.get("_sources", {}).get(dest)


def env_name(flag: str) -> str:
    """`--web.listen-address` -> `STEPSCOPE_WEB_LISTEN_ADDRESS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").replace(".", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    default: str | None,
    help: str,
    type: Convert | None = None,
    aliases: Sequence[str] = (),
    envs: Sequence[str] | None = None,
    **kwargs: Any,
) -> None:
    """Adds `flag` (and its aliases), set when absent by the first of `envs` present (default: the
    variable named after each spelling), else by `default`; the help names the aliases and variables."""
    envs = tuple(envs if envs is not None else dict.fromkeys(env_name(f) for f in (flag, *aliases)))
    parser.add_argument(flag, *aliases, action=_Setting, envs=envs, raw_default=default, convert=type,
                        help=_help(help, default, aliases, envs), **kwargs)


def add_toggle(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    default: bool | None,
    help: str,
    off_aliases: Sequence[str] = (),
    envs: Sequence[str] | None = None,
    dest: str | None = None,
) -> None:
    """Adds `--flag` and `--no-flag` (plus `off_aliases` that turn it off); a variable in `envs` takes a
    boolean, and so does the one named after each off alias, the other way round. A None default leaves
    the setting unset when no flag or variable gives it."""
    name = flag.removeprefix("--")
    off = f"--no-{name}"
    envs = tuple(envs if envs is not None else (env_name(flag),))
    inverted_envs = tuple(env_name(alias) for alias in off_aliases)
    values_by_flag = {flag: True, off: False, **dict.fromkeys(off_aliases, False)}
    shown_default = "on" if default else "off" if default is False else None
    shown_envs = [*envs, *(f"{env} (1 turns it off)" for env in inverted_envs)]
    parser.add_argument(flag, off, *off_aliases, action=_Toggle, values_by_flag=values_by_flag, envs=envs,
                        inverted_envs=inverted_envs, raw_default=default,
                        dest=dest or name.replace(".", "_").replace("-", "_"),
                        help=_help(help, shown_default, off_aliases, shown_envs))


def _help(text: str, default: str | None, aliases: Sequence[str], envs: Sequence[str]) -> str:
    parts = [text]
    if default not in (None, ""):
        parts.append(f"(default: {default})")
    tags = []
    if aliases:
        tags.append(f"alias {', '.join(aliases)}")
    if envs:
        tags.append(f"env {', '.join(envs)}")
    return " ".join(parts).replace("%", "%%") + (f" [{'; '.join(tags)}]" if tags else "")


def choice(*words: str) -> Convert:
    """A converter that admits only `words` (argparse's `choices` would not check a variable)."""

    def convert(text: str) -> str:
        if text not in words:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(words)}")
        return text

    return convert


def boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (1/true/yes/on or 0/false/no/off)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def seconds_between(low: float, high: float) -> Callable[[str], float]:
    """A flag's type for a number of seconds from `low` to `high`: an interval of 1e-9 s spun a core, and
    one past what a thread can wait (1e308) killed the collector threads with OverflowError while the
    exporter served its first reading for ever."""

    def seconds(text: str) -> float:
        value = positive_float(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be from {_plain(low)} to {_plain(high)} seconds")
        return value

    return seconds


def _plain(number: float) -> str:
    """2592000 rather than 2.592e+06, 0.1 as it is."""
    return str(int(number)) if number == int(number) else f"{number:g}"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    return value


def regex(text: str) -> str:
    """A regular expression Python's re compiles."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {exc}") from None
    return text


def directory(text: str) -> str:
    """An existing directory, as an absolute path with its links resolved."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return os.path.realpath(text)


def unix_socket(text: str) -> str:
    """A unix socket's path made absolute ("" stays "": off), also written as a URL, `unix:///path`, as the kubelet's
    own configuration writes it. gRPC read a relative path as a URL's host and `unix:///path` as a path under
    `unix:`: either started and failed every cycle with 'the target uri is not valid'. A path that exists and is no
    socket (its directory, a file) is refused, as it can never answer; a missing one is taken (the kubelet may
    start later)."""
    path = text.removeprefix("unix://")
    if not path:
        return ""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return os.path.abspath(path)
    if stat.S_ISDIR(mode):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a socket: give the socket in it, e.g. "
                                         f"{os.path.join(path, 'kubelet.sock')}")
    if not stat.S_ISSOCK(mode):
        raise argparse.ArgumentTypeError(f"{text!r} is not a unix socket")
    return os.path.abspath(path)


def readable_file(text: str) -> str:
    try:
        with open(text, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror or exc}") from None
    return text


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def cidr_list(text: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for item in comma_list(text):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an IP address or CIDR network") from None
    return networks


def listen_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT`; the host "" for `:PORT`: every interface, IPv6 and IPv4 alike
    where the node has IPv6 (server.listen). An IPv6 address outside brackets is refused, not guessed:
    `::1:9847` is also the address ::1:9847 with no port, and took the last group for the port."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        return _bracketed_ipv6(text, host[1:-1]), int(port_text)
    if ":" in host or "[" in host or "]" in host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT: write an IPv6 address in brackets, "
                                         f"e.g. [::1]:{port_text} ([::]:{port_text} or :{port_text}: every address)")
    return host, int(port_text)


def _bracketed_ipv6(text: str, host: str) -> str:
    """The IPv6 address (with its %zone, if any) inside `[...]`."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {host!r} in brackets is not an IPv6 address") from None
    return host


def fail(message: str) -> NoReturn:
    """The one-line, exit-2 ending for configuration errors found after parsing."""
    sys.stderr.write(f"stepscope-exporter: error: {message}\n")
    sys.exit(2)
