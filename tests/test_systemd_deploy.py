"""Bare metal and Slurm (docs/deployment.md): the shipped systemd unit and environment file, run as the unit runs
them (its user's capabilities, its flags from the file), serve a Slurm rank of another user, and the shipped
Prometheus config scrapes them with the node's name as `instance`."""

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import bcrypt
import pytest
import requests
import yaml

from stepscope.contract import families
from stepscope_testkit import ingest_bodies
from stepscope_testkit.processes import Running, free_port, running, sample_values
from tests.support.prometheus import query, running_prometheus_config, wait_for

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "deploy" / "systemd" / "stepscope-exporter.service"
ENV_FILE = REPO / "deploy" / "systemd" / "exporter.env"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
NODES_YML = REPO / "deploy" / "prometheus" / "stepscope-nodes.yml"
RULES_OUT = REPO / "grafana" / "rules_out"
UNPRIVILEGED_USER = "nobody"  # stands in for the unit's `stepscope`, which this machine lacks
PASSWORD = "scrape-secret"
# Each hides from the exporter what it reads: /dev/nvidia* (NVML), other users' processes, /proc/stat.
BLINDING_SETTINGS = ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "ProtectProc", "ProcSubset",
                     "PrivateUsers", "MemoryDenyWriteExecute")

needs_root_and_setpriv = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                            reason="runs the exporter as another user: needs root and setpriv")


def service_settings(unit_text: str) -> dict[str, str]:
    """The [Service] section's settings (one value each, as this unit writes them)."""
    settings, section = {}, ""
    for line in unit_text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith(("#", ";")) and section == "Service":
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def environment_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments and blank lines skipped)."""
    entries = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            entries[key.strip()] = value.strip().strip('"')
    return entries


def capability_names(setting: str) -> list[str]:
    """setpriv's names (`sys_ptrace`) of a unit's capability list (`CAP_SYS_PTRACE ...`)."""
    return [name.lower().removeprefix("cap_") for name in setting.split()]


def as_the_units_user(command: list[str], settings: dict[str, str], with_capabilities: bool = True) -> list[str]:
    """`command` run as systemd runs the unit's ExecStart: another user, its ambient capabilities, its bounding
    set, no new privileges."""
    caps = ",".join(f"+{name}" for name in capability_names(settings["AmbientCapabilities"]))
    bounding = ",".join(f"+{name}" for name in capability_names(settings["CapabilityBoundingSet"]))
    wrapper = ["setpriv", f"--reuid={UNPRIVILEGED_USER}", "--regid=nogroup", "--clear-groups"]
    if with_capabilities:
        wrapper += [f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set=-all,{bounding}"]
    if settings.get("NoNewPrivileges") == "yes":
        wrapper.append("--no-new-privs")
    return [*wrapper, *command]


def exec_start(settings: dict[str, str]) -> list[str]:
    """The unit's ExecStart with this checkout's exporter in place of the installed /opt/stepscope/bin one."""
    installed, *args = shlex.split(settings["ExecStart"])
    assert installed == "/opt/stepscope/bin/stepscope-exporter"
    return [sys.executable, "-m", "stepscope.exporter", *args]


@pytest.fixture(scope="module")
def unit_settings() -> dict[str, str]:
    return service_settings(UNIT.read_text())


@pytest.fixture
def etc_stepscope() -> Iterator[Path]:
    """A directory the unprivileged user can read (pytest's tmp_path is root's alone), standing in for
    /etc/stepscope and /var/lib/stepscope."""
    directory = Path(tempfile.mkdtemp(prefix="stepscope-etc-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


def shipped_environment(etc: Path, port: int) -> dict[str, str]:
    """The shipped environment file's variables, its paths moved under `etc` and its port to `port`; the files
    it names written as an operator would (a basic auth user, the state directory)."""
    state = etc / "state"
    state.mkdir()
    shutil.chown(state, UNPRIVILEGED_USER)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (etc / "web.yml").write_text(yaml.safe_dump({"basic_auth_users": {"prometheus": hashed}}))
    env = environment_file(ENV_FILE.read_text())
    for key, value in env.items():
        env[key] = value.replace("/etc/stepscope", str(etc)).replace("/var/lib/stepscope", str(state))
    assert env["STEPSCOPE_WEB_LISTEN_ADDRESS"] == ":9847"
    env["STEPSCOPE_WEB_LISTEN_ADDRESS"] = f"127.0.0.1:{port}"
    env["STEPSCOPE_COLLECT_INTERVAL"] = "1"  # the test's pace; the unit keeps the default
    return env


def running_unit(etc: Path, settings: dict[str, str], log: Path,
                 with_capabilities: bool = True) -> AbstractContextManager[Running]:
    port = free_port()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           **shipped_environment(etc, port)}
    argv = as_the_units_user(exec_start(settings), settings, with_capabilities)
    return running(argv, f"http://127.0.0.1:{port}/-/ready", log, env=env, base_url=f"http://127.0.0.1:{port}")


def scrape_with_auth(base_url: str) -> str:
    response = requests.get(f"{base_url}/metrics", auth=("prometheus", PASSWORD), timeout=10)
    response.raise_for_status()
    return response.text


SLURM_RANK = textwrap.dedent("""
    import os, sys, tempfile, time
    import stepscope.hooks as th
    tracker = th.init(framework="pytorch")
    with tempfile.TemporaryFile() as scratch:
        for _ in tracker.loader(iter(int, 1)):
            with tracker.phase("forward"):
                scratch.write(os.urandom(64 << 10)); scratch.flush(); os.fsync(scratch.fileno())
            tracker.step(samples=8)
            time.sleep(0.05)
