"""The training alerts hold through eval and checkpoint breaks on VictoriaMetrics + vmalert as on Prometheus.

grafana/rules/tests/pauses.yml proves the holds on Prometheus (promtool): StepscopeDataLoadingBottleneck
and StepscopeStragglerRank read the rank's last reading while it validates or checkpoints
(`last_over_time`), StepscopeGpuUnderutilized and StepscopeGpuBusyButIdle read GPU readings that a
recording carries from its own previous value through a break. Here the same input series go into a real
VictoriaMetrics and real vmalert evaluates the shipped rule files over them, every evaluation of the
file's 30 s grid (tests/support/victoria_replay.py: vmalert's replay mode, stepped an evaluation at a
time, since a single replay cannot carry a recording's own value). Then:

- every expectation of pauses.yml holds on VictoriaMetrics at its evaluation time, read from the raw
  samples vmalert wrote (ALERTS, the straggler scores);
- the held alerts fire at every evaluation from their first firing to the run's end, breaks included,
  with one activeAt (ALERTS_FOR_STATE) all along: no resolve, no new `for`;
- what must not be held is not: a share that fell before the break, a rank back in setup (its alerts'
  `for` starts over once it trains again);
- the run verdict reads back its own last value through a break: from a run's first verdict to its end
  every evaluation reads that one verdict, breaks and the evaluations after them included.

Both shipped rule files are replayed, every rule (about 6 s on 2 cores).
"""

import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from grafana.rules import RULE_FILES, RULES_DIR
from stepscope.contract import recordings, verdicts
from tests.support.victoria_replay import (
    Samples,
    expand_values,
    parse_series,
    replayed_case,
    samples,
)

PAUSES = RULES_DIR / "tests" / "pauses.yml"
HELD = [  # (alert, run, the state its breaks are in)
    ("StepscopeDataLoadingBottleneck", "periodic", "eval"),
    ("StepscopeGpuUnderutilized", "hostwait", "eval"),  # periodic's is muted by its data loading, in the rules
    ("StepscopeGpuBusyButIdle", "busy", "checkpoint"),
    ("StepscopeStragglerRank", "pairbreak", "eval"),
]
HELD_VERDICTS = [  # (run, its verdict while it trains, the state its breaks are in)
    ("periodic", verdicts.DATA_BOUND, "eval"),
    ("busy", verdicts.GPU_BUSY_IDLE, "checkpoint"),
    ("rankzero", verdicts.DATA_BOUND, "checkpoint"),
]
ROUNDED = re.compile(r"^round\((?P<selector>.+),\s*(?P<to>[\d.]+)\)$")

pytestmark = pytest.mark.timeout(180)


@functools.cache
def _document() -> dict:
    """pauses.yml, every scalar a string (YAML 1.1 would read a value such as 0x40 as hex)."""
    return yaml.load(PAUSES.read_text(), Loader=yaml.BaseLoader)


def _case() -> dict:
    """pauses.yml's one test, on the shipped rule files in their order."""
    document = _document()
    assert [(PAUSES.parent / path).resolve() for path in document["rule_files"]] == list(RULE_FILES)
    (case,) = document["tests"]
    assert case["interval"] == document["evaluation_interval"], "series and evaluations on one grid"
    return case


