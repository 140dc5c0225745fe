"""The sharded layout end to end: two shard Prometheus servers and a global one, all real.

Each shard runs docker/prometheus/sharded/shard.yml: it scrapes its hashmod share of two real
exporters (fake NVML, one H100 each), evaluates the per-node rules and remote_writes what its write
filter keeps to the global Prometheus (global.yml, --web.enable-remote-write-receiver), which
evaluates the per-run rules. One DDP-like run has a rank on each node, so each shard sees one rank:
only the global layer sees the run. Its ranks step alike (DDP equalises step times); rank 1 spends
longer in forward, rank 0 waits for it in backward. Pushes are synthetic, cumulative bodies every
half second.

The global layer is a Prometheus, or VictoriaMetrics (the shards remote_write to its /api/v1/write)
with vmalert evaluating the run rules against it and writing their recordings back (docs/engines.md).
"""

import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from grafana.rules import NODE_RULES, RUN_RULES, groups
from stepscope_testkit.fake_nvml.scenario import make_gpu, make_scenario, write_scenario
from stepscope_testkit.ingest_bodies import counter, histogram, info_family, state_family
from stepscope_testkit.processes import free_port, running_exporter
from stepscope_testkit.sharded import SHARDED_DIR, hashmod
from tests.support.dashboard_queries import EMPTY_WHILE_ALL_DRAWN, LABEL_VALUES, panel_queries, variable_queries
from tests.support.prometheus import query, running_prometheus_config, series, wait_for
from tests.support.replay_judge import ENGINES
from tests.support.victoria import alerts, running_victoria, running_vmalert

RUN = "ddp"
SLOW_RANK = "1"
STEPS_PER_SECOND = 10
STEP_SECONDS = 0.1
# seconds per step by phase, per rank: the slow rank's forward is long, the fast rank waits in backward
PHASES = {
    "0": {"dataloader_next": 0.005, "to_device": 0.005, "forward": 0.02, "backward": 0.065},
    "1": {"dataloader_next": 0.005, "to_device": 0.005, "forward": 0.06, "backward": 0.025},
}
READY_SECONDS = 120
# A series name in a query: a metric or recording (a recording's colons included), not a function or label.
SERIES_NAME = re.compile(r"\b(?:[a-z_]+:)?stepscope_\w+(?::\w+)?")

pytestmark = pytest.mark.timeout(300)


@dataclass
class Layout:
    shards: list[str]  # shard URLs, by shard number
    addresses: dict[str, str]  # node (instance) -> its exporter's host:port
    scraped_by: dict[str, int]  # node -> the shard that scrapes it
    global_url: str  # where the run rules' recordings are queried (and the shards write)
    alerts_url: str  # where the run rules' alerts are listed (Prometheus, or vmalert)


def _ports_on_both_shards() -> tuple[int, int]:
    """Two free ports whose 127.0.0.1 addresses hash to different shards."""
    first = free_port()
    while True:
        second = free_port()
        if second != first and hashmod(f"127.0.0.1:{first}", 2) != hashmod(f"127.0.0.1:{second}", 2):
            return first, second


def _body(rank: str, steps: int) -> str:
    """What a rank of RUN pushes after `steps` steps of STEP_SECONDS (cumulative)."""
    phases = "# TYPE stepscope_step_phase_seconds histogram\n" + "".join(
        histogram("stepscope_step_phase_seconds", [("+Inf", steps)], steps, seconds * steps, f'phase="{phase}"')
        for phase, seconds in PHASES[rank].items())
    step = "# TYPE stepscope_step_seconds histogram\n" + histogram(
        "stepscope_step_seconds", [("0.05", 0), ("0.1", steps), ("0.2", steps), ("+Inf", steps)],
        steps, STEP_SECONDS * steps)
    return (phases + step + counter("stepscope_steps_total", steps)
            + counter("stepscope_samples_total", 32 * steps) + info_family(os.getpid()) + state_family("train"))


class Pushes(threading.Thread):
    """Pushes both ranks' cumulative bodies every half second until stopped."""

    def __init__(self, exporters: dict[str, str]) -> None:  # rank -> exporter URL
        super().__init__(daemon=True)
        self.exporters = exporters
        self.stopped = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        steps = 0
        while not self.stopped.wait(0.5):
            steps += STEPS_PER_SECOND // 2
            for rank, url in self.exporters.items():
                try:
                    response = requests.put(f"{url}/metrics/job/stepscope/run/{RUN}/rank/{rank}",
                                            data=_body(rank, steps), timeout=5)
                    response.raise_for_status()
                except requests.RequestException as exc:
                    self.errors.append(repr(exc))


