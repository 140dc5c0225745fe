"""Dashboard queries whose functions differ between Prometheus and VictoriaMetrics (MetricsQL), evaluated on both
over the same series: promtool for Prometheus, a real VictoriaMetrics for the other (docs/engines.md)."""

import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support.dashboard_queries import panel_queries
from tests.support.prometheus import query
from tests.support.victoria import running_victoria
from tests.support.victoria_replay import import_series

pytestmark = pytest.mark.timeout(120)
INTERVAL = 15
# Two exporters scraped for 2 hours: one never restarted, one restarted once at 1h (its start time went up).
START_TIMES = [
    {"series": 'stepscope_exporter_start_time_seconds{job="stepscope",instance="steady"}', "values": "100x480"},
    {"series": 'stepscope_exporter_start_time_seconds{job="stepscope",instance="restarted"}',
     "values": "100x240 3700x240"},
]
RESTARTS = {"steady": 0, "restarted": 1}
EVAL_SECONDS = 2 * 3600


def _restarts_query() -> str:
    (expr,) = [q.expr for q in panel_queries() if (q.dashboard, q.panel) == ("stepscope-node.json",
                                                                            "Exporter restarts (24h)")]
    return expr


def test_exporter_restarts_read_the_same_on_prometheus(tmp_path: Path) -> None:
    samples = [{"labels": f'{{instance="{node}",job="stepscope"}}', "value": count} for node, count in RESTARTS.items()]
    spec = {"rule_files": [], "evaluation_interval": f"{INTERVAL}s",
            "tests": [{"interval": f"{INTERVAL}s", "input_series": START_TIMES,
                       "promql_expr_test": [{"expr": _restarts_query(), "eval_time": f"{EVAL_SECONDS}s",
                                             "exp_samples": samples}]}]}
    (tmp_path / "restarts.yml").write_text(yaml.safe_dump(spec))
    result = subprocess.run(["promtool", "test", "rules", str(tmp_path / "restarts.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_exporter_restarts_read_the_same_on_victoriametrics(tmp_path: Path) -> None:
    """changes() read 1 for the exporter never restarted and 2 for the one restarted once there: MetricsQL counts
    a series' first sample as a change."""
    start = int(time.time()) // 60 * 60 - EVAL_SECONDS - 600
    with running_victoria(tmp_path) as victoria:
        import_series(victoria.url, START_TIMES, start, INTERVAL)
        results = query(victoria.url, _restarts_query(), at=start + EVAL_SECONDS)
    assert {item["metric"]["instance"]: float(item["value"][1]) for item in results} == RESTARTS