def _seconds(duration: str) -> int:
    """A promtool duration such as 24m30s in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    hours, minutes, secs = (int(part or 0) for part in parts.groups())
    return hours * 3600 + minutes * 60 + secs


def _clock(offset: float) -> str:
    """Seconds from the start as pauses.yml writes times (16m30s), for messages."""
    return f"{int(offset) // 60}m{int(offset) % 60:02d}s"


@dataclass(frozen=True)
class Replayed:
    """pauses.yml's series in VictoriaMetrics at `url` from `start` (Unix seconds) on, evaluated by vmalert."""

    url: str
    start: int
    end: int
    interval: int

    def series(self, match: str) -> Samples:
        """The raw samples of the series `match` selects over the replayed range."""
        return samples(self.url, match, self.start, self.end)

    def states(self, alert: str, run: str) -> dict[int, str]:
        """Seconds from the start -> the alert's state for `run` at each evaluation it was active."""
        return {round(t - self.start): labels["alertstate"]
                for labels, points in self.series(f'ALERTS{{alertname="{alert}",run="{run}"}}') for t, _ in points}

    def verdicts(self, run: str) -> dict[int, set[str]]:
        """Seconds from the start -> the verdicts recorded for `run` at that evaluation."""
        read: dict[int, set[str]] = {}
        for labels, points in self.series(f'{recordings.RUN_VERDICT}{{run="{run}"}}'):
            for t, value in points:
                if not math.isnan(value):
                    read.setdefault(round(t - self.start), set()).add(labels["verdict"])
        return read

    def active_since(self, alert: str, run: str) -> list[int]:
        """The distinct activeAt (seconds from the start) the alert had for `run`, in order."""
        found = {round(value - self.start)
                 for _, points in self.series(f'ALERTS_FOR_STATE{{alertname="{alert}",run="{run}"}}')
                 for _, value in points}
        return sorted(found)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replayed]:
    case = _case()
    interval = _seconds(case["interval"])
    with replayed_case(case, RULE_FILES, interval, tmp_path_factory.mktemp("pauses-vm")) as (url, start, end):
        yield Replayed(url, start, end, interval)


def _expectations() -> list:
    """pauses.yml's expectations, each named by its alert (or expression) and run, and its time."""
    params = []
    for test in _case()["promql_expr_test"]:
        rounded = ROUNDED.match(test["expr"])
        labels = parse_series(rounded["selector"] if rounded else test["expr"])
        what = labels.get("alertname") or labels["__name__"]
        params.append(pytest.param(test, id=f"{what}-{labels.get('run')}@{test['eval_time']}"))
    return params


def _found(replayed: Replayed, expr: str, at: int) -> set[tuple[frozenset, float]]:
    """What `expr` (a selector, or round(selector, to)) reads at `at` seconds from the start, from the
    raw samples at that evaluation, without vmalert's alertgroup label."""
    rounded = ROUNDED.match(expr)
    selector, to = (rounded["selector"], float(rounded["to"])) if rounded else (expr, None)
    found = set()
    for labels, points in replayed.series(selector):
        for t, value in points:
            if round(t - replayed.start) == at:
                kept = {key: val for key, val in labels.items() if key not in ("__name__", "alertgroup")}
                found.add((frozenset(kept.items()), round(math.floor(value / to + 0.5) * to, 6) if to else value))
    return found


def _expected(test: dict) -> set[tuple[frozenset, float]]:
    """The samples a pauses.yml expectation lists, as `_found` gives them."""
    expected = set()
    for sample in test.get("exp_samples") or []:
        labels = {key: val for key, val in parse_series(sample["labels"]).items() if key != "__name__"}
        expected.add((frozenset(labels.items()), round(float(sample["value"]), 6)))
    return expected


@pytest.mark.parametrize("test", _expectations())
def test_every_expectation_of_pauses_yml_holds_on_victoriametrics(replayed: Replayed, test: dict) -> None:
    at = _seconds(test["eval_time"])
    assert _found(replayed, test["expr"], at) == _expected(test), (
        f"{test['expr']} at {test['eval_time']} on VictoriaMetrics + vmalert")


def _times_in(run: str, state: str) -> list[int]:
    """Seconds from the start of the evaluations at which a rank of `run` is in `state`, from pauses.yml."""
    interval = _seconds(_case()["interval"])
    return sorted({i * interval for item in _case()["input_series"]
                   if (labels := parse_series(item["series"])).get("run") == run and labels.get("state") == state
                   for i, value in enumerate(expand_values(item["values"])) if value == 1})


