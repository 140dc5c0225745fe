"""Writes the dashboards' JSON: `python -m grafana.dashboards.generate [--out DIR]` from the repo root.

The JSON under grafana/dashboards/ is committed (Grafana provisions it as is); tests regenerate it and
fail on any difference, so edit the Python, not the JSON.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from grafana.dashboards import cluster, node, training

DASHBOARDS_DIR = Path(__file__).resolve().parent
BUILDERS: dict[str, Callable[[], Dashboard]] = {
    f"{training.UID}.json": training.build,
    f"{node.UID}.json": node.build,
    f"{cluster.UID}.json": cluster.build,
}


def render(build: Callable[[], Dashboard]) -> str:
    """Dashboard JSON with stable panel ids (position order) and sorted keys, so diffs stay small."""
    model = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    for panel_id, panel in enumerate(model["panels"], start=1):
        panel["id"] = panel_id
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in BUILDERS.items():
        path = out_dir / name
        path.write_text(render(build))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DASHBOARDS_DIR, help="directory for the JSON files")
    for path in generate(parser.parse_args(argv).out):
        print(path)


if __name__ == "__main__":
    main()
