"""`stepscope-exporter`: flags, wiring, and the clear one-line failures for bad configuration."""

import argparse
import logging
import sys
from collections.abc import Sequence

from exporter import __version__, ingest
from exporter.collectors import Collector
from exporter.exposition import ExpositionStore
from exporter.flags import (
    OneLineErrorParser,
    add_flag,
    add_switch,
    comma_list,
    fail,
    listen_address,
    positive_float,
    positive_int,
    readable_file,
)
from exporter.gpu_processes import GpuProcessTable
from exporter.scheduler import Scheduler
from exporter.server import BasicAuth, ExporterServer, TlsContextSource, WebLimits

COLLECTOR_NAMES = ("node", "gpu", "process")
DEFAULT_PORT = 9847

log = logging.getLogger("exporter")


def collector_list(text: str) -> list[str]:
    names = comma_list(text)
    unknown = [n for n in names if n not in COLLECTOR_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown collector {unknown[0]!r} (known: {', '.join(COLLECTOR_NAMES)})"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="stepscope-exporter",
        description=(
            "Publishes node, GPU and per-process metrics and the step timings pushed by training "
            "hooks on /metrics for Prometheus. Works without a GPU: GPU families are then absent "
            "and stepscope_gpu_collector_up is 0. Every flag can also be set by the environment "
            "variable named in its help."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    web = parser.add_argument_group("web")
    add_flag(web, "--listen-address", default=f"0.0.0.0:{DEFAULT_PORT}", type=listen_address,
             help="HOST:PORT to serve /metrics, health and the push API on ('[::]:PORT' for IPv6)")
    add_flag(web, "--tls-cert-file", default=None, type=readable_file,
             help="PEM certificate to serve HTTPS; reloaded when the file changes")
    add_flag(web, "--tls-key-file", default=None, type=readable_file,
             help="PEM private key for --tls-cert-file")
    add_flag(web, "--basic-auth-user", default=None,
             help="require HTTP basic auth with this user on /metrics (health probes stay open)")
    add_flag(web, "--basic-auth-password-file", default=None, type=readable_file,
             help="file holding the basic auth password (trailing newline ignored)")
    add_flag(web, "--web-max-connections", default="512", type=positive_int,
             help="most client connections open at once; more get 503 and are closed")

    collection = parser.add_argument_group("collection")
    add_flag(collection, "--collectors", default=",".join(COLLECTOR_NAMES), type=collector_list,
             help=f"comma-separated collectors to run, from: {', '.join(COLLECTOR_NAMES)}")
    add_flag(collection, "--collect-interval", default="5", type=positive_float,
             help="seconds between hardware readings; scrapes serve the latest reading")
    add_flag(collection, "--filesystem-paths", default="/", type=comma_list,
             help="comma-separated paths (dataset, cache, checkpoint dirs) whose filesystem size "
                  "and free space to publish")
    add_switch(collection, "--no-gpu-pcie-poll",
               help="publish no PCIe throughput for GPUs without GPM (pre-Hopper) rather than poll "
                    "nvmlDeviceGetPcieThroughput, which blocks 20 ms per direction, every 10 s on a "
                    "background thread")

    ingest.add_flags(parser.add_argument_group("push API (training hooks)"))

    add_flag(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"],
             help="log verbosity")
    return parser


def _check_combinations(args: argparse.Namespace) -> None:
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        fail("--tls-cert-file and --tls-key-file must be given together")
    if bool(args.basic_auth_user) != bool(args.basic_auth_password_file):
        fail("--basic-auth-user and --basic-auth-password-file must be given together")


def _build_collectors(
    args: argparse.Namespace, push_api: ingest.PushApi
) -> list[Collector]:
    gpu_processes = GpuProcessTable()
    collectors: list[Collector] = []
    if "node" in args.collectors:
        from exporter.collectors.node import NodeCollector

        collectors.append(NodeCollector(filesystem_paths=args.filesystem_paths))
    if "gpu" in args.collectors:
        from exporter.collectors.gpu import GpuCollector

        collectors.append(GpuCollector(gpu_processes=gpu_processes, poll_pcie=not args.no_gpu_pcie_poll))
    if "process" in args.collectors:
        from exporter.collectors.process import ProcessCollector

        collectors.append(ProcessCollector(gpu_processes=gpu_processes, registered=push_api.registered_processes))
    return collectors


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_combinations(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )

    tls = None
    if args.tls_cert_file:
        try:
            tls = TlsContextSource(args.tls_cert_file, args.tls_key_file)
        except (OSError, ValueError) as exc:
            fail(f"cannot load TLS certificate/key: {exc}")
    auth = None
    if args.basic_auth_user:
        with open(args.basic_auth_password_file, encoding="utf-8") as handle:
            password = handle.read().rstrip("\r\n")
        if not password:
            fail(f"--basic-auth-password-file {args.basic_auth_password_file!r} is empty")
        auth = BasicAuth(args.basic_auth_user, password)

    store = ExpositionStore()
    push_api, profile_api = ingest.build(args, store)
    collectors = _build_collectors(args, push_api)
    scheduler = Scheduler(collectors, args.collect_interval, store)
    host, port = args.listen_address
    limits = WebLimits(max_connections=args.web_max_connections,
                       max_body_bytes_in_flight=args.ingest_max_bytes_in_flight)
    try:
        server = ExporterServer(
            (host, port), store, scheduler.ready, push_api, tls=tls, auth=auth, limits=limits,
            profile_handler=profile_api,
        )
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")

    scheduler.start()
    push_api.start()
    scheme = "https" if tls else "http"
    log.info("stepscope-exporter %s serving %s://%s:%d/metrics (collectors: %s)",
             __version__, scheme, host, server.server_address[1], ", ".join(args.collectors) or "none")
    try:
        server.serve()  # until SIGTERM or SIGINT; in-flight responses finish first
    finally:
        push_api.stop()
        scheduler.stop()
    return 0
