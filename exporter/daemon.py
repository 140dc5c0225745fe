"""Wires the parsed flags into the collectors, the push API and the server, and serves until stopped.

Imported by `exporter.cli` only after it has checked the flags and chosen whether `ssl` may load: this
module's imports bring asyncio, which imports ssl when it is allowed to.
"""

import argparse
import logging
from typing import TYPE_CHECKING

from stepscope.exporter import __version__
from stepscope.exporter.collectors import Collector
from stepscope.exporter.exposition import ExpositionStore
from stepscope.exporter.flags import fail
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.ingest import short_ttl_warning
from stepscope.exporter.ingest.access import AccessPolicy
from stepscope.exporter.ingest.api import PushApi
from stepscope.exporter.ingest.parser import PushLimits
from stepscope.exporter.ingest.profile_api import ProfileApi
from stepscope.exporter.ingest.store import GroupStore, StoreLimits
from stepscope.exporter.ingest.tokens import IngestTokens
from stepscope.exporter.scheduler import Scheduler
from stepscope.exporter.server import ExporterServer, WebLimits, WebOptions
from stepscope.exporter.web_auth import Authenticator, PasswordFileUser
from stepscope.exporter.web_auth_known import KnownGroups, StateFileError
from stepscope.exporter.web_config import TlsSettings, WebConfig
from stepscope.exporter.web_reload import ReloadingUsers, WebConfigSource

if TYPE_CHECKING:  # pods.py needs grpc, imported only with --kubelet-pod-resources-socket
    from stepscope.exporter.collectors.pods import PodCollector

log = logging.getLogger("exporter")
# Half the request head the exporter takes (http_exchange.MAX_HEAD_BYTES), as for an ingest token: the
# Authorization header carries the password base64-encoded, a third longer.
MAX_PASSWORD_FILE_BYTES = 8192


def serve(args: argparse.Namespace, config: WebConfig, tls_settings: TlsSettings | None) -> int:
    """Builds everything the flags ask for, serves until SIGTERM or SIGINT, and stops the threads."""
    options = _web_options(args, config, tls_settings)
    store = ExpositionStore()
    if options.tls is not None:
        options.tls.publish_expiry(lambda body: store.publish("stepscope_exporter_tls", body))
    push_api, profile_api = _push_apis(args, store)
    if (ttl_warning := short_ttl_warning(args.ingest_ttl)) is not None:
        log.warning("%s", ttl_warning)
    collectors = _build_collectors(args, push_api)
    scheduler = Scheduler(collectors, args.collect_interval, store)
    host, port = args.listen_address
    try:
        server = ExporterServer((host, port), store, scheduler.ready, push_api, options, profile_handler=profile_api)
    except OSError as exc:
        fail(f"cannot listen on {_authority(host, port)}: {exc.strerror or exc}")

    scheduler.start()
    push_api.start()
    scheme = "https" if options.tls else "http"
    bound_host, bound_port = server.server_address[:2]  # `::` or 0.0.0.0 for every interface (host "")
    log.info("stepscope-exporter %s serving %s://%s%s (collectors: %s)", __version__, scheme,
             _authority(bound_host, bound_port), options.telemetry_path, ", ".join(args.collectors) or "none")
    try:
        server.serve()  # until SIGTERM or SIGINT; in-flight responses finish first
    finally:
        push_api.stop()
        scheduler.stop()
    return 0


