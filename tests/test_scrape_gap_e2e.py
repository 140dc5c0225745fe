"""End to end: an exporter restart resolves no alert and restarts no `for`, on both engines.

A real exporter (fake NVML) on one node with three runs, each training process pushing every 0.5 s: a
data-bound one (its GPU at 25%: StepscopeDataLoadingBottleneck, which mutes its GPU's waiting), one whose GPU
waits at 25% with no loader time (StepscopeGpuUnderutilized) and a GPU-bound one (its GPU at 98%, SM active
73%), and both engines
scraping the exporter every second: Prometheus with the shipped rule files, and VictoriaMetrics with
vmalert evaluating the same files. Each engine also loads the alerts with `for: 0s`
(tests/support/replay_judge.py), so an alert's condition is visible at once: the copy fires while it
holds. Once both copies fire, the exporter is stopped, left down for GAP_SECONDS (failed scrapes: every
series of the target is marked stale) and started again on the same port (it serves the rank's pushed
series only after the rank's retry, at its push interval). The copies must fire at every look through
the gap, the shipped alerts stay pending since the same moment (no `resolved`, no new `for`), and the
GPU-bound run gets no alert at any look (stepscope_contract/scrape_gaps.py;
grafana/rules/tests/scrape_gaps.yml has the same in promtool).

A third rank, killed (SIGKILL) once it has pushed, is lost before the stop: the restarted exporter forgets
it, and its StepscopeRankLost must fire at every look all the same, with the activeAt it had, while the
live ranks get no StepscopeRankLost at any look.
"""

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings
from stepscope_testkit.fake_nvml.scenario import write_scenario
from stepscope_testkit.processes import free_port, running_exporter
from tests.support.alerting import start_trainer
from tests.support.demos import gpus_for_runs
from tests.support.prometheus import query, running_prometheus_config, wait_for
from tests.support.replay_judge import alerts_without_for
from tests.support.victoria import running_victoria, running_vmalert

RUN, WAITING, HEALTHY, LOST = "databound", "gpuwaits", "gpubound", "lost"
RANK_LOST = "StepscopeRankLost"
ALERTS = {RUN: "StepscopeDataLoadingBottleneck", WAITING: "StepscopeGpuUnderutilized"}  # run -> the alert it gets
GAP_SECONDS = 3  # three failed scrapes at 1 s
WATCH_SECONDS = 20  # from the stop: the gap, the restart, the rank's retry, and some steady time after
LAYOUT = {0: (25, 10, (RUN, 0)), 1: (98, 73, (HEALTHY, 0)), 2: (25, 10, (WAITING, 0))}  # GPUs 0 and 2 wait
TRAINERS = {RUN: (0.06, 0.01), HEALTHY: (0.0, 0.05), WAITING: (0.0, 0.05)}  # run -> (loader, compute) s per step
# the exporter (a stack of its own, to stop and start again), its port, engine -> (query URL, alerts URL)
Engines = tuple[ExitStack, int, dict[str, tuple[str, str]]]

pytestmark = pytest.mark.timeout(240)


def alert_states(url: str, run: str = RUN) -> dict[tuple[str, str], set[str]]:
    """(alertname, state) -> the activeAt of each of `run`'s alerts in that state, from Prometheus' or
    vmalert's /api/v1/alerts."""
    response = requests.get(f"{url}/api/v1/alerts", timeout=10)
    response.raise_for_status()
    found: dict[tuple[str, str], set[str]] = {}
    for alert in response.json()["data"]["alerts"] or []:
        if alert["labels"].get("run") == run:
            found.setdefault((alert["labels"]["alertname"], alert["state"]), set()).add(alert["activeAt"])
    return found


def watched_states(url: str) -> dict[tuple[str, str], set[str]]:
    """The states of each watched run's alert (ALERTS), keyed as alert_states keys them."""
    return {key: since for run, name in ALERTS.items() for key, since in alert_states(url, run).items()
            if key[0] == name}


def firing_and_pending(states: dict[tuple[str, str], set[str]]) -> bool:
    return all((name, state) in states for name in ALERTS.values() for state in ("firing", "pending"))


def active_since(states: dict[tuple[str, str], set[str]], name: str) -> set[str]:
    """The activeAt of alert `name`, pending or firing: the shipped alert's and its `for: 0s` copy's, which
    evaluate in different groups (and so at different moments)."""
    return states.get((name, "pending"), set()) | states.get((name, "firing"), set())


def lost_in_both_groups(states: dict[tuple[str, str], set[str]]) -> bool:
    """The `for: 0s` copy of StepscopeRankLost firing and the shipped one active too (pending: its `for` runs):
    two activeAts, one from each group. Read once the copy fired alone, the shipped one's activeAt came after
    (its group evaluated later; under load 0.5 s later on vmalert) and read as a `for` started again."""
    return (RANK_LOST, "firing") in states and len(active_since(states, RANK_LOST)) == 2


