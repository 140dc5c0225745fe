"""The chart's GPU source (`gpuSource: nvml|dcgm`) and pod attribution (`podResources`): in dcgm mode the
DaemonSet runs without its GPU collector and without NVML, and mounts the kubelet's PodResources socket
read-only with only what reading it needs. Both modes lint and validate (helm/stepscope/ci/dcgm-values.yaml
and pod-resources-values.yaml run through every test of tests/test_helm_chart.py as well)."""

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from stepscope.exporter.cli import build_parser
from tests.support.helm_chart import CHART, REPO, lint, notes, objects, render
from tests.support.prometheus import query, running_prometheus_config, wait_for
from tests.support.readme import doc_section

SOCKET_DIR = "/var/lib/kubelet/pod-resources"


def _daemonset(values: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, exporter container) of the rendered DaemonSet."""
    (daemonset,) = [o for o in objects(render(CHART, values or {})) if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in container["args"] if "=" in arg)


@pytest.mark.parametrize("values", [{"gpuSource": "nvml"}, {"gpuSource": "dcgm"}], ids=["nvml", "dcgm"])
def test_both_gpu_sources_lint_strict(values: dict[str, Any]) -> None:
    report = lint(CHART, values)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report


def test_dcgm_mode_runs_without_the_gpu_collector_and_without_nvml() -> None:
    _, container = _daemonset({"gpuSource": "dcgm"})
    args = _args(container)
    assert args["--collectors"] == "node,process"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and "NVIDIA_DRIVER_CAPABILITIES" not in env
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    build_parser().parse_args([a.replace("=/host/root", "=/") for a in container["args"]  # the node's root: ours
                               if not a.startswith("--ingest-token-file")])


def test_dcgm_mode_reads_the_pod_resources_socket_read_only_as_root_with_sys_ptrace_and_dac_read_search() -> None:
    pod, container = _daemonset({"gpuSource": "dcgm"})
    assert _args(container)["--kubelet-pod-resources-socket"] == f"{SOCKET_DIR}/kubelet.sock"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "pod-resources"]
    assert volume["hostPath"] == {"path": SOCKET_DIR, "type": "Directory"}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "pod-resources"]
    assert mount == {"name": "pod-resources", "mountPath": SOCKET_DIR, "readOnly": True}
    ctx = container["securityContext"]
    assert ctx["runAsUser"] == 0 and ctx["runAsNonRoot"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert "privileged" not in ctx and pod["automountServiceAccountToken"] is False  # no Kubernetes API access
    assert {m["name"] for m in container["volumeMounts"]} == {"ingest-token", "pod-resources", "host-root"}


TRAINING_UID = 1000  # a training image's non-root user (restricted namespaces, OpenShift's random UIDs)
READ_VIEW = ("import sys; from stepscope.exporter.collectors.pods import process_view; "
             "print(process_view(int(sys.argv[1])))")


def test_the_charts_privileges_read_the_gpus_of_a_non_root_training_process() -> None:
    """The exporter finds a rank's GPUs in its process's /proc/<pid>/environ (mode 0400, the process's owner's).
    As root with CAP_SYS_PTRACE alone it passed the ptrace check but not the file mode: open() failed with
    EACCES for every training process not running as root, so no rank of such a pod got a GPU (dcgm mode's
    verdicts stayed undetermined). Here the exporter's own process_view runs with exactly the rendered
    container's user, group and capabilities against a process of another user."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("switching users and capabilities needs root and setpriv")
    _, container = _daemonset({"gpuSource": "dcgm"})
    ctx = container["securityContext"]
    capabilities = ",".join(f"+{cap.lower()}" for cap in ctx["capabilities"]["add"])
    training = subprocess.Popen(["setpriv", f"--reuid={TRAINING_UID}", f"--regid={TRAINING_UID}", "--clear-groups",
                                 "env", "-i", "NVIDIA_VISIBLE_DEVICES=GPU-1b2c", "sleep", "30"])
    try:
        while Path(f"/proc/{training.pid}/comm").read_text().strip() != "sleep":   # its environment is set
            training.poll()
        exporter = subprocess.run(
            ["setpriv", f"--reuid={ctx['runAsUser']}", f"--regid={ctx['runAsGroup']}", "--clear-groups",
             f"--bounding-set=-all,{capabilities}", "--no-new-privs", sys.executable, "-c", READ_VIEW,
             str(training.pid)], capture_output=True, text=True, cwd=REPO, timeout=60)
    finally:
        training.kill()
        training.wait()
    assert exporter.returncode == 0, exporter.stderr
    assert exporter.stdout.strip() == "ProcessView(devices=('GPU-1b2c',), hostname='')"