def _authority(host: str, port: int) -> str:
    """HOST:PORT as a URL writes it: an IPv6 address in brackets (`[::1]:9847`), so the line can be pasted."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _known_groups(args: argparse.Namespace) -> KnownGroups:
    """The address groups basic auth let in, read from --web.auth.state-file and written back at once, so
    a path the exporter cannot write, or a file it would destroy, is one line at start, not a surprise at
    the first login or the next restart."""
    try:
        known = KnownGroups(args.web_auth_state_file or None)
    except StateFileError as exc:
        fail(f"--web.auth.state-file {args.web_auth_state_file!r}: {exc}")
    try:
        known.save()
    except OSError as exc:
        fail(f"cannot write --web.auth.state-file {args.web_auth_state_file!r}: {exc.strerror or exc}")
    return known


def _web_options(args: argparse.Namespace, config: WebConfig, tls_settings: TlsSettings | None) -> WebOptions:
    """TLS, basic auth and headers from the web config (checked by the cli) or the older flags."""
    source = WebConfigSource(args.web_config_file, config) if args.web_config_file else None
    tls = None
    if tls_settings is not None:
        from stepscope.exporter.web_tls import TlsContextSource  # it imports ssl: only where TLS is served

        try:
            tls = TlsContextSource(tls_settings)
        except (OSError, ValueError) as exc:
            fail(f"cannot load TLS: {exc}")
    auth: Authenticator | None = ReloadingUsers(source, _known_groups(args)) if source is not None else None
    if args.basic_auth_user:
        auth = PasswordFileUser(args.basic_auth_user, _password(args.basic_auth_password_file))
    limits = WebLimits(max_connections=args.web_max_connections,
                       max_body_bytes_in_flight=args.ingest_max_bytes_in_flight)
    headers = source.headers if source is not None else dict
    return WebOptions(telemetry_path=args.telemetry_path, tls=tls, auth=auth, headers=headers, limits=limits)


def _password(path: str) -> str:
    """The password in --basic-auth-password-file, its line end dropped; one line and exit 2 when the file cannot
    be what a client sends: empty, not UTF-8 (the exporter decodes the Authorization header as UTF-8, so no
    client could ever match it), or longer than a request head carries (a device such as /dev/zero was read
    until memory ran out)."""
    flag = f"--basic-auth-password-file {path!r}"
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as exc:
        fail(f"{flag}: cannot read it: {exc.strerror or exc}")
    if len(raw) > MAX_PASSWORD_FILE_BYTES:
        fail(f"{flag} is longer than {MAX_PASSWORD_FILE_BYTES} bytes: not a password")
    try:
        password = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        fail(f"{flag} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): a client's "
             "password is read as UTF-8, so none could match it")
    if not password:
        fail(f"{flag} is empty")
    return password


def _build_collectors(
    args: argparse.Namespace, push_api: PushApi
) -> list[Collector]:
    gpu_processes = GpuProcessTable()
    collectors: list[Collector] = []
    pods = _pod_collector(args, push_api)
    attribution = pods.attribution if pods is not None else None
    if "node" in args.collectors:
        from stepscope.exporter.collectors.node import NODE_NET_DEV, NodeCollector

        collectors.append(NodeCollector(filesystem_paths=args.filesystem_paths, rootfs=args.path_rootfs,
                                        net_dev=NODE_NET_DEV if args.node_host_network else None,
                                        netdev_exclude=args.node_netdev_exclude))
    if "gpu" in args.collectors:
        from stepscope.exporter.collectors.gpu import GpuCollector

        collectors.append(GpuCollector(gpu_processes=gpu_processes, poll_pcie=args.gpu_pcie_poll, pods=attribution,
                                       slow_interval=args.gpu_slow_interval))
    if "process" in args.collectors:
        from stepscope.exporter.collectors.process import ProcessCollector

        collectors.append(ProcessCollector(gpu_processes=gpu_processes, registered=push_api.registered_processes,
                                           pods=attribution))
    return [*collectors, pods] if pods is not None else collectors


def _pod_collector(args: argparse.Namespace, push_api: PushApi) -> "PodCollector | None":
    """With --kubelet-pod-resources-socket: the pods collector, its first List done, its answer labelling the
    GPU, process and pushed series; None off Kubernetes, where nothing of it runs."""
    if not args.kubelet_pod_resources_socket:
        return None
    from stepscope.exporter.collectors.pods import PodCollector, PodResourcesClient

    pods = PodCollector(PodResourcesClient(args.kubelet_pod_resources_socket),
                        registered=push_api.registered_processes)
    pods.prime()
    push_api.label_pods(pods.attribution)
    return pods


def _push_apis(args: argparse.Namespace, store: ExpositionStore) -> tuple[PushApi, ProfileApi]:
    """The push API and the profile-request API for parsed flags; ends the program with one line when
    the token file is unusable."""
    token = None
    if args.ingest_token_file:
        try:
            token = IngestTokens.from_file(args.ingest_token_file)
        except ValueError as exc:
            fail(f"--ingest-token-file {args.ingest_token_file!r}: {exc}")
    limits = StoreLimits(
        max_groups=args.ingest_max_groups,
        max_series_per_group=args.ingest_max_series_per_group,
        max_phases=args.ingest_max_phases,
        ttl_seconds=args.ingest_ttl,
        max_series=args.ingest_max_series,
    )
    push_limits = PushLimits(
        max_label_length=args.ingest_max_label_value_length,
        max_series=args.ingest_max_series_per_group,
        max_phases=args.ingest_max_phases,
    )
    access = AccessPolicy(token, tuple(args.ingest_allow), tuple(args.ingest_allow_without_token))
    push_api = PushApi(store, GroupStore(limits), access, max_body_bytes=args.ingest_max_body_bytes,
                       limits=push_limits)
    return push_api, ProfileApi(push_api.profiles, access)
