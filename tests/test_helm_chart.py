"""The Helm chart: lint, Kubernetes schema validation of every rendered object, security defaults,
token wiring, CRD gating, values schema, and the rules/dashboards being the Grafana bundle's."""

import base64
import hashlib
import http.client
import json
import re
import sys
import tarfile
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml

import stepscope.hooks as th
from grafana.rules import NODE_RULES, RULE_FILES, RUN_RULES
from grafana.rules import groups as rule_groups
from stepscope.exporter.cli import build_parser
from stepscope_testkit.processes import exporter_env, free_port, running, sample_values
from stepscope_testkit.sharded import shard_write_filter
from tests.support.alerting import ALERTMANAGER_DIR, amtool
from tests.support.helm_chart import (
    CHART,
    GRAFANA,
    NAMESPACE,
    OPERATOR_API,
    REPO,
    bare_copy,
    by_kind,
    exporter_container,
    lint,
    notes,
    objects,
    one,
    render,
)
from tests.support.readme import doc_section

CI_FILES = sorted((CHART / "ci").glob("*.yaml"))
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Prometheus", "AlertmanagerConfig"}
# The chart's minimum (Chart.yaml kubeVersion) and the newest Kubernetes kubernetes-validate knows.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.utils.latest_version())


@pytest.fixture(scope="module")
def chart() -> Path:
    """The chart as committed: its dashboards come through the link files/dashboards -> grafana/dashboards_out."""
    return CHART


def ci_values(path: Path) -> dict[str, Any]:
    return helm_python.values_from_yaml(path.read_text())



def args_dict(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in container["args"] if "=" in arg)


# ---- lint and validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("values_file", CI_FILES, ids=lambda p: p.name)
def test_lint_strict_is_clean(chart: Path, values_file: Path) -> None:
    report = lint(chart, ci_values(values_file))
    problems = [m for m in report["messages"] if m["severity"] >= 2]   # strict: warnings count
    assert not problems and not report["errors"], report


def test_ci_files_cover_the_agreed_scenarios() -> None:
    names = {p.name for p in CI_FILES}
    assert {"default-values.yaml", "monitors-values.yaml", "existing-secret-hostnetwork-values.yaml",
            "hostpid-off-values.yaml", "sharding-values.yaml", "web-security-values.yaml"} <= names


def check_operator_object(obj: dict[str, Any]) -> None:
    """kubernetes-validate has no schema for the Prometheus Operator CRDs: check their shape here."""
    if obj["kind"] == "AlertmanagerConfig":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1alpha1" and obj["metadata"]["namespace"] == NAMESPACE
        names = {receiver["name"] for receiver in obj["spec"]["receivers"]}
        assert obj["spec"]["route"]["receiver"] in names
        assert {route["receiver"] for route in obj["spec"]["route"]["routes"]} <= names
        return
    assert obj["apiVersion"] == OPERATOR_API
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    assert obj["metadata"]["namespace"] == NAMESPACE
    spec = obj["spec"]
    if obj["kind"] == "Prometheus":
        assert spec["ruleSelector"]["matchLabels"] and spec["serviceAccountName"]
        for write in spec.get("remoteWrite", []):
            assert write["url"].startswith("http")
            for relabel in write["writeRelabelConfigs"]:
                assert set(relabel) <= {"sourceLabels", "regex", "action"}
        return
    if obj["kind"] == "PrometheusRule":
        assert spec["groups"], "PrometheusRule without groups"
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert ("record" in rule) != ("alert" in rule) and rule["expr"]
        return
    endpoints = spec["endpoints" if obj["kind"] == "ServiceMonitor" else "podMetricsEndpoints"]
    assert spec["selector"]["matchLabels"]
    for endpoint in endpoints:
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        for relabel in endpoint["relabelings"] + endpoint.get("metricRelabelings", []):
            assert set(relabel) <= {"sourceLabels", "separator", "targetLabel", "regex", "modulus",
                                    "replacement", "action"}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("api_versions", [(), (OPERATOR_API,)], ids=["plain", "operator"])
@pytest.mark.parametrize("values_file", CI_FILES, ids=lambda p: p.name)
def test_every_rendered_object_validates(
    chart: Path, values_file: Path, api_versions: tuple[str, ...], kube_version: str
) -> None:
    rendered = render(
        chart, ci_values(values_file), api_versions=api_versions, kube_version=f"v{kube_version}"
    )
    objs = objects(rendered) + objects(rendered, tests=True)
    assert {"DaemonSet", "Service", "ServiceAccount"} <= {o["kind"] for o in objs}
    for obj in objs:
        if obj["kind"] in OPERATOR_KINDS:
            check_operator_object(obj)
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except jsonschema.ValidationError as exc:   # kubernetes-validate's errors subclass it
            path = ".".join(str(p) for p in exc.path)
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{name} invalid for Kubernetes {kube_version} at {path}: {exc.message}")


# ---- the DaemonSet ---------------------------------------------------------------------------------

def test_defaults_are_locked_down(chart: Path) -> None:
    objs = objects(render(chart))
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    container = exporter_container(objs)
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 65532
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert "privileged" not in ctx


def test_scheduled_on_gpu_nodes_without_taking_a_gpu(chart: Path) -> None:
    objs = objects(render(chart))
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    container = exporter_container(objs)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required["nodeSelectorTerms"]
    assert {t["matchExpressions"][0]["key"] for t in terms} == {
        "nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"][section]
        assert {"cpu", "memory"} <= set(container["resources"][section])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert pod["hostPID"] is True and pod["hostNetwork"] is False
    assert "runtimeClassName" not in pod


@pytest.mark.parametrize("values_file", CI_FILES, ids=lambda p: p.name)
def test_exporter_accepts_the_rendered_args(chart: Path, values_file: Path, tmp_path: Path) -> None:
    """The chart's flags go through the exporter's own parser (the files mounted in the pod, the token
    and the web config, and the node's root are local here): a value the schema admits but the exporter
    refuses is a crash loop."""
    mounted = {"--ingest-token-file": tmp_path / "token", "--web.config.file": tmp_path / "web-config.yml"}
    for path in mounted.values():
        path.write_text("secret\n")
    mounted["--path.rootfs"] = tmp_path
    args = exporter_container(objects(render(chart, ci_values(values_file))))["args"]
    args = [f"{a.split('=', 1)[0]}={mounted[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in mounted else a
            for a in args]
    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"the exporter refuses {args} (its message is in the captured stderr)")


def test_probes_hit_health_and_readiness(chart: Path) -> None:
    container = exporter_container(objects(render(chart)))
    assert container["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": "http"}
    (port,) = container["ports"]
    assert port["name"] == "http" and port["containerPort"] == 9847
    assert args_dict(container)["--web.listen-address"] == ":9847"  # IPv6 and IPv4: the probes go to the pod IP


def test_image_defaults_to_app_version(chart: Path) -> None:
    app_version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    container = exporter_container(objects(render(chart)))
    assert container["image"].endswith(f"/stepscope-exporter:{app_version}")
    assert exporter_container(objects(render(chart, {"image": {"tag": "9.9.9"}})))["image"].endswith(":9.9.9")


