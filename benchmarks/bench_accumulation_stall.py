"""A step of many micro-batches is no stall: one rank per checkout steps once (unobserved: no pace yet), then takes
one step of 9 micro-batches of 10 s (90 s, longer than StepscopeTrainingStalled's 60 s floor), pushing every second to
a real exporter scraped by a real Prometheus with the shipped rules; prints when the alert first fired for each.

    PYTHONPATH=. python benchmarks/bench_accumulation_stall.py [--before /path/to/a/checkout/before/the/fix]

Results: benchmarks/results/accumulation.md.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

MICRO_BATCHES = 9
MICRO_BATCH_SECONDS = 10.0


def rank(run: str, url: str) -> None:
    import stepscope.hooks

    tracker = stepscope.hooks.init(run=run, push_url=url, push_interval=1.0, handle_sigterm=False)
    tracker.state("train")
    tracker.step(samples=4)  # the first step: not observed, so the alert's pace is its 60 s floor
    for _ in range(MICRO_BATCHES):
        time.sleep(MICRO_BATCH_SECONDS)
        tracker.micro_batch(samples=4)
    tracker.step(samples=4)
    tracker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout of the code to compare with (run 'before')")
    parser.add_argument("--rank", nargs=2, metavar=("RUN", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank(*args.rank)
        return
    from grafana.rules import RULE_FILES
    from stepscope_testkit.processes import REPO_ROOT, running_exporter
    from tests.support.prometheus import query, running_prometheus, wait_for

    roots = {"this": REPO_ROOT, **({"before": args.before.resolve()} if args.before else {})}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"accum-stall-{os.getpid()}"
    tmp.mkdir()
    with running_exporter(tmp) as exporter, \
            running_prometheus(tmp, {"node-a": exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        assert wait_for(lambda: query(prometheus.url, "up == 1"), 30)
        ranks = [subprocess.Popen([sys.executable, str(REPO_ROOT / "benchmarks" / Path(__file__).name), "--rank", run,
                                   exporter.url], env={**os.environ, "PYTHONPATH": str(root)})
                 for run, root in roots.items()]
        began, fired = time.time(), {}
        while any(process.poll() is None for process in ranks):
            for alert in query(prometheus.url, 'ALERTS{alertname="StepscopeTrainingStalled"}'):
                fired.setdefault(alert["metric"]["run"], round(time.time() - began, 1))
            time.sleep(2)
    print(f"one step of {MICRO_BATCHES} x {MICRO_BATCH_SECONDS:g} s micro-batches; StepscopeTrainingStalled first "
          f"seen (s after the step began): {fired or 'never'}")


if __name__ == "__main__":
    main()
