"""The verdicts and alerts of the shipped rules on every real-GPU recording, as a confusion matrix.

    PYTHONPATH=. python benchmarks/bench_verdicts.py                     # ~90 s per recording
    PYTHONPATH=. python benchmarks/bench_verdicts.py --baseline 5b012ca  # and the rules of that commit

Each recording in benchmarks/corpus/ (exporter scrapes taken every 2 s on a real GPU while known
workloads trained, with the truth each loop measured) is replayed at its recorded pace to a real
Prometheus running the rule files (tests/support/replay_judge.py), and the run verdict is read every
second. A row is a workload: the share of its training time under each verdict ("none": no verdict
yet, the settle time), the seconds from its first step in state train to its first verdict, and the
alerts firing while its verdict speaks (the alerts with `for: 0s`, i.e. what fires once the readings
last the shipped `for`). --baseline judges the rule files of another commit on the same recordings,
one after the other. Writes benchmarks/results/verdicts.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grafana.rules import RULE_FILES
from stepscope.contract import verdicts
from stepscope_testkit import results
from stepscope_testkit.replay import Recording, recordings
from tests.support.replay_judge import Judged, judge

RESULTS = Path(__file__).resolve().parent / "results" / "verdicts.md"
COLUMNS = ("none", verdicts.IDLE, verdicts.DATA_BOUND, verdicts.GPU_BUSY_IDLE, verdicts.GPU_BOUND,
           verdicts.HOST_BOUND, verdicts.UNDETERMINED)


def rules_of(commit: str, folder: Path) -> tuple[Path, ...]:
    """The generated rule files as they were at `commit`, written under `folder`."""
    paths = []
    for path in RULE_FILES:
        relative = path.relative_to(Path(__file__).resolve().parents[1])
        text = subprocess.run(["git", "show", f"{commit}:{relative}"], capture_output=True, text=True, check=True)
        paths.append(folder / path.name)
        paths[-1].write_text(text.stdout)
    return tuple(paths)


def table(recording: Recording, judged: dict[str, Judged]) -> str:
    """One row per workload: truth, verdict shares while training, first verdict, alerts, right or not."""
    head = ["workload", "truth", *COLUMNS, "first verdict", "alerts while the verdict speaks", "right"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, result in judged.items():
        truth = result.workload.expected_verdict
        shares = result.shares()
        spoken = {verdict for verdict in shares if verdict not in ("none", verdicts.IDLE)}
        alerts = sorted({alert.removeprefix("Stepscope") for reading in result.training()
                         if reading.verdict not in (None, verdicts.IDLE) for alert in reading.alerts})
        first = result.seconds_to_first_verdict()
        cells = [name, truth, *(f"{shares[c]:.0%}" if shares[c] else "" for c in COLUMNS),
                 "-" if first is None else f"{first:.0f} s", ", ".join(alerts) or "none",
                 "yes" if spoken == {truth} else "**no**"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="also judge the rule files of this git commit")
    args = parser.parse_args(argv)
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        rule_sets = {"shipped rules (this checkout)": RULE_FILES}
        if args.baseline:
            rule_sets[f"rules at {args.baseline}"] = rules_of(args.baseline, Path(tmp))
        for recording in recordings():
            for label, rule_files in rule_sets.items():
                folder = Path(tempfile.mkdtemp(dir=tmp))
                judged = judge(recording, folder, rule_files)
                parts.append((f"{recording.name}: {label}", f"{recording.device}\n\n{table(recording, judged)}"))
    header = (f"# Verdicts on real-GPU recordings\n\n{results.machine()}, {results.load_average()}. "
              "Shares of each workload's training time under each verdict; the recordings were made on the "
              "device each section names, the replay runs here.\n")
    results.publish(RESULTS, header + results.sections(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
