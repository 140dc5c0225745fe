"""Every generated file of the repository, from its sources, in one step.

    python -m grafana generate            # write what changed
    python -m grafana generate --check    # write nothing; list stale files and exit 1 (CI, tests)

Sources and outputs stay apart (the monitoring-mixin layout):
  grafana/dashboards/*.py           -> grafana/dashboards_out/*.json
  grafana/rules/stepscope-{node,run}.rules.yml
                                    -> grafana/alerting_out/stepscope-alerts.yml (Grafana-managed alerts)
                                    -> helm/stepscope/files/stepscope-{node,run}.rules.yml (Helm reads
                                       only files inside the chart)
  stepscope_contract                -> README.md's metric table (between its markers)
The chart reads the dashboards through the link helm/stepscope/files/dashboards ->
../../../grafana/dashboards_out: the Helm SDK follows it when it loads, renders and packages the chart,
so each dashboard is kept once.
"""

import os
from pathlib import Path

from grafana import readme_table
from grafana.alerting import generate as alerting
from grafana.dashboards import generate as dashboards
from grafana.rules import RULE_FILES

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS_OUT = Path("grafana/dashboards_out")
ALERTS_OUT = Path("grafana/alerting_out/stepscope-alerts.yml")
RULES = tuple(path.relative_to(REPO) for path in RULE_FILES)
DATASOURCE = Path("grafana/provisioning/datasources/stepscope.yml")
CHART_FILES = Path("helm/stepscope/files")
CHART_DASHBOARDS = Path("helm/stepscope/files/dashboards")
README = Path("README.md")


def outputs(root: Path = REPO) -> dict[Path, str]:
    """Repository-relative path -> the text it must hold."""
    files = {DASHBOARDS_OUT / name: text for name, text in dashboards.render_all().items()}
    files[ALERTS_OUT] = alerting.render(tuple(root / path for path in RULES), root / DATASOURCE)
    files.update({CHART_FILES / path.name: (root / path).read_text() for path in RULES})
    files[README] = readme_table.rewrite((root / README).read_text())
    return files


def _chart_link_target(root: Path) -> str:
    return os.path.relpath(root / DASHBOARDS_OUT, (root / CHART_DASHBOARDS).parent)


def stale(root: Path = REPO) -> list[str]:
    """One line per output that is missing, differs from its source, or should not exist."""
    wanted = outputs(root)
    problems = [f"{'missing' if not (root / path).is_file() else 'differs'}: {path}"
                for path, text in wanted.items()
                if not (root / path).is_file() or (root / path).read_text() != text]
    problems += [f"stale: {path.relative_to(root)} (no dashboard builds it)"
                 for path in sorted((root / DASHBOARDS_OUT).glob("*.json")) if path.relative_to(root) not in wanted]
    link = root / CHART_DASHBOARDS
    if not link.is_symlink() or os.readlink(link) != _chart_link_target(root):
        problems.append(f"not a link to {_chart_link_target(root)}: {CHART_DASHBOARDS}")
    return problems


def write(root: Path = REPO) -> list[Path]:
    """Writes every output that differs, removes stale dashboards, restores the chart's link; returns
    the paths changed."""
    changed = []
    for path, text in outputs(root).items():
        target = root / path
        if not target.is_file() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            changed.append(path)
    for path in sorted((root / DASHBOARDS_OUT).glob("*.json")):
        if path.name not in dashboards.BUILDERS:
            path.unlink()
            changed.append(path.relative_to(root))
    link = root / CHART_DASHBOARDS
    if not link.is_symlink() or os.readlink(link) != _chart_link_target(root):
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            raise SystemExit(f"generate: error: {CHART_DASHBOARDS} is a directory: remove it, the chart links "
                             f"to {DASHBOARDS_OUT}")
        link.symlink_to(_chart_link_target(root), target_is_directory=True)
        changed.append(CHART_DASHBOARDS)
    return changed
