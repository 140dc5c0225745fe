"""Render and lint the Helm chart offline with the Helm Go SDK (helm-python-sdk), for the chart tests.

`helm_python.Chart.render` exposes name/namespace/revision/install flags only; the native call under
it also takes `api_versions` and `kube_version` (the SDK's `helm template --api-versions
--kube-version`), which the CRD gating tests need. The options are decoded strictly by the
library, so a misspelt option fails loudly instead of being ignored.
"""

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "stepscope"
GRAFANA = REPO / "grafana"
RELEASE = "rel"
NAMESPACE = "monitoring"
OPERATOR_API = "monitoring.coreos.com/v1"
# libyaml's safe loader where PyYAML was built with it (PyPI's wheels are): the rendered dashboards and rules
# took pure-Python PyYAML 0.08 s for the default render, three quarters of the chart tests' CPU (27 of 34 s
# under cProfile).
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def bare_copy(destination: Path) -> Path:
    """A copy of the chart without its files/ (the generated rules copy and the dashboards link)."""
    chart = destination / "stepscope"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("files"))
    return chart


def render(
    chart_dir: Path,
    values: dict[str, Any] | None = None,
    *,
    api_versions: Iterable[str] = (),
    kube_version: str | None = None,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce offline."""
    opts: dict[str, Any] = {"name": release, "namespace": namespace, "api_versions": list(api_versions)}
    if kube_version:
        opts["kube_version"] = kube_version
    with helm_python.Chart.load(chart_dir) as chart:
        rendered = _native.call_string(
            "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)
        )
    return json.loads(rendered)


def objects(rendered: dict[str, str], *, tests: bool = False) -> list[dict[str, Any]]:
    """The Kubernetes objects among rendered templates (NOTES.txt and empty documents dropped)."""
    found = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt") or ("/templates/tests/" in path) != tests:
            continue
        found += [doc for doc in yaml.load_all(text, Loader=SAFE_LOADER) if doc]
    return found


def notes(rendered: dict[str, str]) -> str:
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def lint(
    chart_dir: Path, values: dict[str, Any] | None = None, kube_version: str = "v1.30.0"
) -> dict[str, Any]:
    """`helm lint --strict`: findings come back as data (severity 2 = warning, 3 = error)."""
    return helm_python.lint(chart_dir, values, strict=True, namespace=NAMESPACE, kube_version=kube_version)


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(objs, kind)
    return found


def exporter_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The DaemonSet's one container: the exporter."""
    (container,) = one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return container
