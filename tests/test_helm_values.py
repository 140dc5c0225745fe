"""The chart as a GPU-cluster operator uses it: every value documented in the schema and used by a template,
typos refused, an image pinned by digest, a namespace override, the monitors keeping the exporter's own pod
attribution labels, and the combinations Kubernetes or the Prometheus Operator would refuse (or accept and
then never converge on) refused at render time with one line."""

import argparse
import copy
import functools
import http.server
import ipaddress
import json
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml

from stepscope.contract import THRESHOLDS
from stepscope_testkit.loopback import LoopbackServer, serving
from tests.support.helm_chart import (
    CHART,
    NAMESPACE,
    OPERATOR_API,
    REPO,
    SAFE_LOADER,
    by_kind,
    exporter_container,
    lint,
    notes,
    objects,
    one,
    render,
)
from tests.support.prometheus import running_prometheus_config

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
HASH = "$2y$10$" + "a" * 53
DIGEST = "sha256:" + "0123456789abcdef" * 4
KUBE = kubernetes_validate.utils.latest_version()


def schema_properties(node: dict[str, Any] = SCHEMA, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, schema) of every named property, `[]` standing for an array item or a map value."""
    for key, child in node.get("properties", {}).items():
        yield f"{path}.{key}", child
        yield from schema_properties(child, f"{path}.{key}")
    for keyword in ("items", "additionalProperties"):
        if isinstance(node.get(keyword), dict):
            yield from schema_properties(node[keyword], f"{path}[]")


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ---- the values schema -----------------------------------------------------------------------------

def test_every_schema_property_has_a_type_and_a_description() -> None:
    """`helm show values`/IDEs/artifacthub read the schema: every property says what it holds and what it
    is for (an enum alone left `helm lint` saying nothing of the type, and 200 properties had no word)."""
    untyped = [path for path, node in schema_properties() if "type" not in node]
    undescribed = [path for path, node in schema_properties() if not node.get("description", "").strip()]
    assert not untyped, f"no type: {untyped}"
    assert not undescribed, f"no description: {undescribed}"


def leaves(values: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*path, key))
        else:
            yield (*path, key), value


# A schema-valid value unlike the default, where changing the default generically would not be valid.
CHANGED: dict[tuple[str, ...], Any] = {
    ("image", "pullPolicy"): "Always", ("image", "digest"): DIGEST, ("gpuSource",): "dcgm", ("logLevel",): "debug",
    ("collectors",): ["node"], ("filesystemPaths",): ["/data"], ("extraArgs",): ["--ingest-max-groups=9"],
    ("extraEnv",): [{"name": "A", "value": "b"}], ("imagePullSecrets",): [{"name": "pull"}],
    ("ingest", "allow"): ["10.0.0.0/8"], ("ingest", "ttl"): 100, ("service", "type"): "NodePort",
    ("updateStrategy", "type"): "OnDelete", ("webConfig", "basicAuthUsers"): {"u": HASH},
    ("serviceMonitor", "enabled"): False, ("prometheusRule", "enabled"): False, ("podMonitor", "enabled"): True,
    ("serviceMonitor", "relabelings"): [{"action": "drop"}],
    ("serviceMonitor", "metricRelabelings"): [{"action": "drop"}],
    ("podMonitor", "relabelings"): [{"action": "drop"}], ("podMonitor", "metricRelabelings"): [{"action": "drop"}],
    ("sharding", "alertmanagers"): [{"name": "am", "port": "web"}],
    ("sharding", "remoteWrite", "url"): "http://mimir/api/v1/push", ("sharding", "vmalert", "url"): "http://vm:8428",
    ("sharding", "vmalert", "notifierURL"): "http://am:9093", ("alerting", "grafanaUrl"): "https://grafana.example",
    ("tolerations",): [], ("sharding", "prometheusVersion"): "v2.50.0",
    ("affinity",): {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"}]}},
    ("webConfig", "authStateFile", "hostPath"): "/var/lib/stepscope",
    ("alerting", "alertmanagerConfig", "receivers"): [{"name": "stepscope"}, {"name": "stepscope-info"}, {"name": "z"}],
    ("sharding", "remoteWrite", "drop"): "foo", ("sharding", "remoteWrite", "keep"): "bar",
    ("podSecurityContext", "seccompProfile", "type"): "Unconfined",
    ("securityContext", "seccompProfile", "type"): "Unconfined",
    ("sharding", "shards", "resources"): {"requests": {"cpu": "1"}},
    ("sharding", "global", "resources"): {"requests": {"cpu": "1"}},
    ("namespaceOverride",): "gpu-monitoring", ("updateStrategy", "rollingUpdate", "maxSurge"): 0,
}
# Where a value takes effect only beside others (monitors, web security, sharding, vmalert).
CONTEXTS: list[dict[str, Any]] = [
    {},
    {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": False}, "podResources": {"enabled": True},
     "webConfig": {"basicAuthUsers": {"p": HASH}, "tls": {"existingSecret": "t"},
                   "scrapeCredentials": {"existingSecret": "c"}}},
    {"webConfig": {"existingSecret": "w"}},
    {"sharding": {"enabled": True, "alertmanagers": [{"name": "am", "port": "web"}]},
     "alerting": {"alertmanagerConfig": {"enabled": True}}},
    {"sharding": {"enabled": True, "global": {"create": False}, "remoteWrite": {"url": "http://vm:8428/api/v1/write"},
                  "vmalert": {"create": True, "url": "http://vm:8428", "notifierURL": "http://am:9093"}}},
    {"updateStrategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, "ingest": {"hostPort": False}},
]


def changed(path: tuple[str, ...], value: Any) -> Any:
    if path in CHANGED:
        return CHANGED[path]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        number = re.fullmatch(r"(\d+)(\D+)", value)
        return f"{int(number[1]) + 1}{number[2]}" if number else f"{value}x" if value else "x"
    if isinstance(value, dict):
        return {"example.com/k": "v"}
    return []


def test_every_value_changes_what_the_chart_renders() -> None:
    """A value no template reads is a setting that silently does nothing: each default in values.yaml,
    changed to another valid value, changes the rendered manifests in at least one setting it belongs to."""
    rendered: dict[int, dict[str, str]] = {}
    ignored = []
    for path, value in leaves(DEFAULTS):
        new = changed(path, value)
        for index, context in enumerate(CONTEXTS):
            base = merged(DEFAULTS, context)
            if index not in rendered:
                rendered[index] = render(CHART, base, api_versions=[OPERATOR_API])
            values = copy.deepcopy(base)
            node = values
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = new
            try:
                if render(CHART, values, api_versions=[OPERATOR_API]) != rendered[index]:
                    break
            except helm_python.HelmRenderError:
                continue   # refused beside this setting (e.g. basic auth without scrape credentials)
        else:
            ignored.append(".".join(path))
    assert not ignored, f"values no template reads: {ignored}"


def schema_has(path: str) -> bool:
    node = SCHEMA
    for part in path.split("."):
        if part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:  # an object the schema leaves to the API server (securityContext.seLinuxOptions) takes any key
            return node.get("type") == "object" and "additionalProperties" not in node
    return True


def test_every_chart_value_the_docs_name_is_one_the_chart_has() -> None:
    """What the docs tell a user to set (`ingest.token.existingSecret`, `gpuNodesOnly: false`, ...) is a value
    the schema admits: a misspelt or renamed key in the docs is a setting that is refused, or does nothing."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {(path.name, match) for path in docs for match in re.findall(
        r"`([a-zA-Z]\w*(?:\.\w+)+)(?:[=:][^`]*)?`", path.read_text())}
    unknown = sorted((page, path) for page, path in named
                     if path.split(".")[0] in SCHEMA["properties"] and not path.endswith((".yml", ".yaml"))
                     and not schema_has(path))
    assert not unknown, f"values the docs name that the chart does not have: {unknown}"