""")


def start_slurm_rank(directory: Path, push_url: str) -> subprocess.Popen:
    """`srun python train.py` in job 1001, one task, as root (another user than the exporter's)."""
    script = directory / "train.py"
    script.write_text(SLURM_RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO), "STEPSCOPE_PUSH_URL": push_url, "STEPSCOPE_PUSH_INTERVAL": "0.5",
           "SLURM_JOB_ID": "1001", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    for variable in ("STEPSCOPE_RUN", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(variable, None)
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def prometheus_config(tmp_path: Path, exporter_port: int) -> dict:
    """The shipped prometheus.yml, its node list in a file naming this node `localhost` (by its address) and
    `gpu-003` (by its target group's `instance`), basic auth as its
    comment says, scraped every second, its rules left out (test_shipped_prometheus_config_loads_with_the_rules
    loads them)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    nodes = [{"targets": [f"localhost:{exporter_port}"]},
             {"targets": [f"127.0.0.1:{exporter_port}"], "labels": {"instance": "gpu-003"}}]  # named by its group
    (tmp_path / "nodes.yml").write_text(yaml.safe_dump(nodes))
    (tmp_path / "password").write_text(PASSWORD)
    config["global"]["scrape_interval"] = "1s"
    del config["rule_files"]
    job = config["scrape_configs"][0]
    job["file_sd_configs"][0]["files"] = [str(tmp_path / "nodes.yml")]
    job["basic_auth"] = {"username": "prometheus", "password_file": str(tmp_path / "password")}
    return config


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """systemd-analyze verify runs without a running systemd, but fails on an ExecStart that is not installed
    here and only warns (exit 0) on a bad value: the unit is checked with an executable in its place and no
    word on stderr."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    text = UNIT.read_text().replace("/opt/stepscope/bin/stepscope-exporter", sys.executable)
    checked = tmp_path / UNIT.name
    checked.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(checked)], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    checked.write_text(text.replace("ProtectHome=read-only", "ProtectHome=readonly"))
    result = subprocess.run(["systemd-analyze", "verify", str(checked)], capture_output=True, text=True)
    assert "Failed to parse protect home value" in result.stderr  # the check does see a bad value


def test_the_units_hardening_leaves_what_the_exporter_reads(unit_settings: dict[str, str]) -> None:
    capabilities = {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}  # the chart's two (docs/cluster.md)
    assert set(unit_settings["AmbientCapabilities"].split()) == capabilities
    assert set(unit_settings["CapabilityBoundingSet"].split()) == capabilities
    assert unit_settings["User"] != "root" and unit_settings["NoNewPrivileges"] == "yes"
    assert unit_settings["ProtectSystem"] == "strict"
    assert unit_settings["RestartPreventExitStatus"] == "2"  # a bad flag is not retried every 5 s for ever
    assert [name for name in BLINDING_SETTINGS if name in unit_settings] == []


def test_shipped_prometheus_config_loads_with_the_rules(tmp_path: Path) -> None:
    text = PROMETHEUS_YML.read_text().replace("/etc/prometheus/stepscope/", f"{RULES_OUT}/")
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace("/etc/prometheus/stepscope-nodes.yml", str(NODES_YML)))
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout


