"""Copy the Grafana bundle's Prometheus rules and dashboards into the Helm chart.

Helm can only read files inside the chart directory, so the chart carries copies of the rule files
(`grafana/rules/stepscope-node.rules.yml`, `stepscope-run.rules.yml`) and `grafana/dashboards/*.json`
under `helm/stepscope/files/`.
This script makes those copies (removing dashboards that no longer exist); `--check` only reports
drift and exits 1, for tests and CI.

    python scripts/sync_chart.py            # update helm/stepscope/files/
    python scripts/sync_chart.py --check    # exit 1 if the chart's copies differ from grafana/
"""

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grafana.rules import RULE_FILES  # noqa: E402

RULES = tuple(Path("rules") / path.name for path in RULE_FILES)
DASHBOARDS = Path("dashboards")


def planned_copies(source: Path, chart: Path) -> dict[Path, Path]:
    """Chart file -> bundle file it must equal."""
    files = chart / "files"
    copies = {files / rules.name: source / rules for rules in RULES}
    for dashboard in sorted((source / DASHBOARDS).glob("*.json")):
        copies[files / "dashboards" / dashboard.name] = dashboard
    return copies


def stale_files(chart: Path, copies: dict[Path, Path]) -> list[Path]:
    """Dashboards in the chart whose source is gone."""
    return sorted(p for p in (chart / "files" / "dashboards").glob("*.json") if p not in copies)


def drift(source: Path, chart: Path) -> list[str]:
    """One line per chart file that is missing, different or stale."""
    copies = planned_copies(source, chart)
    problems = []
    for target, origin in copies.items():
        if not target.is_file():
            problems.append(f"missing: {target} (from {origin})")
        elif target.read_bytes() != origin.read_bytes():
            problems.append(f"differs: {target} from {origin}")
    problems += [f"stale: {path} (no {source / DASHBOARDS / path.name})"
                 for path in stale_files(chart, copies)]
    return problems


def sync(source: Path, chart: Path) -> list[str]:
    """Make the chart's copies equal the bundle; returns what changed."""
    changes = drift(source, chart)
    copies = planned_copies(source, chart)
    for path in stale_files(chart, copies):
        path.unlink()
    for target, origin in copies.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(origin, target)
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=REPO / "grafana",
                        help="the Grafana bundle directory holding rules/ and dashboards/")
    parser.add_argument("--chart", type=Path, default=REPO / "helm" / "stepscope", help="the chart directory")
    parser.add_argument("--check", action="store_true", help="report drift and exit 1 instead of copying")
    args = parser.parse_args(argv)

    for rules in RULES:
        if not (args.source / rules).is_file():
            print(f"sync_chart: error: {args.source / rules} does not exist", file=sys.stderr)
            return 2
    if not (args.chart / "Chart.yaml").is_file():
        print(f"sync_chart: error: {args.chart} is not a chart (no Chart.yaml)", file=sys.stderr)
        return 2
    if args.check:
        problems = drift(args.source, args.chart)
        for line in problems:
            print(line)
        if problems:
            print("chart copies are out of date: run python scripts/sync_chart.py", file=sys.stderr)
        return 1 if problems else 0
    for line in sync(args.source, args.chart):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
