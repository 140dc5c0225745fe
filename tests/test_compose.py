"""The compose stack: valid against the Compose specification, mounts that exist, loopback-only ports,
a Prometheus config promtool accepts, and services that agree with each other and the bundle."""

import ipaddress
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from grafana.rules import RULE_FILES
from stepscope.exporter.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
PROMETHEUS_YML = DOCKER / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "grafana"
HOST_ROOT = "/host/root"  # where the exporter's container sees the host's /
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's `${VAR:-default}` substitution with an empty (or given) environment."""
    env = env or {}
    return INTERPOLATION.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True, text=True,
    )


def test_compose_file_follows_the_compose_spec(tmp_path: Path) -> None:
    result = check_compose_schema(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["exporter"]["pid_namespace"] = "host"   # the checker does reject unknown keys
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    assert check_compose_schema(tmp_path / "compose.yaml").returncode == 1


def bind_mounts(compose: dict[str, Any], env: dict[str, str] | None = None) -> list[tuple[str, Path, str]]:
    """(service, source on this machine, target) for every bind mount (short syntax), with `env`."""
    mounts = []
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target = interpolate(volume, env).split(":")[:2]
            if source.startswith((".", "/")):
                mounts.append((name, (DOCKER / source).resolve(), target))
    return mounts


def test_bind_mounts_exist(compose: dict[str, Any]) -> None:
    mounts = bind_mounts(compose)
    assert mounts
    for service, source, target in mounts:
        if source.is_relative_to(GRAFANA):
            continue   # test_grafana_bundle_mounts_exist
        if (service, source, target) == ("exporter", Path("/"), HOST_ROOT):
            continue   # test_the_exporter_reads_the_hosts_filesystems_under_its_root_mounted_read_only
        assert source.exists(), f"{service}: mount source {source} for {target} does not exist"
        assert source.is_relative_to(REPO), f"{service}: {source} lies outside the repository"


def grafana_mounts() -> list[tuple[str, Path, str]]:
    return [m for m in bind_mounts(yaml.safe_load(COMPOSE.read_text())) if m[1].is_relative_to(GRAFANA)]


@pytest.mark.parametrize("mount", grafana_mounts(), ids=lambda m: str(m[1].relative_to(REPO)))
def test_grafana_bundle_mounts_exist(mount: tuple[str, Path, str]) -> None:
    service, source, target = mount
    assert source.is_dir(), f"{service}: {source} (mounted at {target}) does not exist"


def test_ports_are_loopback_unless_overridden(compose: dict[str, Any]) -> None:
    published = [(name, p) for name, s in compose["services"].items() for p in s.get("ports", [])]
    assert {name for name, _ in published} == {"exporter", "prometheus", "alertmanager", "grafana", "victoria-metrics"}
    for name, port in published:
        host_ip, *ports = interpolate(port).split(":")
        assert len(ports) == 2, f"{name}: {port!r} must name the host IP to publish on"
        assert host_ip == "127.0.0.1", f"{name}: {port!r} publishes on {host_ip!r} by default"
        assert interpolate(port, {"STEPSCOPE_BIND": "0.0.0.0"}).startswith("0.0.0.0:")


def test_third_party_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if "build" in service:
            continue
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        pinned = re.fullmatch(r"v?\d+\.\d+\.\d+", tag)
        assert repository and pinned, f"{name}: {image} is not pinned to a release"


def test_exporter_sees_gpus_host_processes_and_pushes(compose: dict[str, Any]) -> None:
    exporter = compose["services"]["exporter"]
    assert exporter["build"]["dockerfile"] == "docker/Dockerfile" and (DOCKER / "Dockerfile").is_file()
    (device,) = exporter["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu", "utility"]}
    assert exporter["pid"] == "host" and exporter["read_only"] is True
    allow = ipaddress.ip_network(interpolate(exporter["environment"]["STEPSCOPE_INGEST_ALLOW"]))
    (network,) = compose["networks"]["stepscope"]["ipam"]["config"]
    assert allow == ipaddress.ip_network(interpolate(network["subnet"])), "ingest allow-list != stack subnet"