def pending_since(states: dict[tuple[str, str], set[str]]) -> dict[str, set[str]]:
    return {name: states.get((name, "pending"), set()) for name in ALERTS.values()}


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Engines]:
    """The exporter and both engines scraping it, each loading the rules and their `for: 0s` copy."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    write_scenario(tmp_path / "gpus.json", gpus_for_runs(LAYOUT, {}))  # the GPU from the start: read once
    rules = [*RULE_FILES, alerts_without_for(tmp_path)]
    scrape = [{"job_name": "stepscope", "static_configs": [{"targets": [target], "labels": {"instance": "node-a"}}]}]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(path) for path in rules], "scrape_configs": scrape}
    with ExitStack() as stack:
        exporter = stack.enter_context(ExitStack())
        exporter.enter_context(running_exporter(tmp_path, fake_nvml_scenario=tmp_path / "gpus.json", port=port))
        (tmp_path / "prometheus").mkdir()
        prometheus = stack.enter_context(running_prometheus_config(tmp_path / "prometheus", config))
        victoria = stack.enter_context(running_victoria(tmp_path / "victoria", scrape))
        vmalert = stack.enter_context(running_vmalert(tmp_path / "vmalert", victoria.url, rules))
        yield exporter, port, {"prometheus": (prometheus.url, prometheus.url),
                               "victoriametrics": (victoria.url, vmalert.url)}


def healthy_run_read(query_url: str) -> bool:
    """The engine has the GPU-bound run's GPU readings (so its silence is a judgement, not blindness)."""
    return bool(query(query_url, f'{recordings.RUN_GPU_UTILIZATION_BY_GPU}{{run="{HEALTHY}"}} > 0.9'))


def test_an_exporter_restart_resolves_no_alert_and_restarts_no_for(tmp_path: Path, engines: Engines) -> None:
    exporter, port, urls = engines
    url = f"http://127.0.0.1:{port}"
    lost = start_trainer(LOST, 0, url, 0.0, 0.05, world=1)
    trainers = {run: start_trainer(run, 0, url, *pace, world=1) for run, pace in TRAINERS.items()}
    looks = 0
    missing: dict[tuple[str, str], list[float]] = {}  # (engine, alert) -> seconds after the stop
    unexpected: set[str] = set()  # alerts of the GPU-bound run, and StepscopeRankLost of a live rank

    def look_until(seconds: float) -> None:
        nonlocal looks
        while time.monotonic() - stopped < seconds:
            looks += 1
            for engine, (_, alerts_url) in urls.items():
                states = watched_states(alerts_url)
                for name in ALERTS.values():
                    if (name, "firing") not in states:
                        missing.setdefault((engine, name), []).append(time.monotonic() - stopped)
                if (RANK_LOST, "firing") not in alert_states(alerts_url, LOST):
                    missing.setdefault((engine, f"{RANK_LOST} of {LOST}"), []).append(time.monotonic() - stopped)
                unexpected.update(f"{engine}: {name} {state}" for name, state in alert_states(alerts_url, HEALTHY))
                unexpected.update(f"{engine}: {run} {name} {state}" for run in ALERTS
                                  for name, state in alert_states(alerts_url, run) if name == RANK_LOST)
            time.sleep(0.5)

    try:
        assert wait_for(lambda: bool(query(urls["prometheus"][0], f'{families.TRAINING_LAST_PUSH}{{run="{LOST}"}}')),
                        60), "the rank to lose never pushed"
        lost.kill()
        lost.wait()
        pids = {(run, 0): trainer.pid for run, trainer in trainers.items()}
        write_scenario(tmp_path / "gpus.json", gpus_for_runs(LAYOUT, pids))
        for engine, (query_url, alerts_url) in urls.items():
            assert wait_for(lambda u=alerts_url: firing_and_pending(watched_states(u)), 120, interval=1), \
                f"{engine}: {watched_states(alerts_url)}"
            assert wait_for(lambda u=query_url: healthy_run_read(u), 60, interval=1), engine
            assert wait_for(lambda u=alerts_url: lost_in_both_groups(alert_states(u, LOST)), 120, interval=1), \
                f"{engine}: {alert_states(alerts_url, LOST)}"
        before = {engine: pending_since(watched_states(alerts_url)) for engine, (_, alerts_url) in urls.items()}
        lost_since = {engine: active_since(alert_states(alerts_url, LOST), RANK_LOST)
                      for engine, (_, alerts_url) in urls.items()}

        stopped = time.monotonic()
        exporter.close()
        look_until(GAP_SECONDS)
        exporter.enter_context(running_exporter(tmp_path, fake_nvml_scenario=tmp_path / "gpus.json", port=port))
        look_until(WATCH_SECONDS)
        assert all(trainer.poll() is None for trainer in trainers.values()), "a training process died"
    finally:
        for trainer in trainers.values():
            trainer.kill()
            trainer.wait()

    print(f"{looks} looks per engine over {WATCH_SECONDS} s from the stop")
    assert not missing, "\n".join(f"{engine} {name}: not firing at {len(seconds)} of {looks} looks, "
                                  f"{seconds[0]:.1f}-{seconds[-1]:.1f} s after the stop"
                                  for (engine, name), seconds in missing.items())
    assert not unexpected, sorted(unexpected)
    for engine, (query_url, alerts_url) in urls.items():
        assert pending_since(watched_states(alerts_url)) == before[engine], f"{engine}: a `for` started again"
        assert active_since(alert_states(alerts_url, LOST), RANK_LOST) == lost_since[engine], engine
        assert not query(query_url, f'{families.TRAINING_LAST_PUSH}{{run="{LOST}"}}'), f"{engine}: not forgotten"
        assert healthy_run_read(query_url), engine
        # the gap was real: failed scrapes, and a new exporter process
        (up,) = query(query_url, 'min_over_time(up{instance="node-a"}[1m])')
        assert float(up["value"][1]) == 0, engine
        (starts,) = query(query_url, f'count_over_time({families.EXPORTER_START_TIME}[1m]) '
                                     f'and changes({families.EXPORTER_START_TIME}[1m]) > 0')
        assert float(starts["value"][1]) > 0, engine