def test_ingest_token_flows_from_secret_to_flag(chart: Path) -> None:
    objs = objects(render(chart))
    secret = one(objs, "Secret")
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    container = exporter_container(objs)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{40}", token)
    (volume,) = [v for v in pod["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]
    assert item["key"] == "token"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert args_dict(container)["--ingest-token-file"] == f"{mount['mountPath']}/{item['path']}"
    assert container["ports"][0]["hostPort"] == 9847   # reachable at the node's IP


def token_and_checksum(chart: Path, values: dict[str, Any] | None = None) -> tuple[str, dict[str, str]]:
    """The generated Secret's token (base64) and the DaemonSet pod template's annotations, of one render."""
    objs = objects(render(chart, values))
    template = one(objs, "DaemonSet")["spec"]["template"]["metadata"]
    return one(objs, "Secret")["data"]["token"], template.get("annotations", {})


def test_a_changed_generated_token_rolls_the_exporters(chart: Path) -> None:
    """The exporter reads --ingest-token-file once, at start: a token the chart generated anew (an offline render
    such as Argo CD's, where lookup finds nothing, or a deleted Secret) reached the mounted file but not the
    running exporters, which refused every push with the new token until restarted. The pod template carries the
    checksum of the very token the Secret of the same render holds, so a new one rolls the DaemonSet."""
    token, annotations = token_and_checksum(chart)
    assert annotations.get("checksum/ingest-token") == hashlib.sha256(token.encode()).hexdigest(), annotations
    other_token, other = token_and_checksum(chart)   # offline: no Secret to read back, a new token
    assert other_token != token and other["checksum/ingest-token"] != annotations["checksum/ingest-token"]
    _, with_own = token_and_checksum(chart, {"podAnnotations": {"team": "ml"}})
    assert set(with_own) == {"team", "checksum/ingest-token"}


def test_the_gitops_token_values_of_the_docs_render_no_token_of_the_charts(chart: Path) -> None:
    """docs/deployment.md tells GitOps users to bring the token: the Secret its command creates is the one its
    values name, and the chart then renders no Secret and no checksum (it cannot know the token)."""
    section = doc_section("chart-gitops-token")
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    values = helm_python.values_from_yaml(block)
    name, key = re.search(r"create secret generic (\S+) --from-literal=(\w+)=", section).groups()
    assert values["ingest"]["token"] == {"existingSecret": name, "key": key}
    objs = objects(render(chart, {**values, "podAnnotations": {"team": "ml"}}))
    assert not by_kind(objs, "Secret")
    pod = one(objs, "DaemonSet")["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"team": "ml"}
    (volume,) = [v for v in pod["spec"]["volumes"] if v.get("secret")]
    assert (volume["secret"]["secretName"], volume["secret"]["items"][0]["key"]) == (name, key)


def test_notes_show_how_training_pods_push(chart: Path) -> None:
    text = notes(render(chart))
    env = yaml.safe_load(text[text.index("  env:"):text.index("STEPSCOPE_RUN")] + "STEPSCOPE_RUN\n")["env"]
    by_name = {e["name"]: e for e in env}
    assert by_name["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert by_name["STEPSCOPE_PUSH_URL"]["value"] == "http://$(HOST_IP):9847"
    assert by_name["STEPSCOPE_PUSH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rel-stepscope-ingest",
                                                                             "key": "token"}


def test_a_training_pod_on_an_ipv6_node_pushes_with_the_notes_env(chart: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In an IPv6 cluster status.hostIP is an IPv6 address, which Kubernetes puts into $(HOST_IP) as it is:
    the NOTES' STEPSCOPE_PUSH_URL becomes http://::1:PORT. Before, every push of the hooks failed on that URL
    (InvalidURL, logged and retried for ever), and the exporter of the chart's args listened on 0.0.0.0, where
    nothing of the node's IPv6 address reaches. Here the node is this machine, its IP ::1."""
    port = free_port()
    rendered = render(chart, {"port": port})
    text = notes(rendered)
    env = yaml.safe_load(text[text.index("  env:"):text.index("STEPSCOPE_RUN")] + "STEPSCOPE_RUN\n")["env"]
    (push_url,) = [e["value"] for e in env if e["name"] == "STEPSCOPE_PUSH_URL"]
    monkeypatch.setenv("STEPSCOPE_PUSH_URL", push_url.replace("$(HOST_IP)", "::1"))  # Kubernetes' expansion
    listen = args_dict(exporter_container(objects(rendered)))["--web.listen-address"]
    argv = [sys.executable, "-m", "stepscope.exporter", f"--web.listen-address={listen}", "--collectors="]
    with running(argv, f"http://[::1]:{port}/-/ready", tmp_path / "exporter.log", env=exporter_env()):
        tracker = th.init(run="ipv6-node", push_interval=60, handle_sigterm=False)
        tracker.step(samples=1)
        tracker.close()  # its last push
        text = requests.get(f"http://[::1]:{port}/metrics", timeout=10).text
    assert tracker.config.push_url == f"http://[::1]:{port}"
    assert sample_values(text, "stepscope_steps_total", run="ipv6-node", rank="0") == [1.0]


@pytest.mark.parametrize(("values", "listens_on_node_ip"), [
    ({}, True),
    ({"ingest": {"hostPort": False}, "hostNetwork": True}, True),   # the container port is the node's port
    ({"ingest": {"hostPort": False}}, False),
], ids=["hostPort", "hostNetwork", "neither"])
def test_notes_give_the_push_url_only_where_something_listens_on_the_node(
    chart: Path, values: dict[str, Any], listens_on_node_ip: bool
) -> None:
    """NOTES told training pods to push to http://$(HOST_IP):9847 with ingest.hostPort false and no hostNetwork,
    where nothing listens on the node's IP: every push would fail. There they say so, and what would work."""
    rendered = render(chart, values)
    text = notes(rendered)
    (port,) = exporter_container(objects(rendered))["ports"]
    assert ("hostPort" in port or values.get("hostNetwork", False)) == listens_on_node_ip
    if listens_on_node_ip:
        assert '"http://$(HOST_IP):9847"' in text and "WARNING" not in text
        return
    assert "$(HOST_IP)" not in text, "NOTES print a push URL nothing listens on"
    assert "WARNING: training pods cannot push to this exporter as installed: ingest.hostPort is false and " \
           "hostNetwork is\noff" in text
    assert "ingest.hostPort=true" in text and "hostNetwork=true" in text and "Secret rel-stepscope-ingest" in text


# Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards), the checks of the fields
# the chart's pod can set: what the baseline level refuses, then what restricted refuses on top.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def pod_security_level(pod: dict[str, Any]) -> str:
    """The strictest Pod Security level that admits the pod spec, as the admission controller checks it."""
    containers = pod["containers"] + pod.get("initContainers", [])
    contexts = [c.get("securityContext", {}) for c in containers]
    added = {cap for context in contexts for cap in context.get("capabilities", {}).get("add", [])}
    if (any(pod.get(field) for field in ("hostPID", "hostNetwork", "hostIPC"))
            or any(port.get("hostPort") for c in containers for port in c.get("ports", []))
            or any("hostPath" in volume for volume in pod.get("volumes", []))
            or any(context.get("privileged") for context in contexts) or not added <= BASELINE_CAPABILITIES):
        return "privileged"
    pod_context = pod.get("securityContext", {})
    for context in contexts:
        as_root = context.get("runAsUser", pod_context.get("runAsUser")) == 0
        if as_root or not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) or added - {"NET_BIND_SERVICE"}:
            return "baseline"
        if context.get("allowPrivilegeEscalation") is not False or "ALL" not in context["capabilities"]["drop"]:
            return "baseline"
    return "restricted"


@pytest.mark.parametrize("values", [
    {},
    {"gpuSource": "dcgm"},
    {"hostNetwork": True, "hostPID": False},
    {"hostPID": False, "ingest": {"hostPort": False}, "hostRootfs": {"enabled": False}},
    {"hostPID": False, "ingest": {"hostPort": False}, "hostRootfs": {"enabled": False},
     "securityContext": {"runAsUser": 0, "runAsNonRoot": False}},
], ids=["default", "dcgm", "host-network", "no-host-access", "root"])
def test_notes_name_the_pod_security_level_the_pods_need(chart: Path, values: dict[str, Any]) -> None:
    """In a baseline or restricted namespace the chart installed cleanly and its DaemonSet sat at 0 ready, the
    refusal only in its events: the NOTES say which level the rendered pod needs, checked as admission checks it."""
    rendered = render(chart, values)
    level = pod_security_level(one(objects(rendered), "DaemonSet")["spec"]["template"]["spec"])
    text = " ".join(notes(rendered).split())
    privileged = f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=privileged"
    assert (privileged in text and "stays at 0 ready" in text) == (level == "privileged")
    assert ("enforce label must be baseline or privileged" in text) == (level == "baseline")
    assert ("Pod Security" in text) == (level != "restricted")


def test_existing_secret_host_network_and_runtime_class(chart: Path) -> None:
    rendered = render(chart, ci_values(CHART / "ci" / "existing-secret-hostnetwork-values.yaml"))
    objs = objects(rendered)
    assert not by_kind(objs, "Secret"), "an existingSecret must not be shadowed by a generated one"
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    container = exporter_container(objs)
    (volume,) = [v for v in pod["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == "stepscope-push-token"
    assert volume["secret"]["items"][0]["key"] == "push-token"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["runtimeClassName"] == "nvidia"
    assert container["ports"][0]["hostPort"] == container["ports"][0]["containerPort"]
    flags = args_dict(container)
    assert flags["--ingest-allow-without-token"] == "10.0.0.0/8" and flags["--ingest-ttl"] == "1800"
    assert "secretKeyRef:\n          name: stepscope-push-token\n          key: push-token" in notes(rendered)


def test_host_pid_off(chart: Path) -> None:
    objs = objects(render(chart, ci_values(CHART / "ci" / "hostpid-off-values.yaml")))
    assert one(objs, "DaemonSet")["spec"]["template"]["spec"]["hostPID"] is False
    assert args_dict(exporter_container(objs))["--collectors"] == "node,gpu"


def test_ingest_disabled_leaves_no_token_and_no_host_port(chart: Path) -> None:
    rendered = render(chart, {"ingest": {"enabled": False}})
    objs = objects(rendered)
    container = exporter_container(objs)
    assert not by_kind(objs, "Secret")
    assert not any(a.startswith("--ingest") for a in container["args"])
    assert "hostPort" not in container["ports"][0]
    assert [mount["name"] for mount in container["volumeMounts"]] == ["host-root"]  # no token
    assert "push API is disabled" in notes(rendered)


def test_service_and_helm_test_pod(chart: Path) -> None:
    rendered = render(chart)
    service = one(objects(rendered), "Service")
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and port["port"] == 9847
    daemonset = one(objects(rendered), "DaemonSet")
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    pod = one(objects(rendered, tests=True), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    url = f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{port['port']}/-/healthy"
    assert pod["spec"]["containers"][0]["command"][-1] == url
    assert pod["spec"]["containers"][0]["command"][0] == "wget"


# ---- Prometheus Operator objects -------------------------------------------------------------------

def kinds(objs: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objs}


def test_auto_follows_the_cluster_api(chart: Path) -> None:
    assert not kinds(objects(render(chart))) & OPERATOR_KINDS
    with_api = kinds(objects(render(chart, api_versions=[OPERATOR_API])))
    assert {"ServiceMonitor", "PrometheusRule"} <= with_api and "PodMonitor" not in with_api


AUTO_MONITORS = {"podMonitor": {"enabled": "auto"}}


@pytest.mark.parametrize(("served", "values", "expected"), [
    (["ServiceMonitor", "PodMonitor"], {}, {"ServiceMonitor"}),   # e.g. CRDs installed for scraping alone
    (["PrometheusRule"], {}, {"PrometheusRule"}),
    (["ServiceMonitor", "PodMonitor", "PrometheusRule"], {}, {"ServiceMonitor", "PrometheusRule"}),
    (None, {}, {"ServiceMonitor", "PrometheusRule"}),   # the group alone: helm template --api-versions <group>
    (["PodMonitor", "PrometheusRule"], AUTO_MONITORS, {"PodMonitor", "PrometheusRule"}),
    (["ServiceMonitor"], AUTO_MONITORS, {"ServiceMonitor"}),
], ids=["monitors-only", "rules-only", "all", "group-only", "podmonitor-auto", "podmonitor-auto-not-served"])
def test_auto_renders_each_kind_the_cluster_serves(
    chart: Path, served: list[str] | None, values: dict[str, Any], expected: set[str]
) -> None:
    """`auto` asked for the API group alone: a cluster serving ServiceMonitor and PodMonitor without the
    PrometheusRule CRD got a PrometheusRule it cannot create, failing the install. Helm lists a live cluster's
    group/version and each group/version/kind; each kind now follows its own."""
    api = [OPERATOR_API, *(f"{OPERATOR_API}/{kind}" for kind in served or ())]
    rendered = kinds(objects(render(chart, values, api_versions=api))) & OPERATOR_KINDS
    assert rendered == expected, f"cluster serving {served}: rendered {sorted(rendered)}"


def test_forced_on_renders_without_the_api(chart: Path) -> None:
    objs = objects(render(chart, ci_values(CHART / "ci" / "monitors-values.yaml")))
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert one(objs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoint = one(objs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["metricRelabelings"][0]["action"] == "keep"


def test_forced_off_stays_off_with_the_api(chart: Path) -> None:
    values = {"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}}
    assert not kinds(objects(render(chart, values, api_versions=[OPERATOR_API]))) & OPERATOR_KINDS


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_instance_is_the_node_name(chart: Path, kind: str) -> None:
    user_relabel = {"targetLabel": "cluster", "replacement": "c1"}
    on = {"enabled": True, "relabelings": [user_relabel]}
    values = {"serviceMonitor": on if kind == "ServiceMonitor" else {"enabled": False},
              "podMonitor": on if kind == "PodMonitor" else {"enabled": False}}
    monitor = one(objects(render(chart, values)), kind)
    endpoints = monitor["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
    relabelings = endpoints[0]["relabelings"]
    assert relabelings[0] == {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance",
                              "action": "replace"}
    assert relabelings[1] == {"regex": "namespace|pod|container", "action": "labeldrop"}
    assert relabelings[2] == user_relabel   # the user's come after


def test_pod_monitor_replaces_an_auto_service_monitor(chart: Path) -> None:
    values = ci_values(CHART / "ci" / "hostpid-off-values.yaml")
    objs = objects(render(chart, values, api_versions=[OPERATOR_API]))
    assert "PodMonitor" in kinds(objs) and "ServiceMonitor" not in kinds(objs)


def test_both_monitors_forced_on_is_refused(chart: Path) -> None:
    with pytest.raises(helm_python.HelmRenderError, match="both true: choose one"):
        render(chart, {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}})


# ---- rules and dashboards are the Grafana bundle's -------------------------------------------------

def test_prometheus_rule_is_the_bundle_rule_files(chart: Path) -> None:
    """One Prometheus (the default): one PrometheusRule with every group of both generated files, read
    through the link files/rules -> grafana/rules_out."""
    assert (chart / "files" / "rules").resolve() == (GRAFANA / "rules_out").resolve()
    rule = one(objects(render(chart, api_versions=[OPERATOR_API])), "PrometheusRule")
    assert rule["metadata"]["name"] == "rel-stepscope"
    assert rule["spec"]["groups"] == with_namespace(rule_groups(RULE_FILES))
    assert not by_kind(objects(render(chart, api_versions=[OPERATOR_API])), "Prometheus")


def with_namespace(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`groups` with the release namespace added to every alert's labels, as the chart does."""
    def labelled(rule: dict[str, Any]) -> dict[str, Any]:
        return {**rule, "labels": {**rule["labels"], "namespace": NAMESPACE}} if "alert" in rule else rule
    return [{**group, "rules": [labelled(rule) for rule in group["rules"]]} for group in groups]


# ---- alerting --------------------------------------------------------------------------------------

def alerts(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for obj in by_kind(objs, "PrometheusRule") for group in obj["spec"]["groups"]
            for rule in group["rules"] if "alert" in rule]


def test_alerts_carry_the_namespace_and_grafana_links(chart: Path) -> None:
    """kube-prometheus-stack groups by namespace and an AlertmanagerConfig only sees alerts of its
    namespace: before issue 28 most alerts had none (aggregations drop it). The links start with
    alerting.grafanaUrl."""
    values = {"alerting": {"grafanaUrl": "https://grafana.example.com"}}
    found = alerts(objects(render(chart, values, api_versions=[OPERATOR_API])))
    assert found and all(rule["labels"]["namespace"] == NAMESPACE for rule in found)
    links = {rule["alert"]: rule["annotations"]["dashboard_url"] for rule in found}
    assert links["StepscopeDataLoadingBottleneck"] == (
        "https://grafana.example.com/d/stepscope-training?var-run={{ $labels.run | urlquery }}"
        "&var-rank={{ $labels.rank | urlquery }}")
    assert all(link.startswith("https://grafana.example.com/d/") for link in links.values())
    plain = alerts(objects(render(chart, {"alerting": {"namespaceLabel": False}}, api_versions=[OPERATOR_API])))
    assert not any("namespace" in rule["labels"] for rule in plain)
    prometheus_side = "{{ $externalLabels.grafana_url }}/d/"   # Prometheus' external label, where it has one
    assert all(rule["annotations"]["dashboard_url"].startswith(prometheus_side) for rule in plain)


HINTS = {"StepscopeTensorCoresIdle", "StepscopeMfuBelowTensorActivity"}


def test_hints_take_the_severity_kube_prometheus_stack_lets_through(chart: Path) -> None:
    """kube-prometheus-stack's default Alertmanager inhibits every severity="info" alert of a namespace where no
    warning or critical fires (its InfoInhibitor): a real Alertmanager 0.25 with its inhibit rules held the chart's
    StepscopeTensorCoresIdle `suppressed`, so the infoReceiver never heard a hint alone. alerting.hintSeverity
    relabels the hints, and the AlertmanagerConfig's hint route matches it; the other alerts keep theirs."""
    values = {"alerting": {"hintSeverity": "hint", "alertmanagerConfig": {"enabled": True}}}
    objs = objects(render(chart, values, api_versions=[OPERATOR_API]))
    severities = {rule["alert"]: rule["labels"]["severity"] for rule in alerts(objs)}
    assert {alert for alert, severity in severities.items() if severity == "hint"} == HINTS
    assert set(severities.values()) == {"hint", "warning", "critical"}
    hint_route = one(objs, "AlertmanagerConfig")["spec"]["route"]["routes"][0]
    assert matchers(hint_route["matchers"]) == {'severity="hint"'}
    with pytest.raises(helm_python.HelmRenderError, match="hintSeverity"):
        render(chart, {"alerting": {"hintSeverity": "warning"}}, api_versions=[OPERATOR_API])


def matchers(items: list[dict[str, str]]) -> set[str]:
    """Operator matchers as Alertmanager's strings: name=~"value"."""
    return {f'{m["name"]}{m["matchType"]}"{m["value"]}"' for m in items}


def operator_routes(routes: list[dict[str, Any]], roles: dict[str, str], parent: str = "default") -> list[tuple]:
    """The chart's routes as comparable tuples, each receiver (a child route's: its parent's unless set) by its
    role in the shipped config."""
    found = []
    for r in routes:
        receiver = roles[r["receiver"]] if "receiver" in r else parent
        found.append((receiver, matchers(r.get("matchers", [])), r.get("groupBy"), r.get("groupInterval"),
                      r.get("repeatInterval"), r.get("continue", False),
                      operator_routes(r.get("routes", []), roles, receiver)))
    return found


def shipped_routes(routes: list[dict[str, Any]], parent: str = "default") -> list[tuple]:
    found = []
    for r in routes:
        receiver = r.get("receiver", parent)
        found.append((receiver, set(r.get("matchers", [])), r.get("group_by"), r.get("group_interval"),
                      r.get("repeat_interval"), r.get("continue", False),
                      shipped_routes(r.get("routes", []), receiver)))
    return found


@pytest.mark.parametrize("pager", ["", "oncall"])
def test_alertmanager_config_routes_and_inhibits_as_the_shipped_config(chart: Path, pager: str) -> None:
    """The chart's AlertmanagerConfig and docker/alertmanager/alertmanager.yml (proven end to end by
    tests/test_alertmanager_e2e.py) route alike, the pager's route there only where a pageReceiver is set, and
    neither inhibits (the rules mute a cause's symptoms)."""
    shipped = yaml.safe_load((REPO / "docker" / "alertmanager" / "alertmanager.yml").read_text())
    receivers = [{"name": name} for name in ("stepscope", "stepscope-info", pager) if name]
    values = {"alerting": {"alertmanagerConfig": {"enabled": True, "pageReceiver": pager, "receivers": receivers}}}
    spec = one(objects(render(chart, values, api_versions=[OPERATOR_API])), "AlertmanagerConfig")["spec"]
    route, top = spec["route"], shipped["route"]
    assert (route["groupBy"], route["groupWait"], route["groupInterval"], route["repeatInterval"]) == \
        (top["group_by"], top["group_wait"], top["group_interval"], top["repeat_interval"])
    roles = {"stepscope": "default", "stepscope-info": "info", pager: "page"}
    expected = [r for r in top["routes"] if pager or r.get("receiver") != "page"]
    assert operator_routes(route["routes"], roles) == shipped_routes(expected)
    assert "inhibitRules" not in spec and "inhibit_rules" not in shipped


def documented_alertmanager_values() -> dict[str, Any]:
    """The AlertmanagerConfig values docs/alerts.md shows (its one yaml block of the alerts section)."""
    (block,) = re.findall(r"```yaml\n(alerting:.*?)```", doc_section("alerts"), re.DOTALL)
    return yaml.safe_load(block)


def rendered_by_alertmanager(tmp_path: Path, text: str, data: dict[str, Any], kind: str = "text") -> str:
    """`text` as Alertmanager 0.25 renders a receiver's field (amtool), with stepscope.tmpl loaded."""
    (tmp_path / "data.json").write_text(json.dumps(data))
    result = amtool("template", "render", f"--template.glob={ALERTMANAGER_DIR / 'templates' / '*.tmpl'}",
                    f"--template.text={text}", f"--template.type={kind}", f"--template.data={tmp_path / 'data.json'}")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_documented_receivers_say_what_the_compose_templates_say(chart: Path, tmp_path: Path) -> None:
    """An AlertmanagerConfig loads no template file: the docs' Slack receiver (apiURL, channel, sendResolved) got
    Alertmanager's defaults, a title and an empty text (a real Alertmanager sent Slack `"text": ""`: no
    description, dashboard, runbook or what to try). The chart fills each Slack, e-mail and PagerDuty field a
    receiver leaves unset with stepscope.tmpl's text, which Alertmanager renders as the compose receivers do."""
    values = documented_alertmanager_values()
    values["alerting"]["alertmanagerConfig"]["receivers"][2]["pagerdutyConfigs"][0]["description"] = "set by the user"
    spec = one(objects(render(chart, values, api_versions=[OPERATOR_API])), "AlertmanagerConfig")["spec"]
    receivers = spec["receivers"]
    slack, page = receivers[0]["slackConfigs"][0], receivers[2]["pagerdutyConfigs"][0]
    assert slack["channel"] == "#training-alerts" and page["description"] == "set by the user"
    alerts = [{"status": "firing",
               "labels": {"alertname": "StepscopeStragglerRank", "run": "llama-ft", "rank": str(rank), "instance": node,
                          "severity": "warning"},
               "annotations": {"summary": f"Rank {rank} of run llama-ft is a straggler",
                               "description": f"Rank {rank} of run llama-ft on {node} has a straggler score of 0.6.",
                               "runbook": "Open the Node dashboard of the rank's node.",
                               "runbook_url": "https://runbook.example/straggler",
                               "dashboard_url": f"https://grafana.example.com/d/stepscope-training?var-rank={rank}"},
               "startsAt": "2026-11-29T10:00:00Z"}
              for rank, node in ((3, "n3"), (5, "n4"))]
    ended = {**alerts[0], "status": "resolved", "labels": {**alerts[0]["labels"], "rank": "7"},
             "startsAt": "2026-11-29T13:50:00Z", "endsAt": "2026-11-29T14:03:05Z"}
    data = {"receiver": "stepscope", "status": "firing", "alerts": [*alerts, ended], "externalURL": "https://am.example",
            "groupLabels": {"alertname": "StepscopeStragglerRank", "run": "llama-ft"},
            "commonLabels": {"alertname": "StepscopeStragglerRank", "run": "llama-ft", "severity": "warning"},
            "commonAnnotations": {"runbook": "Open the Node dashboard of the rank's node."}}
    for field, name in (("title", "stepscope.title"), ("titleLink", "stepscope.dashboard_url"),
                        ("text", "stepscope.text")):
        assert rendered_by_alertmanager(tmp_path, slack[field], data) == \
            rendered_by_alertmanager(tmp_path, f'{{{{ template "{name}" . }}}}', data), field
    text = rendered_by_alertmanager(tmp_path, slack["text"], data)
    for expected in ("run llama-ft rank 3 on n3 (warning), firing since 2026-11-29 10:00:00 UTC: Rank 3 of run "
                     "llama-ft on n3 has a straggler score of 0.6.",
                     "Dashboard: https://grafana.example.com/d/stepscope-training?var-rank=5",
                     "Runbook: https://runbook.example/straggler", "What to try: Open the Node dashboard",
                     "RESOLVED run llama-ft rank 7 on n3 (warning): ended at 2026-11-29 14:03:05 UTC"):
        assert expected in text
    title = rendered_by_alertmanager(tmp_path, slack["title"], data)
    assert title == "[FIRING:2] StepscopeStragglerRank in run llama-ft"


@pytest.mark.parametrize(("values", "message"), [
    ({"alerting": {"alertmanagerConfig": {"enabled": True, "receiver": "slack"}}},
     'receiver "slack" is not among alerting.alertmanagerConfig.receivers'),
    ({"alerting": {"alertmanagerConfig": {"enabled": True, "pageReceiver": "pagerduty"}}},
     'receiver "pagerduty" is not among alerting.alertmanagerConfig.receivers'),
    ({"alerting": {"namespaceLabel": False, "alertmanagerConfig": {"enabled": True}}},
     "alerting.alertmanagerConfig needs alerting.namespaceLabel"),
    ({"alerting": {"alertmanagerConfig": {"enabled": True}}, "sharding": {"enabled": True}},
     "set sharding.alertmanagers"),
])
def test_alerting_misconfigurations_fail_clearly(chart: Path, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(chart, values, api_versions=[OPERATOR_API])


def test_notes_warn_when_sharded_alerts_reach_no_alertmanager(chart: Path) -> None:
    """Sharded Prometheus servers without sharding.alertmanagers alerted nowhere without a word."""
    base = ci_values(CHART / "ci" / "sharding-values.yaml")
    silent = notes(render(chart, {**base, "sharding": {**base["sharding"], "alertmanagers": []}}))
    assert "WARNING: sharding.alertmanagers is empty" in silent and "nobody is notified" in silent
    assert "WARNING" not in notes(render(chart, base))


# ---- the sharded layout ----------------------------------------------------------------------------

def sharded(chart: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    base = ci_values(CHART / "ci" / "sharding-values.yaml")
    return objects(render(chart, {**base, **(values or {})}))


def by_name(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in by_kind(objs, kind)}


def test_sharding_splits_the_rules_by_layer(chart: Path) -> None:
    rules = by_name(sharded(chart), "PrometheusRule")
    assert set(rules) == {"rel-stepscope-node", "rel-stepscope-run"}
    node, run = rules["rel-stepscope-node"], rules["rel-stepscope-run"]
    assert node["spec"]["groups"] == with_namespace(rule_groups((NODE_RULES,)))
    assert run["spec"]["groups"] == with_namespace(rule_groups((RUN_RULES,)))
    assert node["metadata"]["labels"]["stepscope.io/rules"] == "node"
    assert run["metadata"]["labels"]["stepscope.io/rules"] == "run"


def test_shards_scrape_the_exporters_and_load_the_node_rules(chart: Path) -> None:
    objs = sharded(chart)
    prometheus = by_name(objs, "Prometheus")
    shards, top = prometheus["rel-stepscope-shards"]["spec"], prometheus["rel-stepscope-global"]["spec"]
    assert shards["shards"] == 4 and shards["replicas"] == 1
    monitor = one(objs, "ServiceMonitor")
    assert shards["serviceMonitorSelector"]["matchLabels"].items() <= monitor["metadata"]["labels"].items()
    rules = by_name(objs, "PrometheusRule")
    assert shards["ruleSelector"]["matchLabels"].items() <= rules["rel-stepscope-node"]["metadata"]["labels"].items()
    assert not shards["ruleSelector"]["matchLabels"].items() <= rules["rel-stepscope-run"]["metadata"]["labels"].items()
    assert top["ruleSelector"]["matchLabels"].items() <= rules["rel-stepscope-run"]["metadata"]["labels"].items()
    assert "serviceMonitorSelector" not in top and top["enableRemoteWriteReceiver"] is True
    assert shards["externalLabels"] == {"stepscope_shard": "$(SHARD)"} and shards["replicaExternalLabelNameClear"]
    assert shards["resources"]["requests"]["memory"] == "4Gi"
    for spec in (shards, top):
        assert spec["alerting"]["alertmanagers"][0]["name"] == "alertmanager-operated"


def test_shards_write_to_the_global_prometheus_what_the_run_rules_read(chart: Path) -> None:
    objs = sharded(chart)
    (write,) = by_name(objs, "Prometheus")["rel-stepscope-shards"]["spec"]["remoteWrite"]
    service = by_name(objs, "Service")["rel-stepscope-global"]
    assert service["spec"]["selector"] == {"operator.prometheus.io/name": "rel-stepscope-global"}
    (port,) = service["spec"]["ports"]
    assert write["url"] == f"http://rel-stepscope-global.{NAMESPACE}.svc:{port['port']}/api/v1/write"
    relabel = {r["action"]: r["regex"] for r in write["writeRelabelConfigs"]}
    keep, drop = shard_write_filter()  # the filter tests/test_rules.py holds the run rules to
    assert relabel == {"keep": keep, **({"drop": drop} if drop else {})}


def test_sharding_never_labels_a_prometheus_as_the_exporter(chart: Path) -> None:
    objs = sharded(chart)
    service = one([o for o in by_kind(objs, "Service") if "global" not in o["metadata"]["name"]], "Service")
    selector = service["spec"]["selector"].items()
    for obj in by_kind(objs, "Prometheus") + by_kind(objs, "Role") + [by_name(objs, "Service")["rel-stepscope-global"]]:
        assert not selector <= obj["metadata"]["labels"].items(), obj["metadata"]["name"]


def test_sharding_with_an_external_global_layer(chart: Path) -> None:
    url = "http://mimir-distributor.mimir.svc:8080/api/v1/push"
    objs = sharded(chart, {"sharding": {"enabled": True, "global": {"create": False}, "remoteWrite": {"url": url},
                                        "serviceAccountName": "prometheus"}})
    (prometheus,) = by_kind(objs, "Prometheus")
    assert prometheus["spec"]["remoteWrite"][0]["url"] == url
    assert prometheus["spec"]["serviceAccountName"] == "prometheus"
    assert not by_kind(objs, "Role") and "rel-stepscope-global" not in by_name(objs, "Service")
    assert len(by_kind(objs, "PrometheusRule")) == 2   # the run rules are there for Mimir's ruler


def may_discover(objs: list[dict[str, Any]], account: str, namespace: str) -> bool:
    """Whether a rendered RoleBinding in `namespace` lets ServiceAccount `account` (of the release namespace) list
    and watch endpoints there, as the operator's kubernetes_sd_configs do."""
    roles = {o["metadata"]["name"]: o for o in by_kind(objs, "Role") if o["metadata"]["namespace"] == namespace}
    for binding in by_kind(objs, "RoleBinding"):
        if binding["metadata"]["namespace"] != namespace or binding["roleRef"]["name"] not in roles:
            continue
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} not in binding["subjects"]:
            continue
        for rule in roles[binding["roleRef"]["name"]]["rules"]:
            if "" in rule["apiGroups"] and "endpoints" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"]):
                return True
    return False


@pytest.mark.parametrize("layers", [
    {},
    {"shards": {"create": False}},
    {"global": {"create": False}, "remoteWrite": {"url": "http://mimir-distributor.mimir.svc:8080/api/v1/push"}},
], ids=["both", "global-only", "shards-only"])
def test_each_prometheus_runs_as_a_service_account_that_may_find_its_targets_and_alertmanagers(
    chart: Path, layers: dict[str, Any]
) -> None:
    """With shards.create false (your own shards) the chart's global Prometheus named <fullname>-prometheus, a
    ServiceAccount rendered only with the chart's shards: the operator's StatefulSet could not create its pod.
    Each Prometheus now runs as a rendered ServiceAccount, which may discover endpoints in the release namespace
    (the shards' exporters) and in each Alertmanager's namespace (both layers')."""
    alertmanagers = [{"namespace": "alerting", "name": "alertmanager-operated", "port": "web"}]
    objs = sharded(chart, {"sharding": {"enabled": True, "alertmanagers": alertmanagers, **layers}})
    accounts = {o["metadata"]["name"] for o in by_kind(objs, "ServiceAccount")}
    assert by_kind(objs, "Prometheus")
    for prometheus in by_kind(objs, "Prometheus"):
        account = prometheus["spec"]["serviceAccountName"]
        assert account in accounts, f"Prometheus {prometheus['metadata']['name']} runs as {account}, not rendered"
        blind = [namespace for namespace in (NAMESPACE, "alerting") if not may_discover(objs, account, namespace)]
        assert not blind, f"{account} may not list endpoints in {blind}"
    for obj in objs:
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)


def test_releases_of_one_name_in_two_namespaces_share_no_object(chart: Path) -> None:
    """Two teams each install `stepscope` in their namespace, alerting to the one kube-prometheus-stack
    Alertmanager: both rendered Role and RoleBinding stepscope-prometheus in its namespace, and the second install
    failed on the first's ("exists and cannot be imported into the current release")."""
    alertmanagers = [{"namespace": "monitoring", "name": "alertmanager-operated", "port": "web"}]
    values = {"sharding": {"enabled": True, "alertmanagers": alertmanagers}}

    def placed(namespace: str) -> set[tuple[str, str, str]]:
        rendered = render(chart, values, api_versions=[OPERATOR_API], release="stepscope", namespace=namespace)
        return {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects(rendered)}
    team_a, team_b = placed("team-a"), placed("team-b")
    assert not team_a & team_b, sorted(team_a & team_b)
    assert ("Role", "monitoring", "stepscope-prometheus-team-a") in team_a


def test_no_service_account_for_prometheus_when_the_chart_creates_none(chart: Path) -> None:
    """VictoriaMetrics as the global layer and your own shards: nothing runs as the chart's Prometheus account."""
    values = {"sharding": {"enabled": True, "shards": {"create": False}, "global": {"create": False},
                           "remoteWrite": {"url": "http://vm.monitoring.svc:8428/api/v1/write"}}}
    objs = sharded(chart, values)
    assert not by_kind(objs, "Prometheus") and not by_kind(objs, "Role")
    assert [o["metadata"]["name"] for o in by_kind(objs, "ServiceAccount")] == ["rel-stepscope"]


def test_notes_say_which_rules_go_where(chart: Path) -> None:
    text = notes(render(chart, ci_values(CHART / "ci" / "sharding-values.yaml")))
    assert "rel-stepscope-node (per-node rules) goes to the shards" in text
    assert "rel-stepscope-run (per-run rules) to the global layer" in text
    assert f"writing to http://rel-stepscope-global.{NAMESPACE}.svc:9090/api/v1/write" in text


KUBE_PROMETHEUS_STACK_SELECTOR = {"release": "kube-prometheus-stack"}   # the install docs' label


def test_kube_prometheus_stacks_prometheus_selects_no_per_node_work_of_the_sharded_layout(chart: Path) -> None:
    """The install docs' release label on the rules, then sharding.enabled: kube-prometheus-stack's Prometheus
    selected the per-node rules beside the shards and sent every node alert twice; only the per-run rule is its."""
    objs = sharded(chart, {"prometheusRule": {"enabled": True, "additionalLabels": KUBE_PROMETHEUS_STACK_SELECTOR}})
    selected = {o["metadata"]["name"] for o in objs
                if KUBE_PROMETHEUS_STACK_SELECTOR.items() <= o["metadata"].get("labels", {}).items()}
    assert selected == {"rel-stepscope-run"}


@pytest.mark.parametrize(("values", "message"), [
    ({"prometheusRule": {"enabled": False}}, "sharding.enabled needs prometheusRule.enabled"),
    ({"serviceMonitor": {"enabled": True, "additionalLabels": KUBE_PROMETHEUS_STACK_SELECTOR}},
     "would scrape every exporter beside the shards.*leave serviceMonitor.additionalLabels empty"),
    ({"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True, "additionalLabels": {"team": "ml"}}},
     "leave podMonitor.additionalLabels empty"),
    ({"sharding": {"enabled": True, "global": {"create": False}}}, "sharding.remoteWrite.url is empty"),
])
def test_sharding_misconfigurations_fail_clearly(chart: Path, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        sharded(chart, values)


def test_dashboards_are_the_bundle_json(chart: Path) -> None:
    """The Helm SDK follows the chart's link to grafana/dashboards_out: one ConfigMap per dashboard."""
    assert (chart / "files" / "dashboards").is_symlink()
    maps = by_kind(objects(render(chart)), "ConfigMap")
    sources = sorted((GRAFANA / "dashboards_out").glob("*.json"))
    assert len(maps) == len(sources) > 0
    shipped = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        shipped.update(config_map["data"])
    assert shipped == {p.name: p.read_text() for p in sources}
    assert all(json.loads(text)["title"] for text in shipped.values())


def dashboard_annotations(chart: Path, dashboards: dict[str, Any] | None = None) -> list[dict[str, str] | None]:
    maps = by_kind(objects(render(chart, {"dashboards": dashboards} if dashboards else {})), "ConfigMap")
    return [config_map["metadata"].get("annotations") for config_map in maps]


def test_dashboards_land_in_the_documented_folder(chart: Path) -> None:
    """docs/dashboards.md names the folder stepscope; the ConfigMaps carried no annotation the sidecar reads a
    folder from, so kube-prometheus-stack's Grafana put them in General."""
    documented = re.search(r"Grafana folder \*\*(\w+)\*\*", (REPO / "docs" / "dashboards.md").read_text()).group(1)
    assert set(map(str, dashboard_annotations(chart))) == {str({"grafana_folder": documented})}
    assert set(map(str, dashboard_annotations(chart, {"folder": ""}))) == {"None"}
    own = {"grafana_folder": "ML", "team": "ml"}
    assert set(map(str, dashboard_annotations(chart, {"annotations": own}))) == {str(own)}


# ---- NetworkPolicy ---------------------------------------------------------------------------------

def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector applied to labels ({} selects everything)."""
    tests = {"In": lambda e: labels.get(e["key"]) in e["values"],
             "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
             "Exists": lambda e: e["key"] in labels, "DoesNotExist": lambda e: e["key"] not in labels}
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(tests[e["operator"]](e) for e in selector.get("matchExpressions", [])))


def admits(policy: dict[str, Any], pod: dict[str, str], namespace: str, port: int) -> bool:
    """Whether the policy lets a pod (labels) of `namespace` (labelled kubernetes.io/metadata.name only, unless
    it is "ml-training": team=ml) reach `port`, as a CNI enforces the ingress rules."""
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    if namespace == "ml-training":
        namespace_labels["team"] = "ml"

    def peer_matches(peer: dict[str, Any]) -> bool:
        if "namespaceSelector" in peer:
            in_namespace = selects(peer["namespaceSelector"], namespace_labels)
        else:
            in_namespace = "podSelector" in peer and namespace == policy["metadata"]["namespace"]
        return in_namespace and selects(peer.get("podSelector", {}), pod)

    return any(any(p["port"] == port for p in rule["ports"]) and any(map(peer_matches, rule["from"]))
               for rule in policy["spec"]["ingress"])


KUBE_PROMETHEUS_STACK_POD = {"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus-stack-prometheus"}
SHARD_POD = {"app.kubernetes.io/name": "prometheus", "operator.prometheus.io/name": "rel-stepscope-shards"}
TRAINING_POD = {"app": "trainer"}


def test_network_policy_lets_the_scrapers_pushers_and_helm_test_through_a_default_deny(chart: Path) -> None:
    """A default-deny NetworkPolicy blocked every scrape and push and the chart offered no way through; the
    opt-in policy selects the exporter's pods and opens its port to Prometheus, the training pods and helm test."""
    rendered = render(chart, {"networkPolicy": {"enabled": True}})
    policy, daemonset = one(objects(rendered), "NetworkPolicy"), one(objects(rendered), "DaemonSet")
    kubernetes_validate.validate(policy, KUBE_VERSIONS[0], strict=True)
    pod = daemonset["spec"]["template"]
    assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (port,) = exporter_container(objects(rendered))["ports"]
    test_pod = one(objects(rendered, tests=True), "Pod")["metadata"]["labels"]
    for client, namespace in [(KUBE_PROMETHEUS_STACK_POD, "kube-prometheus-stack"), (SHARD_POD, NAMESPACE),
                              (TRAINING_POD, "ml-training"), (test_pod, NAMESPACE)]:
        assert admits(policy, client, namespace, port["containerPort"]), (client, namespace)


def test_network_policy_admits_only_the_peers_given(chart: Path) -> None:
    """An empty peer list admits nobody (a rule without `from` would admit every source); narrowed pushers
    keep other namespaces out."""
    training_only = [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]
    policy = one(objects(render(chart, {"networkPolicy": {"enabled": True, "scrapers": [],
                                                          "pushers": training_only}})), "NetworkPolicy")
    assert all(rule["from"] for rule in policy["spec"]["ingress"])
    assert not admits(policy, KUBE_PROMETHEUS_STACK_POD, "kube-prometheus-stack", 9847)
    assert admits(policy, TRAINING_POD, "ml-training", 9847) and not admits(policy, TRAINING_POD, "default", 9847)
    assert not by_kind(objects(render(chart)), "NetworkPolicy")


# ---- object names ----------------------------------------------------------------------------------

DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")   # RFC 1035: a Service's name
LONG_RELEASE = "ml-platform-gpu-monitoring-eu-west1-training-cluster1"   # 53 characters, Helm's longest
assert len(LONG_RELEASE) == 53


def name_problems(obj: dict[str, Any]) -> list[str]:
    """What Kubernetes (or the operator that turns the object into pods) would refuse in the object's name:
    a Service's name is an RFC 1035 label (63), most others a DNS subdomain (253). The Prometheus Operator runs
    a Prometheus as StatefulSet prometheus-<name>[-shard-<n>], whose pods are only created while that name has
    at most 52 characters (their controller-revision-hash label is it plus 11); the VictoriaMetrics operator
    gives a VMAlert the Service vmalert-<name>."""
    name, kind = obj["metadata"]["name"], obj["kind"]
    checks = [(f"{kind} {name}", name, DNS_LABEL if kind == "Service" else DNS_SUBDOMAIN,
               63 if kind == "Service" else 253)]
    if kind == "Prometheus":
        last = obj["spec"].get("shards", 1) - 1
        statefulset = f"prometheus-{name}" + (f"-shard-{last}" if last else "")
        checks.append((f"the operator's StatefulSet {statefulset}", statefulset, DNS_LABEL, 52))
    if kind == "VMAlert":
        checks.append((f"the operator's Service vmalert-{name}", f"vmalert-{name}", DNS_LABEL, 63))
    return [f"{what}: {len(text)} characters, at most {limit}" if len(text) > limit
            else f"{what}: not {pattern.pattern}"
            for what, text, pattern, limit in checks if len(text) > limit or not pattern.fullmatch(text)]


LAYOUTS = {
    "default": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": False},
                "alerting": {"alertmanagerConfig": {"enabled": True}},
                "webConfig": {"basicAuthUsers": {"p": "$2y$10$" + "a" * 53},
                              "scrapeCredentials": {"existingSecret": "c"}}},
    "sharded": ci_values(CHART / "ci" / "sharding-values.yaml"),
    "victoriametrics": {"sharding": {"enabled": True, "global": {"create": False},
                                     "remoteWrite": {"url": "http://vm.monitoring.svc:8428/api/v1/write"},
                                     "vmalert": {"create": True, "url": "http://vm.monitoring.svc:8428",
                                                 "notifierURL": "http://am.monitoring.svc:9093"}}},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("release", "values"), [(LONG_RELEASE, {}), ("rel", {"fullnameOverride": "x" * 63}),
                                                  ("gpu-monitoring-prod-eu1", {})],
                         ids=["release-53", "fullnameOverride-63", "release-23"])
def test_a_long_release_name_gives_every_object_its_own_valid_name(
    chart: Path, layout: str, release: str, values: dict[str, Any]
) -> None:
    """Every name was cut at 63 characters whole: from a 32-character release name (a 42-character
    fullnameOverride) on, the three dashboard ConfigMaps had one name (the install fails, or one dashboard wins);
    at 53 the shards', the global layer's Prometheus and the exporter's Service too. Every object keeps a name of
    its own per kind, within what Kubernetes and the operators take (from a 23-character release name on, the
    shards' StatefulSets were too long for their pods to be created)."""
    rendered = render(chart, {**LAYOUTS[layout], **values}, api_versions=[OPERATOR_API], release=release)
    objs = objects(rendered) + objects(rendered, tests=True)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(by_kind(objs, "ConfigMap")) == len(list((GRAFANA / "dashboards_out").glob("*.json")))
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"two objects of a kind share a name: {duplicates}"
    problems = [problem for obj in objs for problem in name_problems(obj)]
    assert not problems, problems


def test_long_release_names_that_share_their_start_keep_their_prometheus_apart(chart: Path) -> None:
    """The names cut to fit carry a hash of the whole fullname: two releases in one namespace whose names differ
    at the end never share a Prometheus; short names stay what they were."""
    def prometheus_names(release: str) -> set[str]:
        rendered = render(chart, LAYOUTS["sharded"], api_versions=[OPERATOR_API], release=release)
        return {o["metadata"]["name"] for o in by_kind(objects(rendered), "Prometheus")}
    first, second = prometheus_names(LONG_RELEASE), prometheus_names(LONG_RELEASE[:-1] + "b")
    assert len(first) == len(second) == 2 and not first & second, (first, second)
    assert prometheus_names("rel") == {"rel-stepscope-shards", "rel-stepscope-global"}


@pytest.mark.parametrize(("linked", "output", "pattern"), [("dashboards", "dashboards_out", "*.json"),
                                                        ("rules", "rules_out", "*.rules.yml")])
def test_packaged_chart_holds_the_linked_outputs_as_files(chart: Path, tmp_path: Path, linked: str, output: str,
                                                          pattern: str) -> None:
    """`helm package` stores what the links point at, so a chart from a repository needs no checkout."""
    assert (chart / "files" / linked).is_symlink()
    archive = helm_python.package(chart, destination=tmp_path)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers() if f"/files/{linked}/" in m.name}
        assert all(m.isfile() for m in members.values()), "links in the package"
        packaged = {Path(name).name: tar.extractfile(m).read().decode() for name, m in members.items()}
    assert packaged == {p.name: p.read_text() for p in (GRAFANA / output).glob(pattern)}
    assert packaged, f"nothing under files/{linked} in the package"


def test_packaged_chart_renders_the_rules_without_the_checkout(tmp_path: Path) -> None:
    """The packaged chart, unpacked away from the repository, renders the same PrometheusRules."""
    archive = helm_python.package(CHART, destination=tmp_path)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    unpacked = tmp_path / "unpacked" / "stepscope"
    rule = one(objects(render(unpacked, api_versions=[OPERATOR_API])), "PrometheusRule")
    assert rule["spec"]["groups"] == with_namespace(rule_groups(RULE_FILES))
    layers = by_name(sharded(unpacked), "PrometheusRule")
    assert layers["rel-stepscope-node"]["spec"]["groups"] == with_namespace(rule_groups((NODE_RULES,)))
    assert layers["rel-stepscope-run"]["spec"]["groups"] == with_namespace(rule_groups((RUN_RULES,)))


def test_chart_without_generated_files_fails_clearly(tmp_path: Path) -> None:
    bare = bare_copy(tmp_path)
    missing_dashboards = r"dashboards/\*\.json are missing.*python -m grafana generate"
    with pytest.raises(helm_python.HelmRenderError, match=missing_dashboards):
        render(bare)
    missing_rules = r"stepscope-node\.rules\.yml is missing.*python -m grafana generate"
    with pytest.raises(helm_python.HelmRenderError, match=missing_rules):
        render(bare, {"dashboards": {"enabled": False}}, api_versions=[OPERATOR_API])


# ---- values schema ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "message"), [
    ({"hostPid": True}, r"at '': additional properties 'hostPid' not allowed"),
    ({"serviceMonitor": {"additionalLabel": {}}},
     r"at '/serviceMonitor': additional properties 'additionalLabel'"),
    ({"hostPID": "yes"}, r"at '/hostPID': got string, want boolean"),
    ({"port": "9847"}, r"at '/port': got string, want integer"),
    ({"ingest": {"ttl": "10m"}}, r"at '/ingest/ttl': got string, want number"),   # seconds, as the flag
    ({"serviceMonitor": {"enabled": "yes"}},
     r"at '/serviceMonitor/enabled': value must be one of 'auto', true, false"),
    ({"collectors": ["node", "disk"]}, r"at '/collectors/1': value must be one of 'node', 'gpu', 'process'"),
    ({"serviceMonitor": {"additionalLabels": {"release": 1}}}, r"/serviceMonitor/additionalLabels/release"),
    ({"securityContext": {"runAsUser": "root"}},
     r"at '/securityContext/runAsUser': got string, want integer"),
    ({"sharding": {"shards": {"count": 0}}}, r"at '/sharding/shards/count': minimum"),
    ({"sharding": {"remoteWrite": {"url": "mimir:8080"}}}, r"at '/sharding/remoteWrite/url'"),
    ({"sharding": {"enabled": "yes"}}, r"at '/sharding/enabled': got string, want boolean"),
    ({"alerting": {"grafanaUrl": "https://grafana.example.com/"}}, r"at '/alerting/grafanaUrl'"),
    ({"alerting": {"alertmanagerConfig": {"groupInterval": "1 minute"}}},
     r"at '/alerting/alertmanagerConfig/groupInterval'"),
    ({"networkPolicy": {"scrapers": [{"podSelector": {"matchLabel": {"app": "prometheus"}}}]}},
     r"at '/networkPolicy/scrapers/0/podSelector'.*matchLabel"),
    ({"dashboards": {"folder": "../etc"}}, r"at '/dashboards/folder'"),
])
def test_schema_rejects_bad_values(chart: Path, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(chart, values)
    report = lint(chart, values)
    assert any(re.search(message, m["error"]) for m in report["messages"] if m["severity"] == 3), report


def test_schema_closes_every_object() -> None:
    """Every object level either forbids unknown keys or types its values; the only open objects are
    embedded Kubernetes API objects, which the API server validates."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: dict[str, Any], path: str) -> None:
        if node.get("type") == "object" and "additionalProperties" not in node:
            open_objects.append(path)
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}")
        for keyword in ("items", "additionalProperties"):
            if isinstance(node.get(keyword), dict):
                walk(node[keyword], f"{path}[]")
        for child in node.get("anyOf", []):
            walk(child, path)

    walk(schema, "")
    assert schema["additionalProperties"] is False
    assert sorted(open_objects) == sorted([
        ".extraEnv[].valueFrom", ".podSecurityContext.seLinuxOptions", ".podSecurityContext.appArmorProfile",
        ".securityContext.seLinuxOptions", ".securityContext.appArmorProfile",
        ".affinity.nodeAffinity", ".affinity.podAffinity", ".affinity.podAntiAffinity", ".global",
        ".alerting.alertmanagerConfig.receivers[]",   # the operator's receivers, validated by its CRD
    ])


def test_values_file_matches_schema_keys(chart: Path) -> None:
    """Every default has a schema entry (the render above would fail otherwise) and vice versa."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(schema["properties"]) - {"global"} == set(defaults)


def test_readme_training_pod_snippet_matches_notes(chart: Path) -> None:
    section = doc_section("deployment")
    snippet = next(b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "STEPSCOPE_PUSH_URL" in b)
    documented = {e["name"]: e for e in yaml.safe_load(snippet)["containers"][0]["env"]}
    text = notes(render(chart))
    printed = {e["name"]: e for e in yaml.safe_load(text[text.index("  env:"):])["env"]}
    assert documented.keys() == printed.keys()
    assert documented["HOST_IP"] == printed["HOST_IP"]
    assert documented["STEPSCOPE_PUSH_URL"] == printed["STEPSCOPE_PUSH_URL"]
    # docs/deployment.md assumes release "stepscope"; the tests render release "rel".
    documented_ref = documented["STEPSCOPE_PUSH_TOKEN"]["valueFrom"]["secretKeyRef"]
    printed_ref = printed["STEPSCOPE_PUSH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert documented_ref == {**printed_ref, "name": printed_ref["name"].replace("rel-", "", 1)}


def _push_from(source_ip: str, port: int, token: str | None = None) -> int:
    """A push to 127.0.0.1:port sent from `source_ip` (any 127/8 address is this host's loopback)."""
    body = "# TYPE stepscope_steps_total counter\nstepscope_steps_total 1\n"
    headers = {"Content-Type": "text/plain", **({"Authorization": f"Bearer {token}"} if token else {})}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source_ip, 0))
    try:
        connection.request("PUT", f"/metrics/job/stepscope/run/r/rank/{source_ip.rsplit('.', 1)[1]}", body, headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_ingest_allow_admits_its_networks_without_the_token(chart: Path, tmp_path: Path) -> None:
    """The rendered container args and Secret, run by a real exporter: an allowed network pushes without
    the token the chart always sets, every other client needs it."""
    objs = objects(render(chart, {"ingest": {"allow": ["127.0.0.2/32"]}}))
    token = base64.b64decode(one(objs, "Secret")["data"]["token"]).decode()
    token_file = tmp_path / "token"
    token_file.write_text(token)
    port = free_port()
    local = {"--ingest-token-file": str(token_file), "--web.listen-address": f"127.0.0.1:{port}", "--collectors": "",
             "--path.rootfs": "/"}  # the node's root: this machine's
    args = [f"{arg.split('=', 1)[0]}={local[arg.split('=', 1)[0]]}" if arg.split("=", 1)[0] in local else arg
            for arg in exporter_container(objs)["args"]]
    assert "--ingest-allow-without-token=127.0.0.2/32" in args
    with running([sys.executable, "-m", "stepscope.exporter", *args], f"http://127.0.0.1:{port}/-/healthy",
                 tmp_path / "exporter.log", env=exporter_env()):
        assert _push_from("127.0.0.2", port) == 200  # allowed network, no token
        assert _push_from("127.0.0.3", port) == 401  # elsewhere, no token
        assert _push_from("127.0.0.1", port) == 401  # loopback is not special once a token is set
        assert _push_from("127.0.0.3", port, token) == 200
        assert _push_from("127.0.0.3", port, "wrong") == 401


def test_the_rendered_exporter_reads_the_nodes_filesystems_and_interfaces(chart: Path, tmp_path: Path) -> None:
    """The DaemonSet's default args run by a real exporter, its host-root volume being this machine's / (as
    the kubelet mounts the hostPath): the node's / is published as / with its size, and the network interfaces
    are PID 1's, containers' own left out."""
    import shutil

    from stepscope.exporter.collectors.node import (
        DEFAULT_NETDEV_EXCLUDE,
        NODE_NET_DEV,
        is_published_interface,
        read_net_dev,
    )
    from stepscope_testkit.processes import sample_values, scrape

    objs = objects(render(chart, {"ingest": {"enabled": False}}))
    (mount,) = exporter_container(objs)["volumeMounts"]
    (tmp_path / "host-root").symlink_to("/")
    port = free_port()
    local = {"--web.listen-address": f"127.0.0.1:{port}", "--collectors": "node",
             "--path.rootfs": str(tmp_path / "host-root")}
    args = [f"{arg.split('=', 1)[0]}={local[arg.split('=', 1)[0]]}" if arg.split("=", 1)[0] in local else arg
            for arg in exporter_container(objs)["args"]]
    assert f"--path.rootfs={mount['mountPath']}" in exporter_container(objs)["args"]
    assert "--collector.node.host-network" in args
    with running([sys.executable, "-m", "stepscope.exporter", *args], f"http://127.0.0.1:{port}/-/ready",
                 tmp_path / "exporter.log", env=exporter_env()):  # ready: the first cycle is done
        text = scrape(f"http://127.0.0.1:{port}")
    assert sample_values(text, "stepscope_node_filesystem_size_bytes", path="/", mountpoint="/") == [
        shutil.disk_usage("/").total]
    published = {line.split('device="')[1].split('"')[0] for line in text.splitlines()
                 if line.startswith("stepscope_node_network_receive_bytes_total{")}
    expected = {name for name in read_net_dev(NODE_NET_DEV)
                if is_published_interface(name, re.compile(DEFAULT_NETDEV_EXCLUDE))}
    assert published == expected and "lo" in published


def test_notes_commands_each_finish(chart: Path) -> None:
    """`kubectl port-forward` never returns: NOTES must not chain a command after it with &&."""
    lines = [line.strip() for line in notes(render(chart)).splitlines()
             if line.strip().startswith("kubectl") and "port-forward" in line]
    assert lines and all(line.endswith("&") and "&&" not in line for line in lines)