def _gpu_node(path: Path) -> Path:
    """A busy H100 whose memory this test process (both ranks' pid) holds, and an idle one."""
    busy = make_gpu(0, "H100", processes=[(os.getpid(), 8 << 30)], utilization={"gpu": 95, "memory": 40},
                    gpm={"sm_util": 90.0, "sm_occupancy": 45.0, "any_tensor_util": 60.0, "dram_bw_util": 50.0})
    idle = make_gpu(1, "H100", utilization={"gpu": 0, "memory": 0},
                    gpm={"sm_util": 0.0, "sm_occupancy": 0.0, "any_tensor_util": 0.0, "dram_bw_util": 0.0})
    scenario = make_scenario(gpus=0, processes_per_gpu=0)
    scenario["gpus"] = [busy, idle]
    return write_scenario(path, scenario)


def _run_alerts_without_for(tmp: Path) -> Path:
    """The run file's alerts with `for: 0s`, in a group of their own: what fires after the `for`."""
    alerts = [{**rule, "for": "0s"} for group in groups((RUN_RULES,)) for rule in group["rules"] if "alert" in rule]
    path = tmp / "run-alerts-now.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "stepscope-run-alerts-now", "rules": alerts}]}))
    return path


def _shard_config(shard: int, nodes: dict[str, str], global_url: str) -> dict:
    """docker/prometheus/sharded/shard.yml for this test: 1 s intervals, the two exporters, this shard."""
    config = yaml.safe_load((SHARDED_DIR / "shard.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["global"]["external_labels"]["stepscope_shard"] = str(shard)
    config["rule_files"] = [str(NODE_RULES)]
    del config["alerting"]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [address], "labels": {"instance": node}} for node, address in nodes.items()]
    job["relabel_configs"][1]["regex"] = str(shard)
    config["remote_write"][0]["url"] = f"{global_url}/api/v1/write"
    return config


def _global_config(tmp: Path) -> dict:
    config = yaml.safe_load((SHARDED_DIR / "global.yml").read_text())
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(RUN_RULES), str(_run_alerts_without_for(tmp))]
    del config["alerting"]
    return config


def _firing(url: str, name: str) -> dict[str, dict]:
    """The label sets of the firing alerts called `name`, by rank."""
    return {labels.get("rank", ""): labels for labels in alerts(url) if labels["alertname"] == name}


def _verdict(url: str) -> str:
    found = query(url, f'run:stepscope_bottleneck:verdict{{run="{RUN}"}}')
    return found[0]["metric"]["verdict"] if found else ""


@contextmanager
def _global_layer(engine: str, tmp: Path) -> Iterator[tuple[str, str]]:
    """(URL the shards write to and the tests query, URL listing the alerts) of the global layer."""
    if engine == "victoriametrics":
        with running_victoria(tmp / "victoria") as victoria, \
                running_vmalert(tmp / "vmalert", victoria.url, [RUN_RULES, _run_alerts_without_for(tmp)]) as vmalert:
            yield victoria.url, vmalert.url
        return
    with running_prometheus_config(tmp, _global_config(tmp), "--web.enable-remote-write-receiver") as top:
        yield top.url, top.url


