"""What reaches a person, and when: the Alertmanager config before issue 28 against the shipped one.

Both run through the same real stack (tests/support/alerting.py): two exporters with fake NVML,
hook processes for a data-bound run, a GPU-bound run, a stalled run (critical) on node-a and a
data-bound run spread over node-a and node-b; a real Prometheus with the generated rules (every `for`
a sixtieth) and a real Alertmanager (Debian's 0.25) whose receiver is a webhook here. Group timings
are the configs' own divided by 15 (30s wait -> 2s; 5m interval -> 20s before, 1m -> 4s now).

Per config and repeat: the notifications each run got within WATCH_SECONDS of the trainers' start
(long enough for StepscopeGpuUnderutilized, the slowest alert, to fire), how long after Prometheus
fired StepscopeDataLoadingBottleneck the data-bound run's first page came, and how long after that
run's SIGTERM its `resolved` came (the stalled run's critical still firing on the same node).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_alert_delivery.py [--repeats 2]

Writes benchmarks/results/alert_delivery.md.
"""

import argparse
import signal
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

from tests.support.alerting import (
    ALERTMANAGER_DIR,
    RANKS,
    Inbox,
    alertmanager_config,
    firing_in_prometheus,
    running_alertmanager,
    running_training_stack,
    webhook_server,
)

RESULTS = Path(__file__).resolve().parent / "results" / "alert_delivery.md"
SCALE = 15  # the configs' group timings are divided by this
WATCH_SECONDS = 80
RESOLVED_WAIT_SECONDS = 60
# docker/alertmanager/alertmanager.yml as shipped before issue 28 (commit 664c5cb)
BEFORE = yaml.safe_load("""
route:
  receiver: default
  group_by: [alertname, run, instance]
  group_wait: 30s
  group_interval: 5m
  repeat_interval: 4h
receivers:
  - name: default
inhibit_rules:
  - source_matchers: [severity="critical"]
    target_matchers: [severity="warning"]
    equal: [instance]
""")
RUNS = sorted({run for run, _ in RANKS})


def scaled(duration: str) -> int:
    return int(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]] // SCALE


def fired_at(prometheus: str, run: str) -> float | None:
    """When Prometheus fired StepscopeDataLoadingBottleneck for `run` (activeAt + its `for`, 10m -> 10 s)."""
    found = firing_in_prometheus(prometheus, "StepscopeDataLoadingBottleneck", run)
    if not found:
        return None
    return datetime.fromisoformat(found[0]["activeAt"].replace("Z", "+00:00")).timestamp() + 10


def one_repeat(config: dict) -> dict:
    """Notifications per run, the first data-bound page's delay and the resolved delay (None: never)."""
    with tempfile.TemporaryDirectory() as name, webhook_server() as (url, inbox):
        tmp = Path(name)
        route = config["route"]
        timings = scaled(route["group_wait"]), scaled(route["group_interval"])
        config_file = alertmanager_config(tmp, url, config, *timings)
        with running_alertmanager(tmp, config_file) as alertmanager, \
                running_training_stack(tmp, alertmanager, "http://grafana.example:3000") as stack:
            time.sleep(WATCH_SECONDS)
            result = {"pages": {run: pages(inbox, run) for run in RUNS}}
            first = inbox.webhooks("databound", "firing")
            fired = fired_at(stack.prometheus, "databound")
            result["page_delay"] = first[0].wall - fired if first and fired else None
            closed = time.monotonic()
            trainer = stack.trainers[("databound", 0)]
            trainer.send_signal(signal.SIGTERM)
            trainer.wait(timeout=20)
            deadline = closed + RESOLVED_WAIT_SECONDS
            while not inbox.webhooks("databound", "resolved") and time.monotonic() < deadline:
                time.sleep(0.2)
            resolved = inbox.webhooks("databound", "resolved")
            result["resolved_delay"] = resolved[0].at - closed if resolved else None
    return result


def pages(inbox: Inbox, run: str) -> list[str]:
    """The firing notifications of `run`: alert name and how many alerts each carried."""
    return [f"{n.body['commonLabels'].get('alertname')} x{len(n.body['alerts'])}"
            for n in inbox.webhooks(run, "firing")]


def summary(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    never = len(values) - len(got)
    if not got:
        return f"never ({never} of {len(values)})"
    text = f"{statistics.median(got):.1f} s ({min(got):.1f}-{max(got):.1f})"
    return text + (f", never in {never} of {len(values)}" if never else "")


def table(results: dict[str, list[dict]]) -> str:
    rows = ["| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for run in RUNS:
        cells = ["; ".join(sorted({", ".join(r["pages"][run]) or "none" for r in repeats}))
                 for repeats in results.values()]
        rows.append(f"| pages of run `{run}` | " + " | ".join(cells) + " |")
    rows.append("| first data-bound page after Prometheus fired it (median, min-max) | "
                + " | ".join(summary([r["page_delay"] for r in repeats]) for repeats in results.values()) + " |")
    rows.append(f"| `resolved` after the data-bound run's SIGTERM (waited {RESOLVED_WAIT_SECONDS} s) | "
                + " | ".join(summary([r["resolved_delay"] for r in repeats]) for repeats in results.values()) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    shipped = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    configs = {"before issue 28 (664c5cb)": BEFORE, "shipped": shipped}
    results = {label: [] for label in configs}
    for repeat in range(args.repeats):  # interleaved, so both see the same machine load
        for label, config in configs.items():
            results[label].append(one_repeat(config))
            print(f"repeat {repeat + 1}, {label}: {results[label][-1]}", flush=True)
    text = (f"# Alert delivery through a real Alertmanager ({args.repeats} repeats per config)\n\n"
            f"`PYTHONPATH=. .venv/bin/python benchmarks/bench_alert_delivery.py --repeats {args.repeats}`; "
            f"group timings divided by {SCALE}, every `for` by 60, 1 s scrape and evaluation. "
            "`xN`: alerts in the notification.\n\n" + table(results) + "\n")
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