def test_exporter_reads_and_accepts_its_compose_environment(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt variable is silently ignored, a bad value makes the container exit: both caught here."""
    environment = {name: interpolate(value) for name, value in compose["services"]["exporter"]["environment"].items()}
    read = set(re.findall(r"\bSTEPSCOPE_\w+", build_parser().format_help()))
    assert environment.keys() <= read, f"the exporter does not read {sorted(environment.keys() - read)}"
    assert environment["STEPSCOPE_PATH_ROOTFS"] == HOST_ROOT  # mounted in the container: here, this machine's /
    environment["STEPSCOPE_PATH_ROOTFS"] = "/"
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args([])
    assert args.collect_interval == 5
    assert args.ingest_allow
    assert args.filesystem_paths == ["/"]


def test_the_exporter_reads_the_hosts_filesystems_under_its_root_mounted_read_only(compose: dict[str, Any]) -> None:
    """The container's own / is an overlay: the host's root, read-only, is where --path.rootfs points, so
    STEPSCOPE_FILESYSTEM_PATHS are the host's paths. Not rslave: Docker refuses it where / is no shared mount."""
    exporter = compose["services"]["exporter"]
    assert "/:/host/root:ro" in exporter["volumes"]
    assert exporter["environment"]["STEPSCOPE_PATH_ROOTFS"] == HOST_ROOT
    assert interpolate(exporter["environment"]["STEPSCOPE_FILESYSTEM_PATHS"], {"STEPSCOPE_FILESYSTEM_PATHS": "/,/data"}
                       ) == "/,/data"


def test_the_exporter_reads_the_hosts_interfaces_through_its_pid_1(compose: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's network is the stack's bridge; with the host's PID namespace, PID 1 shows the host's."""
    exporter = compose["services"]["exporter"]
    assert exporter["pid"] == "host" and "network_mode" not in exporter
    variable = "STEPSCOPE_COLLECTOR_NODE_HOST_NETWORK"
    monkeypatch.setenv(variable, exporter["environment"][variable])
    assert build_parser().parse_args([]).node_host_network is True


def test_demo_trainer_pushes_to_the_exporter(compose: dict[str, Any]) -> None:
    trainer = compose["services"]["trainer"]
    assert trainer["profiles"] == ["demo"] and trainer["build"]["target"] == "demo"
    assert "pid" not in trainer   # its own PID namespace: the exporter resolves it by start time
    command = [interpolate(part) for part in trainer["command"]]
    url = command[command.index("--push-url") + 1]
    assert url == trainer["environment"]["STEPSCOPE_PUSH_URL"] == "http://exporter:9847"
    float(command[command.index("--slow-loader") + 1])
    assert "--run" in command
    stages = re.findall(r"^FROM \S+ AS (\w+)", (DOCKER / "Dockerfile").read_text(), re.M)
    assert "demo" in stages and compose["services"]["exporter"]["build"]["target"] == stages[-1]


def test_grafana_credentials_come_from_env_with_defaults(compose: dict[str, Any]) -> None:
    env = compose["services"]["grafana"]["environment"]
    assert interpolate(env["GF_SECURITY_ADMIN_USER"]) == "admin"
    assert interpolate(env["GF_SECURITY_ADMIN_PASSWORD"], {"GRAFANA_ADMIN_PASSWORD": "s3cret"}) == "s3cret"


def test_prometheus_targets_and_alertmanager_are_services(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    services = compose["services"]
    (scrape,) = [job for job in config["scrape_configs"] if job["job_name"] == "stepscope"]
    for group in scrape["static_configs"]:
        assert group["labels"]["instance"], "instance must carry the node name"
        for target in group["targets"]:
            host, port = target.split(":")
            assert host in services and port == "9847"
    mounts = {target: source for _, source, target in bind_mounts(compose)}
    (alertmanagers,) = config["alerting"]["alertmanagers"]
    (sd_file,) = alertmanagers["file_sd_configs"][0]["files"]
    (group,) = yaml.safe_load(mounts[sd_file].read_text())
    host = group["targets"][0].split(":")[0]
    assert host in services
    rules_dir = mounts["/etc/prometheus/rules"]
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_YML.resolve()
    assert config["rule_files"] == [f"rules/{path.name}" for path in RULE_FILES]
    assert rules_dir == RULE_FILES[0].parent.resolve()


@pytest.mark.parametrize(("setting", "alertmanagers", "grafana_paused"),
                         [("alertmanager", ["alertmanager:9093"], "true"), ("grafana", [], "false")])
def test_one_alerting_path_per_setting(
    compose: dict[str, Any], setting: str, alertmanagers: list[str], grafana_paused: str
) -> None:
    """STEPSCOPE_ALERTING picks what Prometheus sends alerts to and whether Grafana's rules are paused;
    unset, it is alertmanager. Both paths at once sent every alert twice (issue 28)."""
    env = {"STEPSCOPE_ALERTING": setting} if setting != "alertmanager" else {}
    mounts = {target: source for _, source, target in bind_mounts(compose, env)}
    groups = yaml.safe_load(mounts["/etc/prometheus/alertmanagers.yml"].read_text())
    assert [target for group in groups for target in group["targets"]] == alertmanagers
    env_file = DOCKER / interpolate(compose["services"]["grafana"]["env_file"], env)
    assert f"STEPSCOPE_GRAFANA_ALERTS_PAUSED={grafana_paused}" in env_file.read_text().splitlines()
    provisioned = yaml.safe_load((GRAFANA / "alerting_out" / "stepscope-alerts.yml").read_text())
    assert {rule["isPaused"] for group in provisioned["groups"] for rule in group["rules"]} == \
        {"${STEPSCOPE_GRAFANA_ALERTS_PAUSED}"}


def test_links_in_notifications_point_at_the_published_ports(compose: dict[str, Any]) -> None:
    """Alertmanager's and Prometheus' links and the alerts' Grafana links are URLs a person's browser
    reaches, not container names."""
    commands = {name: [interpolate(arg) for arg in compose["services"][name]["command"]]
                for name in ("prometheus", "alertmanager")}
    assert "--web.external-url=http://127.0.0.1:9090" in commands["prometheus"]
    assert "--web.external-url=http://127.0.0.1:9093" in commands["alertmanager"]
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["external_labels"]["grafana_url"] == "http://127.0.0.1:3000"
    assert {"action": "labeldrop", "regex": "grafana_url"} in config["alerting"]["alert_relabel_configs"]


def test_alertmanager_routes_to_a_defined_receiver() -> None:
    config = yaml.safe_load((DOCKER / "alertmanager" / "alertmanager.yml").read_text())
    names = {r["name"] for r in config["receivers"]}
    assert config["route"]["receiver"] in names


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True)


def test_promtool_accepts_the_config_syntax() -> None:
    result = promtool("check", "config", "--syntax-only", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_config_with_the_mounted_rules(tmp_path: Path) -> None:
    # Lay the files out as the container sees them: the config, with rules/ next to it.
    shutil.copy(PROMETHEUS_YML, tmp_path / "prometheus.yml")
    shutil.copytree(RULE_FILES[0].parent, tmp_path / "rules")
    result = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def provisioning_files(kind: str) -> list[Path]:
    return sorted((GRAFANA / "provisioning" / kind).glob("*.y*ml"))


def test_grafana_datasource_points_at_the_prometheus_service(compose: dict[str, Any]) -> None:
    datasources = [ds for path in provisioning_files("datasources")
                   for ds in yaml.safe_load(path.read_text()).get("datasources", [])]
    urls = [ds["url"] for ds in datasources if ds.get("type") == "prometheus"]
    grafana_env = compose["services"]["grafana"]["environment"]
    resolved = [grafana_env.get(url[2:-1], url) if url.startswith("${") else url for url in urls]
    assert resolved == ["http://prometheus:9090"]


def test_grafana_dashboard_provider_reads_the_mounted_dashboards(compose: dict[str, Any]) -> None:
    mounts = {source: target for _, source, target in bind_mounts(compose)}
    mounted_at = mounts[(GRAFANA / "dashboards_out").resolve()]
    paths = [p["options"]["path"] for path in provisioning_files("dashboards")
             for p in yaml.safe_load(path.read_text()).get("providers", [])]
    assert paths and all(p.rstrip("/") == mounted_at for p in paths), (paths, mounted_at)


class ComposeLoader(yaml.SafeLoader):
    """Understands Compose's `!reset` merge tag (YAML's own loaders reject unknown tags)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def test_cpu_override_only_drops_the_gpu_reservation(tmp_path: Path, compose: dict[str, Any]) -> None:
    override = yaml.load((DOCKER / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)
    assert override == {"services": {"exporter": {"deploy": "!reset"}}}
    merged = yaml.safe_load(COMPOSE.read_text())
    del merged["services"]["exporter"]["deploy"]
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(merged))
    result = check_compose_schema(tmp_path / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