@pytest.mark.parametrize(("values", "message"), [
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "efect": "NoSchedule"}]},
     r"at '/tolerations/0': additional properties 'efect' not allowed"),
    ({"webConfig": {"tls": {"existingsecret": "tls"}}}, r"at '/webConfig/tls': additional properties 'existingsecret'"),
    ({"image": {"sha": DIGEST}}, r"at '/image': additional properties 'sha' not allowed"),
    ({"namespaceOverides": "x"}, r"at '': additional properties 'namespaceOverides' not allowed"),
    ({"image": {"digest": "0123abcd"}}, r"at '/image/digest'"),
    ({"namespaceOverride": "GPU_Monitoring"}, r"at '/namespaceOverride'"),
    ({"terminationGracePeriodSeconds": "30s"}, r"at '/terminationGracePeriodSeconds': got string, want integer"),
    # what the exporter refuses at start (a CrashLoopBackOff on every node): --collect-interval 0.1 to 3600 s,
    # --ingest-ttl 1 s to 30 days
    ({"collectInterval": 0.01}, r"at '/collectInterval': minimum"),
    ({"collectInterval": 1e308}, r"at '/collectInterval': maximum"),
    ({"ingest": {"ttl": 1e308}}, r"at '/ingest/ttl'"),
    # --filesystem-paths is comma-separated: "/data,/x" became two paths
    ({"filesystemPaths": ["/data,/x"]}, r"at '/filesystemPaths/0'"),
])
def test_a_typo_or_a_wrong_type_is_refused_by_lint_and_template(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(CHART, values)
    report = lint(CHART, values)
    assert any(re.search(message, m["error"]) for m in report["messages"] if m["severity"] == 3), report


def test_a_values_file_s_large_whole_number_renders_as_digits() -> None:
    """A values file's numbers reach the templates as floats, and Go prints 10000000.0 as 1e+07, which the API
    server refuses for an integer field: `terminationGracePeriodSeconds: 10000000` rendered `1e+07`."""
    values = helm_python.values_from_yaml("terminationGracePeriodSeconds: 10000000\n")
    assert "terminationGracePeriodSeconds: 10000000\n" in render(CHART, values)["stepscope/templates/daemonset.yaml"]
    assert pod_spec(values)["terminationGracePeriodSeconds"] == 10_000_000


# ---- image and namespace ---------------------------------------------------------------------------

def test_an_image_pinned_by_digest_runs_that_digest() -> None:
    values = {"image": {"repository": "registry.example.com/mirror/stepscope-exporter", "tag": "0.1.0",
                        "digest": DIGEST}}
    image = exporter_container(objects(render(CHART, values)))["image"]
    assert image == f"registry.example.com/mirror/stepscope-exporter@{DIGEST}"
    assert exporter_container(objects(render(CHART)))["image"] == "ghcr.io/stepscope/stepscope-exporter:0.1.0"


@pytest.mark.parametrize("tag", ["2", "20240101", "0"])
def test_a_numeric_image_tag_from_set_runs_that_tag(tag: str) -> None:
    """`--set image.tag=2` makes the tag a number, and the schema refused it (`at '/image/tag': got number, want
    string`), so a registry's numeric tags needed --set-string. A whole number is now taken as its digits: the
    image is repository:2 (and 20240101 stays 20240101, not 2.0240101e+07); the helm test pod's tag alike."""
    values = helm_python.parse_set_string(f"image.tag={tag},test.image.tag={tag}")
    assert isinstance(values["image"]["tag"], int)
    rendered = render(CHART, values)
    assert exporter_container(objects(rendered))["image"] == f"ghcr.io/stepscope/stepscope-exporter:{tag}"
    (test_pod,) = objects(rendered, tests=True)
    assert test_pod["spec"]["containers"][0]["image"].endswith(f":{tag}")


@pytest.mark.parametrize("values_file", ["image:\n  tag: \"\"\n", "image:\n  tag: null\n"], ids=["empty", "null"])
def test_no_image_tag_runs_the_app_version(values_file: str) -> None:
    image = exporter_container(objects(render(CHART, helm_python.values_from_yaml(values_file))))["image"]
    assert image == "ghcr.io/stepscope/stepscope-exporter:0.1.0"


def test_a_fractional_image_tag_is_refused() -> None:
    """A values file's `tag: 1.10` is the number 1.1 by the time the chart sees it: refused, not run as 1.1."""
    with pytest.raises(helm_python.HelmValuesError, match=r"at '/image/tag'"):
        render(CHART, helm_python.values_from_yaml("image:\n  tag: 1.10\n"))


ANY_NAMESPACE = re.compile(r"\.(?P<ns>[a-z0-9-]+)\.svc\b")


def namespaces_named(objs: list[dict[str, Any]], text: str) -> set[str]:
    """Every namespace the objects live in or point at: metadata, monitors' namespaceSelector, role subjects,
    Service DNS names in URLs and server names."""
    found = {o["metadata"]["namespace"] for o in objs if "namespace" in o["metadata"]}
    for obj in objs:
        found |= set(obj.get("spec", {}).get("namespaceSelector", {}).get("matchNames", []))
        found |= {s["namespace"] for s in obj.get("subjects", []) if "namespace" in s}
    return found | {m["ns"] for m in ANY_NAMESPACE.finditer(text)}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_namespace_override_moves_every_object_and_reference(layout: str) -> None:
    """namespaceOverride (as dcgm-exporter's chart has it): an umbrella chart installs stepscope into its
    own namespace; every object, the monitors' namespaceSelector, the TLS server name, the helm test URL,
    the sharded layout's write URL and role binding, and NOTES follow it, and nothing names the release's."""
    values: dict[str, Any] = {"namespaceOverride": "gpu-monitoring", "serviceMonitor": {"enabled": True},
                              "webConfig": {"tls": {"existingSecret": "tls"}}}
    if layout == "sharded":
        values["sharding"] = {"enabled": True, "alertmanagers": [{"name": "am", "port": "web"}]}
    rendered = render(CHART, values, api_versions=[OPERATOR_API])
    objs = objects(rendered) + objects(rendered, tests=True)
    text = "\n".join(t for p, t in rendered.items() if not p.endswith(".json"))
    assert namespaces_named(objs, text) == {"gpu-monitoring"}
    assert "-n gpu-monitoring port-forward" in notes(rendered)
    dashboards = objects(render(CHART, {**values, "dashboards": {"namespace": "grafana"}}, api_versions=[OPERATOR_API]))
    assert {o["metadata"]["namespace"] for o in by_kind(dashboards, "ConfigMap")} == {"grafana"}


# ---- the DaemonSet ---------------------------------------------------------------------------------

def tolerated(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' ToleratesTaint."""
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint["effect"]:
            continue
        if toleration.get("key") and toleration["key"] != taint["key"]:
            continue
        if toleration.get("operator", "Equal") == "Exists" or toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def test_tolerations_for_gpu_taints_are_configurable() -> None:
    """The GPU Operator's and GKE's taint is tolerated by default; a site's own taint is a value away."""
    pod = one(objects(render(CHART)), "DaemonSet")["spec"]["template"]["spec"]
    assert tolerated(pod["tolerations"], {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
    assert not tolerated(pod["tolerations"], {"key": "dedicated", "value": "training", "effect": "NoSchedule"})
    own = [{"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}]
    pod = one(objects(render(CHART, {"tolerations": own})), "DaemonSet")["spec"]["template"]["spec"]
    assert tolerated(pod["tolerations"], {"key": "dedicated", "value": "training", "effect": "NoSchedule"})


GPU_NODE_LABELS = {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}


def pod_spec(values: dict[str, Any]) -> dict[str, Any]:
    return one(objects(render(CHART, values)), "DaemonSet")["spec"]["template"]["spec"]


def required_node_labels(affinity: dict[str, Any]) -> set[str]:
    required = affinity.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return {e["key"] for term in required.get("nodeSelectorTerms", []) for e in term["matchExpressions"]}


@pytest.mark.parametrize("values_file", ["gpuNodesOnly: false\n", "affinity: null\n"],
                         ids=["gpuNodesOnly-false", "affinity-null"])
def test_every_node_is_one_value_away(values_file: str) -> None:
    """The documented `affinity: {}` kept the GPU-node affinity: Helm merges a user's map into the default key
    by key, so an empty map changed nothing (only null cleared it). The GPU nodes are now their own switch,
    gpuNodesOnly; a values file turning it off renders no affinity, and the null earlier releases needed still
    does the same."""
    pod = pod_spec(helm_python.values_from_yaml(values_file))
    assert "affinity" not in pod, f"{values_file.strip()!r} still renders affinity {pod.get('affinity')}"
    assert pod["tolerations"] == DEFAULTS["tolerations"]   # still tolerated where the nodes are tainted


def test_the_gpu_scheduling_scenario_places_pods_by_its_node_selector_alone() -> None:
    """The scenario's own nodeSelector decides: no GPU-node affinity beside it."""
    pod = pod_spec(SCENARIOS["gpu-scheduling"])
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "affinity" not in pod, f"the GPU-node affinity is still there: {pod.get('affinity')}"


def test_a_users_node_affinity_replaces_the_gpu_nodes_and_pod_affinities_add_to_them() -> None:
    """A nodeAffinity of the user's is the whole node choice: one that prefers a pool but allows every node was
    merged under the required GPU terms before. A podAntiAffinity alone keeps the GPU nodes."""
    prefer = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}}]}}
    rendered = pod_spec({"affinity": prefer})["affinity"]
    assert rendered == prefer, f"the user's nodeAffinity merged with the GPU nodes': {rendered}"
    anti = {"podAntiAffinity": CHANGED[("affinity",)]["podAntiAffinity"]}
    affinity = pod_spec({"affinity": anti})["affinity"]
    assert affinity["podAntiAffinity"] == anti["podAntiAffinity"]
    assert required_node_labels(affinity) == GPU_NODE_LABELS
    assert required_node_labels(pod_spec({})["affinity"]) == GPU_NODE_LABELS
    for values in ({"affinity": prefer}, {"affinity": anti}, {"gpuNodesOnly": False}):
        kubernetes_validate.validate(one(objects(render(CHART, values)), "DaemonSet"), KUBE, strict=True)


def test_filesystem_paths_are_the_nodes_read_under_its_root_mounted_read_only() -> None:
    """By default the node's / is mounted read-only at /host/root (HostToContainer: the node's later mounts
    show), and --path.rootfs names it, so filesystemPaths ["/", "/data"] are the node's root disk and /data,
    never the container's overlay; hostRootfs off leaves neither the mount nor the flag."""
    objs = objects(render(CHART, {"filesystemPaths": ["/", "/data"]}))
    container, pod = exporter_container(objs), one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert {"--filesystem-paths=/,/data", "--path.rootfs=/host/root"} <= set(container["args"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/host/root"]
    assert (mount["readOnly"], mount["mountPropagation"]) == (True, "HostToContainer")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"] == {"path": "/", "type": "Directory"}
    kubernetes_validate.validate(one(objs, "DaemonSet"), KUBE, strict=True)
    objs = objects(render(CHART, {"hostRootfs": {"enabled": False}, "ingest": {"enabled": False}}))
    container, pod = exporter_container(objs), one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert not [arg for arg in container["args"] if arg.startswith("--path.rootfs")]
    assert "volumeMounts" not in container and "volumes" not in pod


@pytest.mark.parametrize(("values", "through_pid_1"), [
    ({}, True),  # the pod's own network namespace, the node's PID namespace: the node's PID 1 has its interfaces
    ({"hostNetwork": True}, False),  # the node's namespace already
    ({"hostPID": False}, False),  # PID 1 is the pod's own: its counters are the pod's either way
])
def test_the_node_network_counters_are_the_nodes_interfaces(values: dict[str, Any], through_pid_1: bool) -> None:
    args = exporter_container(objects(render(CHART, values)))["args"]
    assert ("--collector.node.host-network" in args) == through_pid_1


def test_termination_grace_period_outlasts_the_exporters_bounded_shutdown() -> None:
    """On SIGTERM the exporter drains in-flight responses (SHUTDOWN_TIMEOUT_SECONDS), cancels the rest
    (as long again), then joins the push API and collector threads (2 s each): the kubelet must not
    SIGKILL it before, and the value is the operator's to lower."""
    from stepscope.exporter.server import SHUTDOWN_TIMEOUT_SECONDS
    pod = one(objects(render(CHART)), "DaemonSet")["spec"]["template"]["spec"]
    threads = 1 + len(DEFAULTS["collectors"])
    assert pod["terminationGracePeriodSeconds"] >= 2 * SHUTDOWN_TIMEOUT_SECONDS + 2 * threads
    pod = one(objects(render(CHART, {"terminationGracePeriodSeconds": 45})), "DaemonSet")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 45


@pytest.mark.parametrize("surge", [1, "10%"])
@pytest.mark.parametrize("ports", [{}, {"hostNetwork": True}])
def test_a_surge_rollout_with_a_host_port_is_refused(surge: Any, ports: dict[str, Any]) -> None:
    """A surged pod needs the node's port the old pod holds: the scheduler never places it and the rollout
    waits forever on every node. Kubernetes accepts the object, so the chart refuses it."""
    rolling = {"maxUnavailable": 0, "maxSurge": surge}
    values = {**ports, "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": rolling}}
    with pytest.raises(helm_python.HelmRenderError, match=r"maxSurge.*hostPort"):
        render(CHART, values)
    no_host_port = {**values, "ingest": {"hostPort": False}} if not ports else None
    if no_host_port:
        spec = one(objects(render(CHART, no_host_port)), "DaemonSet")["spec"]["updateStrategy"]
        assert spec["rollingUpdate"]["maxSurge"] == surge


# ---- Service and monitors --------------------------------------------------------------------------

def test_the_service_and_monitors_select_the_exporter_pods_alone() -> None:
    """The helm test pod carried the exporter's selector labels: the Service's endpoints and a PodMonitor
    picked it up while it ran."""
    rendered = render(CHART, {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": False}})
    objs = objects(rendered)
    selectors = [one(objs, "Service")["spec"]["selector"], one(objs, "PodMonitor")["spec"]["selector"]["matchLabels"]]
    exporter_pod = one(objs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    test_pod = one(objects(rendered, tests=True), "Pod")["metadata"]["labels"]
    for selector in selectors:
        assert selector.items() <= exporter_pod.items()
        assert not selector.items() <= test_pod.items()


class _Exposition(http.server.BaseHTTPRequestHandler):
    """What an exporter with pod attribution serves: a GPU given to a training pod."""
    body = (b'# TYPE stepscope_gpu_pod_info gauge\n'
            b'stepscope_gpu_pod_info{uuid="GPU-1",namespace="team-a",pod="train-0",container="trainer"} 1\n')

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving_exposition() -> Iterator[str]:
    with serving(LoopbackServer(_Exposition)) as server:
        yield f"127.0.0.1:{server.server_address[1]}"


def prometheus_relabel(rule: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator RelabelConfig as prometheus.yml writes it."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    out = {names.get(k, k): v for k, v in rule.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_the_monitors_keep_the_exporters_pod_attribution_labels(kind: str, tmp_path: Path) -> None:
    """The Prometheus Operator gives every target `namespace`, `pod` and `container` (the exporter's own pod).
    With honorLabels false they overwrote the training pod's labels the exporter publishes with pod
    attribution (they became exported_namespace, ...), so every join of the rules on (namespace, pod,
    container) -- dcgm-exporter's GPUs to the ranks of a pod -- matched nothing, and alerts named the exporter
    pod. A real Prometheus scrapes with the target labels the operator attaches and the monitor's relabelings
    and honorLabels: the series keep the training pod's labels, `instance` is the node."""
    on = {"enabled": True}
    values = {"serviceMonitor": on if kind == "ServiceMonitor" else {"enabled": False},
              "podMonitor": on if kind == "PodMonitor" else {"enabled": False}, "podResources": {"enabled": True}}
    monitor = one(objects(render(CHART, values)), kind)
    (endpoint,) = monitor["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
    operator_labels = {"__meta_kubernetes_pod_node_name": "gpu-node-7", "namespace": NAMESPACE,
                       "pod": "rel-stepscope-x7k2p", "container": "exporter", "endpoint": "http"}
    if kind == "ServiceMonitor":
        operator_labels["service"] = "rel-stepscope"
    with serving_exposition() as address:
        config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [{
            "job_name": "stepscope", "honor_labels": endpoint["honorLabels"],
            "static_configs": [{"targets": [address], "labels": operator_labels}],
            "relabel_configs": [prometheus_relabel(r) for r in endpoint["relabelings"]]}]}
        with running_prometheus_config(tmp_path, config) as prometheus:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                result = requests.get(f"{prometheus.url}/api/v1/query", params={"query": "stepscope_gpu_pod_info"},
                                      timeout=10).json()["data"]["result"]
                if result:
                    break
                time.sleep(0.2)
    (series,) = result
    labels = series["metric"]
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("team-a", "train-0", "trainer"), labels
    assert labels["instance"] == "gpu-node-7" and not any(k.startswith("exported_") for k in labels), labels


@pytest.mark.parametrize("kind", ["serviceMonitor", "podMonitor"])
def test_a_scrape_timeout_longer_than_the_interval_is_refused(kind: str) -> None:
    """Prometheus refuses such a scrape config and the operator then drops the monitor: no target, no
    error anywhere the user looks."""
    other = "podMonitor" if kind == "serviceMonitor" else "serviceMonitor"
    values = {kind: {"enabled": True, "interval": "15s", "scrapeTimeout": "1m"}, other: {"enabled": False}}
    with pytest.raises(helm_python.HelmRenderError, match=rf"{kind}.scrapeTimeout 1m is longer than .*interval 15s"):
        render(CHART, values)
    fine = {kind: {"enabled": True, "interval": "30s", "scrapeTimeout": "30s"}, other: {"enabled": False}}
    assert objects(render(CHART, fine))


@pytest.mark.parametrize("kind", ["serviceMonitor", "podMonitor"])
def test_a_scrape_interval_the_rules_cannot_serve_is_refused(kind: str) -> None:
    """The rules' 1m windows need two scrapes in a minute: a 60 s monitor (kube-prometheus-stack's and Prometheus'
    habit) rendered, and Prometheus then recorded no rate, share nor verdict for any run and paged StepscopeRankLost
    for every live rank (docs/deployment.md). The limit is the contract's."""
    longest = THRESHOLDS["scrape_interval_max_seconds"].value
    other = "podMonitor" if kind == "serviceMonitor" else "serviceMonitor"
    for interval in ("1m", f"{longest + 1:g}s"):
        values = {kind: {"enabled": True, "interval": interval, "scrapeTimeout": "10s"}, other: {"enabled": False}}
        with pytest.raises(helm_python.HelmRenderError,
                           match=rf"{kind}.interval {interval} is longer than {longest:g}s: the stepscope rules' 1m "
                                 r"windows need two scrapes in a minute; at 60s no run gets a rate, share or verdict"):
            render(CHART, values)
    edge = {kind: {"enabled": True, "interval": f"{longest:g}s", "scrapeTimeout": "10s"}, other: {"enabled": False}}
    assert objects(render(CHART, edge))


# ---- every rendered object validates ---------------------------------------------------------------

OPERATOR_GROUPS = ("monitoring.coreos.com/", "operator.victoriametrics.com/")
SCENARIOS: dict[str, dict[str, Any]] = {
    "gpu-scheduling": {"nodeSelector": {"nvidia.com/gpu.present": "true"}, "gpuNodesOnly": False,
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"},
                                       {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute",
                                        "tolerationSeconds": 300}],
                       "priorityClassName": "system-node-critical",
                       "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}},
    "digest-namespace-extra": {"image": {"repository": "registry.example.com/stepscope", "digest": DIGEST},
                               "namespaceOverride": "gpu-monitoring", "extraArgs": ["--ingest-max-groups=1024"],
                               "extraEnv": [{"name": "TZ", "value": "UTC"}], "imagePullSecrets": [{"name": "pull"}]},
    "secured-podmonitor-podresources": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": False},
                                        "podResources": {"enabled": True},
                                        "webConfig": {"basicAuthUsers": {"prometheus": HASH},
                                                      "tls": {"existingSecret": "tls"},
                                                      "scrapeCredentials": {"existingSecret": "scrape"}}},
    "monitors-off": {"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False},
                     "dashboards": {"enabled": False}, "ingest": {"enabled": False}},
    "dcgm-ondelete": {"gpuSource": "dcgm", "updateStrategy": {"type": "OnDelete"}},
    "victoriametrics": {"sharding": {"enabled": True, "global": {"create": False},
                                     "remoteWrite": {"url": "http://vm.monitoring.svc:8428/api/v1/write"},
                                     "vmalert": {"create": True, "url": "http://vm.monitoring.svc:8428",
                                                 "notifierURL": "http://am.monitoring.svc:9093"}}},
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_object_of_each_operator_scenario_validates(name: str) -> None:
    rendered = render(CHART, SCENARIOS[name], api_versions=[OPERATOR_API], kube_version=f"v{KUBE}")
    for obj in objects(rendered) + objects(rendered, tests=True):
        if obj["apiVersion"].startswith(OPERATOR_GROUPS):
            continue   # CRDs: shapes checked in test_helm_chart.py and test_victoria_chart.py
        try:
            kubernetes_validate.validate(obj, KUBE, strict=True)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {KUBE}: {exc.message}")


# ---- values the exporter or Kubernetes would refuse after the install ----------------------------------

@pytest.fixture(scope="module")
def loaded_chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as chart:
        yield chart


def helm_schema_error(chart: helm_python.Chart, values: dict[str, Any]) -> str | None:
    """What Helm's own schema check (the Go validator `helm install` and `helm template` run, not Python's
    jsonschema) says of the values merged over the defaults; None where it accepts them."""
    try:
        chart.validate_schema(chart.merge_values(values))
    except helm_python.HelmValuesError as exc:
        return str(exc)
    return None


def exporter_parses_cidrs(text: str) -> bool:
    from stepscope.exporter.flags import cidr_list
    try:
        cidr_list(text)
    except argparse.ArgumentTypeError:
        return False
    return True


INGEST_ALLOW_REFUSED = ["10.0.0.0/33", "2001:db8::/129", "256.0.0.1", "10.0.0", "10.0.0.0/", "1::2::3", "12345::1",
                        "1:2:3:4:5:6:7:8:9", "10.0.0.0/8/8", ":::", "010.0.0.1"]
INGEST_ALLOW_ACCEPTED = ["10.0.0.0/8", "10.1.2.3", "0.0.0.0/0", "192.168.0.0/32", "::1", "::", "::/0", "fe80::/10",
                         "2001:db8::/128", "1:2:3:4:5:6:7:8/64", "::ffff:10.0.0.1", "64:ff9b::10.0.0.0/96",
                         "1:2:3:4:5:6:1.2.3.4", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "FE80::ABCD"]


def test_ingest_allow_takes_only_what_the_exporter_parses(loaded_chart: helm_python.Chart) -> None:
    """`ingest.allow: ["10.0.0.0/33"]` passed the schema's `^[0-9a-fA-F:.]+(/[0-9]+)?$`, rendered, and then every
    exporter of the DaemonSet exited at start (`'10.0.0.0/33' is not an IP address or CIDR network`): a
    CrashLoopBackOff on every node. The schema now admits what the exporter's own parser admits: IPv4 with a
    prefix of at most 32, IPv6 (compressed, or ending in IPv4) with at most 128."""
    for text in INGEST_ALLOW_REFUSED:
        assert not exporter_parses_cidrs(text), text
        error = helm_schema_error(loaded_chart, {"ingest": {"allow": [text]}})
        assert error and "at '/ingest/allow/0'" in error, f"{text!r} accepted, and the exporter refuses it"
    for text in INGEST_ALLOW_ACCEPTED:
        assert exporter_parses_cidrs(text), text
        assert helm_schema_error(loaded_chart, {"ingest": {"allow": [text]}}) is None, text
    args = exporter_container(objects(render(CHART, {"ingest": {"allow": INGEST_ALLOW_ACCEPTED}})))["args"]
    assert f"--ingest-allow-without-token={','.join(INGEST_ALLOW_ACCEPTED)}" in args


def test_the_ingest_allow_pattern_agrees_with_the_exporter_on_random_networks() -> None:
    """The same pattern under Python's `re` (the Go validator's RE2 reads it alike: no look-around, no
    back-references) against the exporter's parser, on random IPv4 and IPv6 networks and near-misses of them.
    A prefix with a leading zero (10.0.0.0/08), which Python takes, is the one thing the pattern refuses."""
    pattern = re.compile(SCHEMA["properties"]["ingest"]["properties"]["allow"]["items"]["pattern"])
    rng = random.Random(20261129)
    disagreements = []
    for _ in range(3000):
        if rng.random() < 0.5:
            address = ipaddress.IPv6Address(rng.getrandbits(128) & ~((1 << rng.randrange(129)) - 1))
            text = rng.choice([address.compressed, address.exploded])
            if rng.random() < 0.2:
                text = f"::ffff:{ipaddress.IPv4Address(rng.getrandbits(32))}"
            if rng.random() < 0.2:
                text = text.replace(":", "", 1) if rng.random() < 0.5 else f"{text}:{rng.choice(['1', '', ':'])}"
        else:
            text = ".".join(str(rng.randrange(rng.choice([256, 300]))) for _ in range(rng.choice([3, 4, 4, 4, 5])))
        if rng.random() < 0.5:
            text += f"/{rng.randrange(135)}"
        if bool(pattern.fullmatch(text)) != exporter_parses_cidrs(text):
            disagreements.append(text)
    assert not disagreements, f"schema and exporter disagree on {disagreements[:10]}"


@pytest.mark.parametrize(("values", "at"), [
    ({"fullnameOverride": "GPU-Exporter"}, "/fullnameOverride"),      # upper case: no object name takes it
    ({"fullnameOverride": "1-exporter"}, "/fullnameOverride"),        # the Service's name starts with a letter
    ({"fullnameOverride": "x" * 64}, "/fullnameOverride"),
    ({"nameOverride": "gpu_exp"}, "/nameOverride"),
    ({"nameOverride": "gpu-exp-"}, "/nameOverride"),
    ({"nameOverride": "n" * 53}, "/nameOverride"),                    # <name>-prometheus: a 64-character label
    ({"serviceAccount": {"name": "Foo"}}, "/serviceAccount/name"),
    ({"serviceAccount": {"name": "a..b"}}, "/serviceAccount/name"),
    ({"sharding": {"serviceAccountName": "Prometheus"}}, "/sharding/serviceAccountName"),
    ({"dashboards": {"namespace": "Grafana"}}, "/dashboards/namespace"),
    ({"ingest": {"token": {"key": "a/b"}}}, "/ingest/token/key"),
    ({"webConfig": {"key": "web config.yml"}}, "/webConfig/key"),
    ({"webConfig": {"tls": {"caKey": "ca:crt"}}}, "/webConfig/tls/caKey"),
    ({"webConfig": {"scrapeCredentials": {"usernameKey": "user/name"}}}, "/webConfig/scrapeCredentials/usernameKey"),
    ({"webConfig": {"scrapeCredentials": {"passwordKey": "pass word"}}}, "/webConfig/scrapeCredentials/passwordKey"),
])
def test_a_name_or_key_kubernetes_refuses_is_refused_by_the_schema(
    loaded_chart: helm_python.Chart, values: dict[str, Any], at: str
) -> None:
    """These rendered, and `helm install` then failed on the API server with a message naming an object, not the
    value (`metadata.name: Invalid value: "GPU-Exporter": a lowercase RFC 1123 label ...`), or the pod stayed in
    CreateContainerConfigError: object names are RFC 1123 (the Service's RFC 1035: a letter first), label values
    at most 63 characters, Secret data keys `[-._a-zA-Z0-9]+`."""
    error = helm_schema_error(loaded_chart, values)
    assert error and f"at '{at}'" in error, f"{values} accepted: {error}"


def test_the_longest_names_the_schema_takes_make_valid_objects(loaded_chart: helm_python.Chart) -> None:
    """The schema's limits are Kubernetes', not tighter: at the limit every name and label of the sharded layout
    is one the API server takes."""
    values = {"fullnameOverride": "x" * 63, "nameOverride": "n" * 52, "serviceAccount": {"name": "sa.example-1"},
              "ingest": {"token": {"key": "push.token_1"}}, "webConfig": {"key": "web-config.yml"},
              "sharding": {"enabled": True, "alertmanagers": [{"name": "am", "port": "web"}]}}
    assert helm_schema_error(loaded_chart, values) is None
    objs = objects(render(CHART, values, api_versions=[OPERATOR_API]))
    label_value = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
    too_long = {f"{o['kind']}.{k}": v for o in objs for k, v in o["metadata"].get("labels", {}).items()
                if len(v) > 63 or not label_value.fullmatch(v)}
    assert not too_long, too_long
    assert one(objs, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == "sa.example-1"
    assert "push.token_1" in one(objs, "Secret")["data"]


class _DuplicateKeyLoader(SAFE_LOADER):
    """A YAML loader that refuses a mapping key given twice, as the API server's decoder does (PyYAML keeps the
    last value without a word). libyaml parses where PyYAML has it, and the mappings are built here as before: the
    pure-Python parser of the rendered dashboards and rules took 3.6 of the module's 38 s of CPU."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        duplicated = sorted({str(key) for key in keys if keys.count(key) > 1})
        if duplicated:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicated}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def strict_objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The rendered objects (as `objects`), refusing a mapping key given twice."""
    return [doc for path, text in sorted(rendered.items())
            if not path.endswith("NOTES.txt") and "/templates/tests/" not in path
            for doc in yaml.load_all(text, Loader=_DuplicateKeyLoader) if doc]


# Every map of extra labels, beside the settings that render its object.
LABEL_MAPS: dict[str, dict[str, Any]] = {
    "podLabels": {},
    "service.labels": {},
    "serviceMonitor.additionalLabels": {"serviceMonitor": {"enabled": True}},
    "podMonitor.additionalLabels": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": False}},
    "prometheusRule.additionalLabels": {"prometheusRule": {"enabled": True}},
    "alerting.alertmanagerConfig.additionalLabels": {"alerting": {"alertmanagerConfig": {"enabled": True}}},
    "dashboards.labels": {},
    "sharding.nodeRuleLabels": {"sharding": {"enabled": True, "alertmanagers": [{"name": "am", "port": "web"}]}},
    "sharding.runRuleLabels": {"sharding": {"enabled": True, "alertmanagers": [{"name": "am", "port": "web"}]}},
}


def with_labels(setting: str, labels: dict[str, str]) -> dict[str, Any]:
    *parents, leaf = setting.split(".")
    values: dict[str, Any] = {leaf: labels}
    for parent in reversed(parents):
        values = {parent: values}
    return merged(LABEL_MAPS[setting], values)


@pytest.mark.parametrize("label", ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version"])
@pytest.mark.parametrize("setting", LABEL_MAPS)
def test_a_label_the_chart_sets_is_refused_in_an_extra_label_map(setting: str, label: str) -> None:
    """`podLabels: {app.kubernetes.io/name: x}` rendered the pod template's labels with the key twice: the API
    server refuses such a manifest (`mapping key "app.kubernetes.io/name" already defined`), and a tool that
    keeps the last value gives pods the DaemonSet's selector does not match (`selector does not match template
    labels`). The same for every map of extra labels beside the chart's own. It is now refused at render,
    naming the setting and the label."""
    with pytest.raises(helm_python.HelmRenderError, match=rf"{re.escape(setting)} sets the label {re.escape(label)}"):
        strict_objects(render(CHART, with_labels(setting, {label: "x"}), api_versions=[OPERATOR_API]))


@pytest.mark.parametrize("setting", LABEL_MAPS)
def test_extra_labels_land_once_beside_the_charts(setting: str) -> None:
    """A label the chart does not set still lands, once, beside the chart's own."""
    objs = strict_objects(render(CHART, with_labels(setting, {"team": "ml"}), api_versions=[OPERATOR_API]))
    labelled = ([one(objs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]] if setting == "podLabels"
                else [o["metadata"]["labels"] for o in objs])
    assert any(labels.get("team") == "ml" and labels.get("app.kubernetes.io/instance") == "rel" for labels in labelled)


def test_a_label_both_the_rules_and_their_layer_set_lands_once() -> None:
    """`prometheusRule.additionalLabels: {release: kube-prometheus-stack}` beside the same label in
    sharding.runRuleLabels (both select the run rules) wrote `release` twice into the PrometheusRule; the same value
    now lands once, and two different values are refused (the layer's ruleSelector needs its own). The node rules
    carry only sharding.nodeRuleLabels: the shards' selector, which kube-prometheus-stack's Prometheus must not
    share (test_kube_prometheus_stacks_prometheus_selects_no_per_node_work_of_the_sharded_layout)."""
    sharded = {"sharding": {"enabled": True, "alertmanagers": [{"name": "am", "port": "web"}],
                            "nodeRuleLabels": {"release": "kps"}, "runRuleLabels": {"release": "kps"}}}
    same = merged(sharded, {"prometheusRule": {"additionalLabels": {"release": "kps"}}})
    rules = by_kind(strict_objects(render(CHART, same, api_versions=[OPERATOR_API])), "PrometheusRule")
    assert [r["metadata"]["labels"]["release"] for r in rules] == ["kps", "kps"]
    other = merged(sharded, {"prometheusRule": {"additionalLabels": {"release": "other"}}})
    with pytest.raises(helm_python.HelmRenderError, match=r"sharding.runRuleLabels sets the label release"):
        render(CHART, other, api_versions=[OPERATOR_API])


# ---- a value set to null ---------------------------------------------------------------------------

CI_VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))


def value_paths(values: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a values tree, a map's own path before its keys'."""
    for key, value in values.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from value_paths(value, (*prefix, key))


def with_null(values: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """The values with `path` set to null, as `--set path=null` (or `key: null` in a values file) hands it to
    Helm, which then drops the chart's default for it."""
    out = copy.deepcopy(values)
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = None
    return out


def holds_null(node: Any) -> bool:
    if isinstance(node, dict):
        return any(holds_null(value) for value in node.values())
    if isinstance(node, list):
        return any(holds_null(value) for value in node)
    return node is None


def exporter_refusal(container: dict[str, Any], tmp_path: Path) -> str | None:
    """What the exporter's own parser says of the container's args (the mounted files stood for by local
    ones), None where it takes them: a refusal is a CrashLoopBackOff on every node."""
    from stepscope.exporter.cli import build_parser
    (tmp_path / "file").write_text("secret\n")
    local = {"--ingest-token-file": tmp_path / "file", "--web.config.file": tmp_path / "file",
             "--path.rootfs": tmp_path}
    args = [str(arg) for arg in container["args"]]
    args = [f"{arg.split('=', 1)[0]}={local[arg.split('=', 1)[0]]}" if arg.split("=", 1)[0] in local else arg
            for arg in args]
    try:
        build_parser().parse_args(args)
    except SystemExit:
        return f"the exporter refuses its args {args}"
    return None


def what_a_null_breaks(values: dict[str, Any], tmp_path: Path) -> str | None:
    """None where Helm refuses the values with its schema's message or the chart's own one-line `fail`, or
    renders objects Kubernetes takes and args the exporter takes; else what went wrong."""
    try:
        rendered = render(CHART, values, api_versions=[OPERATOR_API], kube_version=f"v{KUBE}")
    except helm_python.HelmValuesError:
        return None
    except helm_python.HelmError as exc:
        message = str(exc)
        return None if message.startswith("execution error at") and "<nil>" not in message else message
    try:
        found = objects(rendered) + objects(rendered, tests=True)
    except yaml.YAMLError as exc:
        return f"the rendered manifest is not YAML: {exc}"
    for obj in found:
        if obj["apiVersion"].startswith(OPERATOR_GROUPS):
            if holds_null(obj["spec"]):
                return f"{obj['kind']} {obj['metadata']['name']} holds a null"
        elif problem := kubernetes_refusal(json.dumps(obj, sort_keys=True)):
            return problem
    return exporter_refusal(exporter_container(found), tmp_path)


@functools.cache
def kubernetes_refusal(obj_json: str) -> str | None:
    """kubernetes-validate's word on one object (JSON), kept: most objects come out the same for most nulls,
    and the validator reads its schema files anew on each call."""
    obj = json.loads(obj_json)
    try:
        kubernetes_validate.validate(obj, KUBE, strict=True)
    except jsonschema.ValidationError as exc:
        return f"{obj['kind']} invalid: {exc.message}"
    return None


def swept_paths(values_file: Path, values: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """default-values.yaml: every value's path; another scenario: the paths under the keys it sets (the others
    are swept with the defaults)."""
    for path in value_paths(merged(DEFAULTS, values)):
        if values_file.name == "default-values.yaml" or path[0] in values:
            yield path


@pytest.mark.parametrize("values_file", CI_VALUES_FILES, ids=lambda path: path.name)
def test_a_value_set_to_null_is_refused_by_name_or_renders_a_working_exporter(values_file: Path,
                                                                               tmp_path: Path) -> None:
    """`--set livenessProbe=null` rendered the probe's httpGet and then `null` beside it, a manifest that is not
    YAML (`could not find expected ':'`); `ingest: null` stopped at `nil pointer evaluating interface
    {}.enabled`; `collectInterval: null` rendered `--collect-interval=`, which every exporter refuses at start;
    `alerting.alertmanagerConfig.receiver: null` said `receiver %!q(<nil>)`. Each value the chart needs is now
    required by the schema, so Helm names it (`at '/ingest': missing property 'token'`); a null the chart
    takes (an empty map or list: resources, tolerations, affinity) still renders a working exporter."""
    values = helm_python.values_from_yaml(values_file.read_text()) or {}
    broken = {}
    for path in swept_paths(values_file, values):
        swept = with_null(values, path)
        if path[0] != "dashboards":   # their ConfigMaps are most of a render, and the same each time
            swept = merged(swept, {"dashboards": {"enabled": False}})
        problem = what_a_null_breaks(swept, tmp_path)
        if problem:
            broken[".".join(path)] = problem.splitlines()[0][:200]
    assert not broken, json.dumps(broken, indent=1)


# ---- extraArgs beside the flags the chart renders ----------------------------------------------------

def exporter_start_refusal(args: list[str], tmp_path: Path) -> str | None:
    """What the exporter says of its args up to choosing its collectors (where a switch contradicting
    --collectors is refused), None where it goes on to start."""
    from stepscope.exporter.cli import build_parser, enabled_collectors
    refused = exporter_refusal({"args": args}, tmp_path)
    if refused:
        return refused
    try:
        enabled_collectors(build_parser().parse_args([arg for arg in args if not arg.startswith(
            ("--ingest-token-file", "--web.config.file", "--path.rootfs"))]))
    except SystemExit:
        return f"the exporter exits at start on {args}"
    return None


@pytest.mark.parametrize(("extra", "api_versions", "message"), [
    ("--no-collector.gpu", (), r"extraArgs --no-collector.gpu: .* set collectors instead"),
    ("--collector.process", (), r"extraArgs --collector.process: .* set collectors instead"),
    ("--web.listen-address=:9999", (), r"extraArgs --web.listen-address=:9999: .* set port instead"),
    ("--listen-address=:9999", (), r"extraArgs --listen-address=:9999: .* set port instead"),
    ("--web.telemetry-path=/m", (OPERATOR_API,), r"extraArgs --web.telemetry-path=/m: the ServiceMonitor/PodMonitor "
                                                 r"scrape /metrics"),
])
def test_an_extra_arg_that_fights_the_charts_own_is_refused_at_render(extra: str, api_versions: tuple[str, ...],
                                                                      message: str) -> None:
    """`extraArgs: [--no-collector.gpu]` rendered beside the chart's `--collectors=node,gpu,process`, and every
    exporter exited at start with `--collectors node,gpu,process and --no-collector.gpu disagree about the gpu
    collector` (a CrashLoopBackOff on every node); `--web.listen-address=:9999` left the container port, the
    hostPort and the probes on 9847 (the kubelet kills each exporter for its liveness probe); and
    `--web.telemetry-path=/m` left the monitors scraping /metrics, which answered 404. Each is refused with one
    line naming the value to set."""
    with pytest.raises(helm_python.HelmError, match=message):
        render(CHART, {"extraArgs": [extra]}, api_versions=api_versions)


@pytest.mark.parametrize(("extra", "api_versions"), [
    ("--no-collector.gpu.pcie-poll", ()),
    ("--collector.gpu.slow-interval=20", ()),
    ("--collector.node.netdev-exclude=", ()),
    ("--web.telemetry-path=/m", ()),   # no monitor scrapes it: the user's own scrape config does
])
def test_an_extra_arg_beside_the_charts_own_reaches_an_exporter_that_starts(extra: str, api_versions: tuple[str, ...],
                                                                            tmp_path: Path) -> None:
    args = exporter_container(objects(render(CHART, {"extraArgs": [extra], "dashboards": {"enabled": False}},
                                             api_versions=api_versions)))["args"]
    assert args[-1] == extra
    assert exporter_start_refusal(args, tmp_path) is None


def test_the_collector_switch_the_chart_refuses_is_one_the_exporter_refuses_at_start(tmp_path: Path) -> None:
    """Why the chart refuses it: the exporter itself exits on the chart's --collectors beside the switch."""
    args = [*exporter_container(objects(render(CHART, {"dashboards": {"enabled": False}})))["args"],
            "--no-collector.gpu"]
    assert "exits at start" in (exporter_start_refusal(args, tmp_path) or "")