def test_the_shipped_prometheus_config_sends_alerts_as_the_compose_stack_does() -> None:
    """Without an alerting section the rules' alerts reached no one, and without grafana_url every alert's
    dashboard_url was a bare path; the label is dropped from the alerts as the compose stack's config does."""
    bare_metal = yaml.safe_load(PROMETHEUS_YML.read_text())
    compose = yaml.safe_load((REPO / "docker" / "prometheus" / "prometheus.yml").read_text())
    assert bare_metal["global"]["external_labels"]["grafana_url"].startswith("http")
    assert bare_metal["alerting"]["alert_relabel_configs"] == compose["alerting"]["alert_relabel_configs"]
    assert bare_metal["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]


@needs_root_and_setpriv
def test_the_unit_as_its_user_serves_a_slurm_rank_of_another_user_to_the_shipped_prometheus(
        tmp_path: Path, etc_stepscope: Path, unit_settings: dict[str, str]) -> None:
    with running_unit(etc_stepscope, unit_settings, tmp_path / "exporter.log") as exporter:
        rank = start_slurm_rank(etc_stepscope, exporter.url)
        try:
            def rank_io() -> list[float]:
                return sample_values(scrape_with_auth(exporter.url), families.PROCESS_IO_WRITE, run="train-1001",
                                     rank="0", pid=str(rank.pid))
            written = wait_for(rank_io, timeout=30, interval=0.5)
            assert written and written[0] > 0, exporter.log()
            assert requests.get(f"{exporter.url}/metrics", timeout=10).status_code == 401
            with running_prometheus_config(tmp_path, prometheus_config(tmp_path, int(exporter.url.rsplit(":", 1)[1]))
                                           ) as prometheus:
                selector = 'stepscope_training_info{job="stepscope",instance="localhost",run="train-1001"}'
                assert wait_for(lambda: query(prometheus.url, selector), timeout=30), prometheus.log()
                assert wait_for(lambda: len(query(prometheus.url, 'up{job="stepscope"} == 1')) == 2, timeout=30)
                up = query(prometheus.url, 'up{job="stepscope"}')
                assert sorted(result["metric"]["instance"] for result in up) == ["gpu-003", "localhost"]
        finally:
            rank.kill()
            rank.wait()
        assert "refused" not in exporter.log()


def last_process_cycle(base_url: str) -> float:
    """Unix time of the process collector's last cycle."""
    return sample_values(scrape_with_auth(base_url), "stepscope_exporter_collector_last_success_timestamp_seconds",
                         collector="process")[0]


@needs_root_and_setpriv
def test_without_the_capabilities_the_exporter_says_in_one_line_what_it_leaves_out(
        tmp_path: Path, etc_stepscope: Path, unit_settings: dict[str, str]) -> None:
    """Run as a user without the unit's capabilities, another user's rank (this test, root) reads CPU and memory
    but no I/O: before, no word said why its I/O families were missing."""
    with running_unit(etc_stepscope, unit_settings, tmp_path / "exporter.log", with_capabilities=False) as exporter:
        push = f"{exporter.url}/metrics/job/stepscope/run/rooted/rank/0"
        body = ingest_bodies.full_body(pid=os.getpid())
        assert requests.put(push, data=body, timeout=10).status_code == 200
        assert wait_for(lambda: sample_values(scrape_with_auth(exporter.url), families.PROCESS_CPU_SECONDS,
                                              run="rooted"), timeout=30, interval=0.5), exporter.log()
        first = last_process_cycle(exporter.url)
        assert wait_for(lambda: last_process_cycle(exporter.url) >= first + 2, timeout=30, interval=0.5)
        assert sample_values(scrape_with_auth(exporter.url), families.PROCESS_IO_READ, run="rooted") == []
    refusals = [line for line in exporter.log().splitlines() if "is refused" in line]
    assert len(refusals) == 1, exporter.log()  # one line, not one a cycle
    assert "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH" in refusals[0]
