"""`stepscope-exporter`: flags, the clear one-line failures for bad configuration, and what to load.

Everything here runs before the server's modules are imported: with no TLS configured, `ssl` is kept
unloaded (exporter.plain_http) before asyncio would load it. `exporter.daemon` wires and serves.
"""

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from stepscope.exporter import __version__, ingest
from stepscope.exporter.collectors.gpu_slow import DEFAULT_INTERVAL_SECONDS
from stepscope.exporter.collectors.node import DEFAULT_NETDEV_EXCLUDE
from stepscope.exporter.flags import (
    OneLineErrorParser,
    add_flag,
    add_toggle,
    choice,
    comma_list,
    directory,
    fail,
    listen_address,
    positive_int,
    readable_file,
    regex,
    seconds_between,
    source_of,
    unix_socket,
)
from stepscope.exporter.ingest import PROFILE_PREFIX
from stepscope.exporter.plain_http import keep_ssl_unloaded
from stepscope.exporter.web_config import TlsSettings, WebConfig, WebConfigError, load

COLLECTOR_NAMES = ("node", "gpu", "process")
# Hardware readings at most ten times a second (each cycle costs the node: 0.85 ms per GPU on an H100) and at
# least once an hour; 1e-9 spun a core, 1e308 overflowed every collector thread's wait.
MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS = 0.1, 3600.0
DEFAULT_PORT = 9847
RESERVED_PATHS = ("/", "/-/healthy", "/-/ready", PROFILE_PREFIX)
FILE_FLAGS = {"--web.config.file": "web_config_file", "--tls-cert-file": "tls_cert_file",
              "--tls-key-file": "tls_key_file", "--basic-auth-password-file": "basic_auth_password_file",
              "--ingest-token-file": "ingest_token_file",
              "--kubelet-pod-resources-socket": "kubelet_pod_resources_socket"}
TLS_FILES = ("cert_file", "key_file", "client_ca_file")


def collector_list(text: str) -> list[str]:
    names = comma_list(text)
    unknown = [n for n in names if n not in COLLECTOR_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown collector {unknown[0]!r} (known: {', '.join(COLLECTOR_NAMES)})"
        )
    return names


