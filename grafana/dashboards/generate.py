"""The dashboards' JSON, rendered from the Python in this package (grafana-foundation-sdk).

`python -m grafana generate` writes it to grafana/dashboards_out/; edit the Python, not the JSON.
"""

import json
from collections.abc import Callable

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from grafana.dashboards import cluster, node, training

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


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: render(build) for name, build in BUILDERS.items()}
