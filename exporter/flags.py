"""Flags that also read `STEPSCOPE_*` environment variables, validated by argparse types.

argparse runs `type` on string defaults too, so a bad environment value fails exactly like a bad
flag: one line on stderr and exit code 2.
"""

import argparse
import ipaddress
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

ENV_PREFIX = "STEPSCOPE_"


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    default: Any,
    help: str,
    type: Callable[[str], Any] | None = None,
    **kwargs: Any,
) -> None:
    """Adds `--flag`, defaulting to $STEPSCOPE_FLAG when set; the help names the variable."""
    env = env_name(flag)
    value = os.environ.get(env, default)
    parser.add_argument(flag, default=value, type=type, help=f"{help} [env {env}]", **kwargs)


def add_switch(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, *, help: str) -> None:
    """A boolean flag; the variable accepts 1/true/yes/on."""
    env = env_name(flag)
    default = os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {env}]")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    return value


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
    """`HOST:PORT`, `:PORT` (all interfaces) or `[V6]:PORT`."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 1 to 65535")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


def fail(message: str) -> NoReturn:
    """The one-line, exit-2 ending for configuration errors found after parsing."""
    sys.stderr.write(f"stepscope-exporter: error: {message}\n")
    sys.exit(2)