@pytest.mark.parametrize(("alert", "run", "state"), HELD, ids=[f"{alert}-{run}" for alert, run, _ in HELD])
def test_a_firing_alert_stays_firing_through_every_break(replayed: Replayed, alert: str, run: str,
                                                         state: str) -> None:
    states = replayed.states(alert, run)
    firing = sorted(at for at, value in states.items() if value == "firing")
    assert firing, f"{alert} never fired for {run}: {states}"
    last = _last_sample(run)
    held = [at for at in _times_in(run, state) if at > firing[0]]
    assert held, f"no {state} break of {run} after {alert} fired at {_clock(firing[0])}: the case proves nothing"
    missing = [_clock(at) for at in range(firing[0], last + 1, replayed.interval) if states.get(at) != "firing"]
    assert not missing, (f"{alert} of {run} fired at {_clock(firing[0])} but not at {missing} "
                         f"({state} at {[_clock(at) for at in held]})")
    assert len(replayed.active_since(alert, run)) == 1, f"{alert} of {run} restarted its for"


def test_a_share_that_fell_before_the_break_is_not_held(replayed: Replayed) -> None:
    """recovered: data-bound for 12 min, 5% loading for 3 min, then validating: once resolved, its
    alert stays inactive, the validation holding the low share."""
    states = replayed.states("StepscopeDataLoadingBottleneck", "recovered")
    assert states.get(_seconds("12m")) == "firing", states
    after = {_clock(at): value for at, value in states.items() if at >= _seconds("13m")}
    assert after == {}, f"recovered's alert after its share fell: {after}"
    assert _times_in("recovered", "eval"), "recovered never validates: the case proves nothing"


@pytest.mark.parametrize(("alert", "run"), [("StepscopeDataLoadingBottleneck", "restart"),
                                            ("StepscopeGpuUnderutilized", "gpusetup")])
def test_a_rank_back_in_setup_holds_nothing_and_starts_its_for_over(replayed: Replayed, alert: str,
                                                                   run: str) -> None:
    states = replayed.states(alert, run)
    setup = _times_in(run, "setup")
    assert setup and states.get(setup[0] - replayed.interval) == "firing", (
        f"{alert} of {run} was not firing before setup: {states}")
    in_setup = {_clock(at): states[at] for at in setup if at in states}
    assert in_setup == {}, f"{alert} of {run} held in setup: {in_setup}"
    again = [at for at in states if at > setup[-1]]
    assert again and all(states[at] == "pending" for at in again), states
    assert replayed.active_since(alert, run)[-1] > setup[-1], f"{alert} of {run} kept its old activeAt"


def _last_sample(run: str) -> int:
    """Seconds from the start of `run`'s last input sample in pauses.yml."""
    interval = _seconds(_case()["interval"])
    return max(i * interval for item in _case()["input_series"] if parse_series(item["series"]).get("run") == run
               for i, _ in enumerate(expand_values(item["values"])))


@pytest.mark.parametrize(("run", "verdict", "state"), HELD_VERDICTS, ids=[run for run, _, _ in HELD_VERDICTS])
def test_the_verdict_holds_through_every_break(replayed: Replayed, run: str, verdict: str, state: str) -> None:
    """The rules before read idle in each break and nothing in the evaluation after it."""
    read = replayed.verdicts(run)
    settled = sorted(at for at, found in read.items() if found == {verdict})
    assert settled, f"{run} never read {verdict}: {read}"
    breaks = [at for at in _times_in(run, state) if at > settled[0]]
    assert breaks, f"no {state} break of {run} after its first verdict: the case proves nothing"
    wrong = {_clock(at): sorted(read.get(at, ())) for at in range(settled[0], _last_sample(run) + 1, replayed.interval)
             if read.get(at) != {verdict}}
    assert not wrong, f"{run} read {verdict} from {_clock(settled[0])} but not at {wrong} ({state} at {breaks})"