def test_nvml_mode_keeps_the_gpu_collector_and_adds_pod_attribution_on_request() -> None:
    pod, container = _daemonset()
    assert "--kubelet-pod-resources-socket" not in _args(container)
    assert "pod-resources" not in {v["name"] for v in pod["volumes"]}
    assert container["securityContext"]["runAsUser"] == 65532
    pod, container = _daemonset({"podResources": {"enabled": True}})
    args = _args(container)
    assert args["--collectors"] == "node,gpu,process"
    assert args["--kubelet-pod-resources-socket"] == f"{SOCKET_DIR}/kubelet.sock"
    assert {e["name"]: e.get("value") for e in container["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_pod_attribution_without_ingest_still_mounts_the_socket() -> None:
    pod, container = _daemonset({"gpuSource": "dcgm", "ingest": {"enabled": False}})
    assert [v["name"] for v in pod["volumes"]] == ["pod-resources", "host-root"]
    assert [m["name"] for m in container["volumeMounts"]] == ["pod-resources", "host-root"]


def test_the_ci_values_cover_both_modes() -> None:
    assert {"dcgm-values.yaml", "pod-resources-values.yaml"} <= {p.name for p in (CHART / "ci").glob("*.yaml")}
    assert Path(CHART / "ci" / "dcgm-values.yaml").read_text().count("gpuSource: dcgm") == 1


def test_dcgm_mode_without_the_nodes_pid_namespace_is_refused() -> None:
    """dcgm mode joins a rank to its pod's GPUs through the training process the exporter finds in /proc
    (exporter/collectors/pods.py); with hostPID false it sees only its own pod's processes, so no rank ever got a
    GPU, and the chart rendered it without a word."""
    with pytest.raises(helm_python.HelmRenderError, match=r"gpuSource dcgm with hostPID false: .*no rank would get "
                                                          r"a GPU; set hostPID true, or gpuSource nvml"):
        render(CHART, {"gpuSource": "dcgm", "hostPID": False})
    pod, _ = _daemonset({"gpuSource": "nvml", "hostPID": False})   # NVML's GPUs need no process
    assert pod["hostPID"] is False


def test_an_unknown_gpu_source_is_refused() -> None:
    with pytest.raises(Exception, match="gpuSource"):
        render(CHART, {"gpuSource": "nvidia-smi"})


def _tested_prometheus() -> str:
    """The version of the `prometheus` every test runs (Debian's package), as vX.Y.Z."""
    out = subprocess.run(["prometheus", "--version"], capture_output=True, text=True, check=True)
    return "v" + re.search(r"version (\d+\.\d+\.\d+)", out.stdout + out.stderr).group(1)


def test_compose_and_chart_ship_the_prometheus_the_tests_run() -> None:
    """No Prometheus 3 binary is installable from the registries the tests reach (PyPI, npm, Debian 12), so
    the stack ships the version whose behaviour the rules, dashboards and report queries are proven on."""
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    assert compose["services"]["prometheus"]["image"] == f"prom/prometheus:{_tested_prometheus()}"
    values = yaml.safe_load((CHART / "ci" / "sharding-values.yaml").read_text())
    sharded = [o for o in objects(render(CHART, values)) if o["kind"] == "Prometheus"]
    assert len(sharded) == 2 and {o["spec"]["version"] for o in sharded} == {_tested_prometheus()}


# dcgm-exporter's scrape on a node of two GPUs, its Kubernetes mapping on: GPU 0 given to a training pod, GPU 1 to
# none (dcgm-exporter then writes no pod, namespace or container).
DCGM_SCRAPE = """\
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-1",\
container="trainer",namespace="ml",pod="llama-0"} 40000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b1",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-1"} 0
"""
# What the Prometheus Operator puts on each target of a ServiceMonitor before the endpoint's relabelings: the
# dcgm-exporter pod's own namespace, pod and container among them (the GPU Operator's names).
OPERATOR_TARGET_LABELS = {"namespace": "gpu-operator", "service": "nvidia-dcgm-exporter",
                          "pod": "nvidia-dcgm-exporter-7xk2p", "container": "nvidia-dcgm-exporter",
                          "endpoint": "gpu-metrics"}
RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label"}


@contextmanager
def serving_dcgm_scrape() -> Iterator[str]:
    """DCGM_SCRAPE on /metrics of a local server: its host:port."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = DCGM_SCRAPE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            """Quiet: the test reads Prometheus, not the server's log."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def operator_scrape_config(monitor: dict[str, Any], address: str) -> dict[str, Any]:
    """The scrape config the Prometheus Operator makes of a ServiceMonitor endpoint for one dcgm-exporter pod:
    its target labels (static labels here, which relabeling treats alike), then the endpoint's relabelings."""
    relabelings = [{RELABEL_KEYS.get(key, key): value for key, value in step.items()}
                   for step in monitor.get("relabelings", [])]
    return {"job_name": "nvidia-dcgm-exporter", "scrape_interval": "1s",
            "honor_labels": monitor.get("honorLabels", False), "relabel_configs": relabelings,
            "static_configs": [{"targets": [address], "labels": OPERATOR_TARGET_LABELS}]}


def test_the_documented_dcgm_exporter_monitor_keeps_the_workloads_pod_and_gives_a_free_gpu_none(
        tmp_path: Path) -> None:
    """docs/cluster.md's ServiceMonitor settings for dcgm-exporter, scraped by a real Prometheus the way the
    operator configures it. The docs said honorLabels: true, which keeps the workload's labels where dcgm-exporter
    writes them, but fills a GPU given to no pod with the dcgm-exporter pod's own: the rules' held-idle recording
    (instance_gpu:stepscope_gpu_memory_used_bytes:source{pod!=""}) then counted every idle free GPU as held, and
    StepscopeGpuHeldIdle fired for it."""
    (block,) = re.findall(r"```yaml\n(.*?)```", doc_section("dcgm-exporter-service-monitor"), flags=re.S)
    monitor = yaml.safe_load(block)["dcgmExporter"]["serviceMonitor"]
    with serving_dcgm_scrape() as address, running_prometheus_config(
            tmp_path, {"scrape_configs": [operator_scrape_config(monitor, address)]}) as prometheus:
        scraped = wait_for(lambda: query(prometheus.url, "DCGM_FI_DEV_FB_USED"), timeout=30, interval=0.2)
    pods = {sample["metric"]["gpu"]: {key: sample["metric"].get(key) for key in ("namespace", "pod", "container")}
            for sample in scraped}
    assert pods == {"0": {"namespace": "ml", "pod": "llama-0", "container": "trainer"},
                    "1": {"namespace": None, "pod": None, "container": None}}
    assert not any(key.startswith("exported_") for sample in scraped for key in sample["metric"])


def test_dcgm_mode_notes_give_the_documented_dcgm_exporter_monitor() -> None:
    """dcgm mode's verdicts and held-idle alerts depend on how dcgm-exporter is scraped, which the chart does not
    render: the install notes give the documented ServiceMonitor settings, not only docs/cluster.md."""
    (block,) = re.findall(r"```yaml\n(.*?)```", doc_section("dcgm-exporter-service-monitor"), flags=re.S)
    text = notes(render(CHART, {"gpuSource": "dcgm"}))
    given = text[text.index("  dcgmExporter:"):].split("\n\n")[0]
    assert yaml.safe_load(given) == yaml.safe_load(block)
    assert "dcgmExporter" not in notes(render(CHART, {}))