@pytest.fixture(scope="module", params=ENGINES)
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    tmp = tmp_path_factory.mktemp(f"sharded-{request.param}")
    ports = _ports_on_both_shards()
    nodes = {f"node-{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}
    dirs = {name: tmp / name for name in ("global", "shard-0", "shard-1", "node-0", "node-1")}
    for path in dirs.values():
        path.mkdir()
    with running_exporter(dirs["node-0"], fake_nvml_scenario=_gpu_node(tmp / "nvml-0.json"), port=ports[0]) as e0, \
            running_exporter(dirs["node-1"], fake_nvml_scenario=_gpu_node(tmp / "nvml-1.json"), port=ports[1]) as e1, \
            _global_layer(request.param, dirs["global"]) as (top, top_alerts), \
            running_prometheus_config(dirs["shard-0"], _shard_config(0, nodes, top)) as s0, \
            running_prometheus_config(dirs["shard-1"], _shard_config(1, nodes, top)) as s1:
        pushes = Pushes({"0": e0.url, "1": e1.url})
        pushes.start()
        try:
            ready = wait_for(lambda: _verdict(top) and _firing(top_alerts, "StepscopeStragglerRank"),
                             READY_SECONDS, interval=2.0)
            assert ready, f"no verdict or straggler alert in the global layer ({request.param}): {_verdict(top)!r}"
            assert not pushes.errors, pushes.errors[:3]
            scraped_by = {item["metric"]["instance"]: shard for shard, url in enumerate((s0.url, s1.url))
                          for item in query(url, 'up{job="stepscope"}')}
            yield Layout([s0.url, s1.url], nodes, scraped_by, top, top_alerts)
        finally:
            pushes.stopped.set()
            pushes.join(10)


def test_each_shard_scrapes_its_hashmod_share(layout: Layout) -> None:
    assert layout.scraped_by == {node: hashmod(address, 2) for node, address in layout.addresses.items()}
    assert sorted(layout.scraped_by.values()) == [0, 1]


def test_no_shard_alone_sees_the_run(layout: Layout) -> None:
    for url in layout.shards:
        assert len(query(url, f'run_rank:stepscope_steps:rate1m{{run="{RUN}"}}')) == 1
        assert not query(url, "run:stepscope_bottleneck:verdict")


def test_global_layer_names_the_verdict_of_the_whole_run(layout: Layout) -> None:
    assert _verdict(layout.global_url) == "gpu_bound"
    # the run's step rate is its slowest rank's, each rank sent by its own shard; its samples/s is both
    # ranks'. The run's recordings trail the ranks' by a cycle or two while the young series' rates still
    # grow, more on a loaded machine (0.79 once in a clean-clone CI run): within 20 s of evaluations the
    # ratios must meet (a sum where a min belongs would hold them at 2, a missing shard's rank at 0.5).
    steps = "run:stepscope_steps:rate1m / on (run) min by (run) (run_rank:stepscope_steps:rate1m)"
    samples = "run:stepscope_samples:rate1m / on (run) sum by (run) (run_rank:stepscope_samples:rate1m)"
    ratios: dict[str, float] = {}

    def settled() -> bool:
        for name, expr in (("steps", steps), ("samples", samples)):
            (ratio,) = query(layout.global_url, expr)
            ratios[name] = float(ratio["value"][1])
        return all(value == pytest.approx(1, abs=0.1) for value in ratios.values())

    assert wait_for(settled, timeout=20), ratios
    (ranks,) = query(layout.global_url, f'run:stepscope_training_ranks:count{{run="{RUN}"}}')
    assert ranks["value"][1] == "2"


def test_global_run_quantile_adds_up_the_shards_partial_buckets(layout: Layout) -> None:
    partial = query(layout.global_url, f'shard_run_le:stepscope_step_seconds_bucket:rate1m{{run="{RUN}",le="+Inf"}}')
    assert sorted(item["metric"]["stepscope_shard"] for item in partial) == ["0", "1"]
    # Every step is in (0.05, 0.1]: halfway through it, once the shards' le="0.1" and le="+Inf" partial sums
    # are of the same evaluation. VictoriaMetrics read +Inf 1.4% over 0.1 once while the young rates still grew
    # (p50 0.07534, in a run of the first phase): within 20 s of evaluations it must be exact.
    seen: list[float] = []

    def halfway() -> bool:
        (p50,) = query(layout.global_url, f'run:stepscope_step_seconds:p50_rate1m{{run="{RUN}"}}')
        seen.append(float(p50["value"][1]))
        return seen[-1] == pytest.approx(0.075)

    assert wait_for(halfway, timeout=20), seen


def test_straggler_alert_fires_for_the_slow_rank_only(layout: Layout) -> None:
    firing = _firing(layout.alerts_url, "StepscopeStragglerRank")
    assert set(firing) == {SLOW_RANK}
    assert firing[SLOW_RANK]["instance"] == f"node-{SLOW_RANK}"
    # DDP makes every rank's step time equal: its local phases' score caught it (the alert names it in its text)
    below = query(layout.global_url, f'run_rank:stepscope_straggler_alert_scores:ratio{{run="{RUN}"}} < 0.75')
    assert {(item["metric"]["rank"], item["metric"]["score"]) for item in below} == {(SLOW_RANK, "local_phases")}


def test_shards_send_recordings_not_the_raw_node_series(layout: Layout) -> None:
    top = layout.global_url
    assert query(top, "run_rank:stepscope_step_seconds:mean_rate1m")
    assert query(top, 'stepscope_training_state{state="train"}')
    for raw in ("stepscope_step_seconds_bucket", "stepscope_step_phase_seconds_sum", "stepscope_gpu_utilization_ratio"):
        assert not query(top, raw), f"{raw} reached the global layer"


@pytest.mark.parametrize("name", ["shard.yml", "global.yml"])
def test_promtool_accepts_the_sharded_configs_with_the_mounted_rules(tmp_path: Path, name: str) -> None:
    # Laid out as for the single Prometheus: the config, with grafana/rules/ as rules/ next to it.
    shutil.copy(SHARDED_DIR / name, tmp_path / name)
    shutil.copytree(NODE_RULES.parent, tmp_path / "rules")
    result = subprocess.run(["promtool", "check", "config", str(tmp_path / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cluster_dashboard_works_from_the_global_layer(layout: Layout) -> None:
    """What the shards send serves the fleet view: every Cluster panel query returns data there
    (each node has an idle GPU, for the Idle GPUs panel), but the GPU-hours held idle: no GPU here is
    held idle for 30 minutes (grafana/rules/tests/goodput.yml proves those series; what they read is
    in the shards' write filter, test_rules checks)."""
    held_idle = {"GPU-hours held but idle", "GPU-hours held but idle per namespace"}
    empty = [f"{q.panel}: {q.expr}" for q in panel_queries() if q.dashboard == "stepscope-cluster.json"
             and q.panel not in held_idle and not query(layout.global_url, q.expr)]
    assert not empty, "\n".join(empty)


# Training panels that read a node's raw series, which the shards do not send: served by the shard that scrapes
# the node (docs/deployment.md#past-one-prometheus-the-sharded-layout says so and why).
TRAINING_SHARD_ONLY = {
    "Step time p50 / p95 per rank": "per-rank step-time quantiles read the raw buckets at query time",
    "Per-rank comparison": "its p95 column is a per-rank step-time quantile",
    "Time per state": "stepscope_state_seconds_total, per rank",
    "Where each rank is": "the ranks' last-step and phase timestamps",
    "PyTorch allocator memory per rank": "the allocator's gauges, per rank",
    "Allocation retries and OOMs per rank": "the allocator's counters, per rank",
    "Host CPU of the run's processes (cores)": "process series",
    "Host memory of the run's processes": "process series",
    "Data-loader workers and read throughput": "process series",
    "Limits per rank": "each rank's measured limits",
    "Profiler traces (stepscope-profile)": "each rank's trace files",
}
# Run-level Training panels this layout's pushes leave empty on any Prometheus: they carry no tokens, FLOPs,
# limits, restores or state seconds (stepscope_state_seconds_total, what goodput and the pace per second of
# training read); grafana/rules/tests prove those recordings, the write-filter test above that they are sent.
# "Energy over the range" sums at 1m steps aligned to the minute: empty until the run's series is older than
# the last minute boundary (VictoriaMetrics read it empty once).
TRAINING_EMPTY_HERE = {
    "Energy over the range",
    "MFU", "Tokens/s", "Model FLOP/s", "Peak FLOP/s of the run's GPUs", "MFU per rank, and tensor-core activity",
    "Tokens/s and samples/s per rank", "Limits verdict", "Loader can deliver / training consumes / run gets",
    "Limits next to the real throughput", "Energy per token", "Steps redone after a restore (range)",
    "Steps being redone", "Goodput", "Where the time went (range)", "Where the time went (over time)",
    "Pace against its own",
}


def _keep() -> re.Pattern[str]:
    """The shards' write filter (shard.yml's keep on __name__), as Prometheus anchors it."""
    (relabel,) = yaml.safe_load((SHARDED_DIR / "shard.yml").read_text())["remote_write"][0]["write_relabel_configs"]
    return re.compile(relabel["regex"])


def test_training_dashboard_reads_what_the_shards_send_but_the_shard_only_panels() -> None:
    """Every series name a Training variable or run-level panel reads passes the shards' write filter; the
    panels that do not are the documented shard-only ones (each named in docs/deployment.md)."""
    keep = _keep()
    texts = [(v.variable, v.raw_query) for v in variable_queries() if v.dashboard == "stepscope-training.json"]
    texts += [(q.panel, q.raw_expr) for q in panel_queries() if q.dashboard == "stepscope-training.json"]
    unsent = {where for where, expr in texts for name in SERIES_NAME.findall(expr) if not keep.fullmatch(name)}
    assert unsent == set(TRAINING_SHARD_ONLY), (sorted(unsent - set(TRAINING_SHARD_ONLY)),
                                                sorted(set(TRAINING_SHARD_ONLY) - unsent))
    deployment = " ".join((Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text().split())
    assert all(f"**{panel}**" in deployment for panel in TRAINING_SHARD_ONLY)


def test_training_dashboard_works_from_the_global_layer(layout: Layout) -> None:
    """Grafana reading the global layer: the `run` variable offers the run, `rank` its two ranks (each sent by
    its own shard), and every run-level panel query returns data, but those this layout cannot fill."""
    variables = {v.variable: v.raw_query for v in variable_queries() if v.dashboard == "stepscope-training.json"}
    assert set(variables) == {"run", "rank"}
    offered = {}
    for name, raw in variables.items():
        selector, label = LABEL_VALUES.match(raw.replace("$run", RUN)).groups()
        offered[name] = {item[label] for item in series(layout.global_url, selector) if label in item}
    assert offered == {"run": {RUN}, "rank": {"0", "1"}}
    training = [q for q in panel_queries() if q.dashboard == "stepscope-training.json"
                and q.panel not in set(TRAINING_SHARD_ONLY) | TRAINING_EMPTY_HERE]
    assert training
    empty = [f"{q.panel} {q.ref_id}: {q.expr}" for q in training
             if (q.dashboard, q.panel, q.ref_id) not in EMPTY_WHILE_ALL_DRAWN and not query(layout.global_url, q.expr)]
    assert not empty, "\n".join(empty)