def telemetry_path(text: str) -> str:
    """Where /metrics moves to: an absolute path that no other endpoint (or the push API) uses."""
    if not text.startswith("/") or text in RESERVED_PATHS or text.startswith(("/metrics/", PROFILE_PREFIX + "/")):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a path starting with '/', other than /, /-/healthy, /-/ready and the push "
            "and profile APIs (/metrics/job/..., /api/v1/profiles)"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="stepscope-exporter",
        description=(
            "Publishes node, GPU and per-process metrics and the step timings pushed by training "
            "hooks for Prometheus. Works without a GPU: GPU families are then absent and "
            "stepscope_gpu_collector_up is 0. A flag wins over its environment variables (named in "
            "its help); an alias (a flag of earlier releases) works like the flag it stands for."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    web = parser.add_argument_group("web")
    add_flag(web, "--web.listen-address", aliases=["--listen-address"], default=f":{DEFAULT_PORT}",
             type=listen_address, dest="listen_address",
             help="HOST:PORT to serve metrics, health and the push API on; ':PORT': every address, IPv6 and IPv4 "
                  "(IPv4 alone where the node has no IPv6); an IPv6 address in brackets ('[::1]:PORT')")
    add_flag(web, "--web.telemetry-path", default="/metrics", type=telemetry_path, dest="telemetry_path",
             help="path of the metrics endpoint (the push API stays at /metrics/job/...)")
    add_flag(web, "--web.config.file", default=None, type=readable_file, dest="web_config_file",
             help="exporter-toolkit web config YAML: tls_server_config, basic_auth_users (bcrypt), "
                  "http_server_config.headers; users and headers are re-read when the file changes, "
                  "the certificate files when they do (tls_server_config itself at start)")
    add_flag(web, "--web.auth.state-file", default="", dest="web_auth_state_file",
             help="file (created; its directory must exist) where the exporter keeps the address groups, an "
                  "IPv4 address or IPv6 /64, that basic auth of --web.config.file let in over the last 7 days "
                  "(no users, passwords or hashes), so that after a restart their logins go ahead of a "
                  "wrong-password flood; empty: kept in memory only")
    add_flag(web, "--web.max-connections", aliases=["--web-max-connections"], default="512", type=positive_int,
             dest="web_max_connections", help="most client connections open at once; more get 503 and are closed")
    legacy = parser.add_argument_group(
        "web, older flags", "TLS and basic auth without a web config file (not together with --web.config.file)")
    add_flag(legacy, "--tls-cert-file", default=None, type=readable_file,
             help="PEM certificate to serve HTTPS; reloaded when the file changes")
    add_flag(legacy, "--tls-key-file", default=None, type=readable_file, help="PEM private key for --tls-cert-file")
    add_flag(legacy, "--basic-auth-user", default=None,
             help="require HTTP basic auth with this user on the metrics endpoint (health probes stay open)")
    add_flag(legacy, "--basic-auth-password-file", default=None, type=readable_file,
             help="file holding the basic auth password in clear (trailing newline ignored)")

    collection = parser.add_argument_group("collection")
    add_flag(collection, "--collectors", default=",".join(COLLECTOR_NAMES), type=collector_list,
             help=f"comma-separated collectors to run, from: {', '.join(COLLECTOR_NAMES)}; "
                  "--collector.NAME / --no-collector.NAME switch one on or off")
    for name in COLLECTOR_NAMES:
        add_toggle(collection, f"--collector.{name}", default=None, dest=f"collector_{name}",
                   help=f"run the {name} collector, or not (--no-collector.{name})")
    add_toggle(collection, "--collector.gpu.pcie-poll", default=True, off_aliases=["--no-gpu-pcie-poll"],
               dest="gpu_pcie_poll",
               help="on GPUs without GPM (pre-Hopper) poll nvmlDeviceGetPcieThroughput, which blocks 20 ms per "
                    "direction, every 10 s on a background thread; off: publish no PCIe throughput for them")
    add_flag(collection, "--collector.gpu.slow-interval", default=str(DEFAULT_INTERVAL_SECONDS),
             type=seconds_between(MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS), dest="gpu_slow_interval",
             help="seconds between the slow NVML readings (energy, clock-event time, pre-Hopper PCIe), taken on "
                  "their own thread: the energy read takes about 3 ms per GPU on an H100")
    add_flag(collection, "--collect-interval", default="5",
             type=seconds_between(MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS),
             help=f"seconds between hardware readings, {MIN_INTERVAL_SECONDS:g} to {MAX_INTERVAL_SECONDS:g}; "
                  "scrapes serve the latest reading")
    add_flag(collection, "--kubelet-pod-resources-socket", default="", type=unix_socket,
             help="the kubelet's PodResources socket (Kubernetes, e.g. /var/lib/kubelet/pod-resources/kubelet.sock, or "
                  "unix:///var/lib/kubelet/pod-resources/kubelet.sock): "
                  "label GPUs and training processes with their pod, namespace and container; empty: off")
    add_flag(collection, "--filesystem-paths", default="/", type=comma_list,
             help="comma-separated paths (dataset, cache, checkpoint dirs) whose filesystem size "
                  "and free space to publish, as the node names them (see --path.rootfs)")
    add_toggle(collection, "--collector.node.host-network", default=False, dest="node_host_network",
               help="read the network counters of PID 1's namespace (/proc/1/net/dev): the node's, where the exporter "
                    "shares the node's PID namespace but not its network (the Helm chart's hostPID without "
                    "hostNetwork, compose's pid: host); off: the exporter's own namespace")
    add_flag(collection, "--collector.node.netdev-exclude", default=DEFAULT_NETDEV_EXCLUDE, type=regex,
             dest="node_netdev_exclude",
             help="network interfaces left out, a regular expression matched at the start of the name (default: "
                  "containers' veth pairs, CNI bridges and tunnels, whose traffic the physical interfaces carry "
                  "too); empty: none")
    add_flag(collection, "--path.rootfs", default="/", type=directory, dest="path_rootfs",
             help="where the node's root filesystem is mounted in a container running the exporter (node_exporter's "
                  "flag; the Helm chart mounts it at /host/root): --filesystem-paths are read under it, symbolic "
                  "links followed as on the node, and labelled with the node's paths")

    ingest.add_flags(parser.add_argument_group("push API (training hooks)"))

    add_flag(parser, "--log.level", aliases=["--log-level"], default="info", dest="log_level",
             type=choice("debug", "info", "warning", "error"), help="log verbosity: debug, info, warning, error")
    return parser


def enabled_collectors(args: argparse.Namespace) -> list[str]:
    """--collectors, then each --collector.NAME / --no-collector.NAME; a switch set on the command line
    beats a list from the environment, and one that contradicts a list given beside it is an error."""
    enabled = list(args.collectors)
    listed_by = source_of(args, "collectors")
    for name in COLLECTOR_NAMES:
        switch = source_of(args, f"collector_{name}")
        if switch is None or switch.value == (name in enabled):
            continue
        if listed_by is not None and listed_by.level == switch.level:
            fail(f"{listed_by.name} {','.join(args.collectors) or '(none)'!s} and {switch.name} disagree about "
                 f"the {name} collector: give one of them")
        if listed_by is not None and listed_by.level == "flag":
            continue  # a flag beats a variable
        enabled = [n for n in enabled if n != name] + ([name] if switch.value else [])
    return [name for name in COLLECTOR_NAMES if name in enabled]


def _web_config(args: argparse.Namespace) -> tuple[WebConfig, TlsSettings | None]:
    """--web.config.file or the older flags, checked (one line on conflict), and the TLS they configure."""
    legacy = [flag for flag in ("--tls-cert-file", "--tls-key-file", "--basic-auth-user", "--basic-auth-password-file")
              if getattr(args, flag[2:].replace("-", "_"))]
    config = WebConfig()
    if args.web_config_file:
        if legacy:
            fail(f"{legacy[0]} and --web.config.file both configure the web server: put it in the web config file")
        try:
            config = load(args.web_config_file)
        except WebConfigError as exc:
            fail(f"--web.config.file {args.web_config_file}: {exc}")
    elif bool(args.tls_cert_file) != bool(args.tls_key_file):
        fail("--tls-cert-file and --tls-key-file must be given together")
    elif bool(args.basic_auth_user) != bool(args.basic_auth_password_file):
        fail("--basic-auth-user and --basic-auth-password-file must be given together")
    return config, config.tls or (TlsSettings(args.tls_cert_file, args.tls_key_file) if args.tls_cert_file else None)


def _files_read(args: argparse.Namespace, tls_settings: TlsSettings | None) -> list[tuple[str, str]]:
    """(setting, path) of every file the flags and the web config name for the exporter to read."""
    named = [(flag, getattr(args, dest)) for flag, dest in FILE_FLAGS.items()]
    if tls_settings is not None and args.web_config_file:
        named += [(f"tls_server_config.{key} of --web.config.file", getattr(tls_settings, key)) for key in TLS_FILES]
    return [(name, path) for name, path in named if path]


def _check_state_file(args: argparse.Namespace, tls_settings: TlsSettings | None) -> None:
    """--web.auth.state-file only with --web.config.file, whose basic auth it serves; and it is replaced at the
    first login: where it is a file another setting names (the web config given twice), that file would be
    lost, so it is one line at start instead."""
    state_file = args.web_auth_state_file
    if state_file and not args.web_config_file:  # before: accepted and never read or written, without a word
        fail(f"--web.auth.state-file {state_file!r} keeps what basic auth of --web.config.file let in: give "
             "--web.config.file too, or leave the state file out")
    if not state_file or not os.path.exists(state_file):
        return
    for name, path in _files_read(args, tls_settings):
        try:
            same = os.path.samefile(state_file, path)
        except OSError:  # that file is missing: its own check says so
            continue
        if same:
            fail(f"--web.auth.state-file {state_file!r} is the file of {name}: the exporter rewrites its state "
                 "file, give it a path of its own")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.collectors = enabled_collectors(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config, tls_settings = _web_config(args)
    _check_state_file(args, tls_settings)
    if tls_settings is None:
        keep_ssl_unloaded()
    from stepscope.exporter.daemon import serve  # after that choice: the server's asyncio imports ssl

    return serve(args, config, tls_settings)
