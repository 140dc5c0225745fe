"""`stepscope-report`: the command line. Bad input, an unreachable Prometheus (or a server answering its API
in another shape) and a run or range without data end with one line on stderr and exit code 2; Ctrl-C and
SIGTERM with one line and exit code 130. The output directory then stays as it was.
"""

from __future__ import annotations

import argparse
import math
import shlex
import signal
import sys
import time
import urllib.parse
from collections.abc import Sequence

from stepscope.contract import IDLE_STATE, TRAINING_INFO, TRAINING_STATE, selector
from stepscope.contract.recordings import RUN_SAMPLES_RATE
from stepscope.report import output
from stepscope.report.prometheus import Prometheus, PrometheusError, Series
from stepscope.report.queries import pushed_at
from stepscope.report.summary import missing_ranks
from stepscope.report.timeline import LOST_SECONDS
from stepscope.report.times import iso, parse_time
from stepscope.report.window import (
    SCRAPE_INTERVAL_MAX_SECONDS,
    SEARCH_DAYS,
    NoData,
    Window,
    aligned,
    resolution,
    run_life,
    run_matcher,
    runs_seen,
)

PROG = "stepscope-report"
IDLE_TAIL_SECONDS = 60  # at most, kept after the last rank went idle (a tenth of the run): the end shows
MIN_STEP = 0.001  # seconds: the report writes the step in PromQL as whole milliseconds
RECORDING_LAG_SECONDS = 300  # after the window, where a short run's first recordings may still land
RUN_EDGE_SCRAPES = 2  # --from/--to farther than this many scrapes outside the run's samples is cut to them
LISTED_RUNS = 20  # runs a message names; it counts the others
_SHORT_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}  # as bash's $'...' reads them
MAX_TIMEOUT_SECONDS = 86400  # a socket cannot wait past about 9.2e9 s: 1e10 ended in an OverflowError traceback


class UsageError(Exception):
    """A problem with the request; the message is one line."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A training run's report from Prometheus: index.html (verdict, plots, Gantt chart of "
                    "rank states, tables) and CSVs.",
        epilog="Times: RFC 3339 (2024-05-01T12:00:00Z; no zone = UTC), Unix seconds, now, now-2h. "
               f"Without --from/--to the run's whole life in the last {SEARCH_DAYS} days; without --run "
               "the runs seen are listed (exit 2).",
    )
    parser.add_argument("--prometheus", default="http://localhost:9090", metavar="URL",
                        help="Prometheus base URL (default: http://localhost:9090)")
    parser.add_argument("--run", help="the run (label `run`) to report on")
    parser.add_argument("--from", dest="start", metavar="T",
                        help="window start (default: the run's start: its first sample, or its processes' start "
                             "just before it, where the step counts start)")
    parser.add_argument("--to", dest="end", metavar="T", help="window end (default: the run's end)")
    parser.add_argument("--out", type=output.out_directory, metavar="DIR",
                        help="directory for index.html and the CSVs (default: stepscope-report-RUN); replaced "
                             "when it holds an earlier report")
    parser.add_argument("--step", type=float, metavar="SECONDS",
                        help="resolution of series over time, a millisecond or more and at most the run's "
                             "window (default: the scrape interval, coarser for long windows: at most 1200 "
                             "points)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help=f"per query, at most {MAX_TIMEOUT_SECONDS} (default: 60)")
    args = parser.parse_args(argv)
    problem = _base_url_problem(args.prometheus)
    if problem:
        parser.error(f"--prometheus must be {problem}, got {args.prometheus!r}")
    for name in ("step", "timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name} must be > 0, got {value:g}")
    if not args.timeout <= MAX_TIMEOUT_SECONDS:
        parser.error(f"--timeout must be at most {MAX_TIMEOUT_SECONDS} seconds, got {args.timeout:g}")
    if args.step is not None and not MIN_STEP <= args.step < math.inf:
        parser.error(f"--step must be at least {MIN_STEP:g} (PromQL durations are whole milliseconds), "
                     f"got {args.step:g}")
    if args.step is not None:
        args.step = round(args.step, 3)  # the step every query and sum uses, as PromQL writes it
    return args


def _base_url_problem(url: str) -> str:
    """What keeps `url` from being a base URL the API paths are appended to ('' when nothing does): without a
    scheme the HTTP client fails with its own words, and a ?query or #fragment would end up before the path.
    An unclosed IPv6 bracket (http://[::1:9090) or a port past 65535 ended in a ValueError traceback."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (urlsplit checks the port only when it is read)
    except ValueError as exc:
        return f"a well-formed URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "an http:// or https:// URL (http://prometheus:9090)"
    if parts.query or parts.fragment:
        return "a base URL without ?query or #fragment (a path prefix works: http://host/prometheus)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _report(args)
    except (UsageError, NoData, PrometheusError, output.OutputError) as exc:
        print(f"{PROG}: error: {exc}{_step_hint(args, exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing written", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


# What Prometheus (11,000) and VictoriaMetrics (-search.maxPointsPerTimeseries) say of a range query with too many
# points: the message names their `?step=`, which the user gave as --step.
TOO_MANY_POINTS = ("exceeded maximum resolution", "maxPointsPerTimeseries")


def _step_hint(args: argparse.Namespace, exc: Exception) -> str:
    if not (args.step and isinstance(exc, PrometheusError) and any(text in str(exc) for text in TOO_MANY_POINTS)):
        return ""
    return f" (--step {args.step:g} asks for more points than the server gives: give a larger --step or leave it out)"


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (`timeout`, a cancelled CI job, `kill`) ends the report as Ctrl-C does, its half-written files
    removed: Python's default ended it on the spot and left them in a hidden .OUT.*.partial directory."""
    raise KeyboardInterrupt


def _report(args: argparse.Namespace) -> int:
    try:
        from stepscope.report import report
    except ImportError as exc:
        raise UsageError(f"the report needs matplotlib ({exc.name} is missing): pip install matplotlib "
                         "(in a checkout of stepscope: pip install '.[report]')") from None
    now = time.time()
    start, end = _requested(args, now)
    prom = Prometheus(args.prometheus, timeout=args.timeout)
    if args.run is None:
        _list_runs(prom, start, end)
    out = args.out or output.default_out(args.run)
    output.check(out)
    window, nodes = _window(prom, args, now)
    from stepscope.report.collect import fetch

    data = fetch(prom, args.run, window, nodes)
    # the samples rate, not the verdict: the rules give no verdict in a run's first seconds of training
    sparse = _too_sparse(window)
    if data.totals["steps"] and not data.over_time["run_samples_rate"] and not _recorded(prom, args.run, window):
        cause = sparse or "load the rule files of grafana/rules_out/ into Prometheus"
        raise UsageError(f"Prometheus holds run {args.run!r} but none of stepscope's recording rules "
                         f"({RUN_SAMPLES_RATE}): {cause}")
    built = report.build(data, prom.shown_url)
    with output.staged(out) as staging:
        files = report.write(built, staging)
    print(f"{out / 'index.html'} and {len(files) - 1} CSVs for run {args.run} from {iso(window.start)} to "
          f"{iso(window.end)}: {built.assessment.headline}")
    missing = missing_ranks(data)
    if missing is not None:
        print(f"{PROG}: warning: {missing.words}: the report counts the other ranks only", file=sys.stderr)
    if sparse:
        print(f"{PROG}: warning: {sparse}; the verdict, shares and straggler scores may be missing", file=sys.stderr)
    return 0


def _too_sparse(window: Window) -> str:
    """Why the rules could not record the run, where its exporter was scraped less often than they need (their 1m
    windows hold one sample or none): at 60 s, Prometheus recorded nothing and the report told the user to load
    rules that were loaded; VictoriaMetrics recorded rates but no verdict, which read "No verdict yet". Empty
    where the interval serves them."""
    if not window.scraped_too_rarely:
        return ""
    return (f"its exporter was scraped every {window.scrape_interval:.0f} s, and the rules' 1m windows need a scrape "
            f"at least every {SCRAPE_INTERVAL_MAX_SECONDS:g} s: set the stepscope job's "
            "scrape_interval to 15s (docs/deployment.md)")


def _recorded(prom: Prometheus, run: str, window: Window) -> bool:
    """Whether the rules recorded the run at all, where the report's points found none: in the window or
    in the minutes after it, as the rules of a run of a few seconds record it an evaluation or two after
    its last push, outside a window cut to the run (they load, the run is just short)."""
    span = f"{max(1, round((window.seconds + RECORDING_LAG_SECONDS) * 1000))}ms"
    recorded = f"count_over_time({selector(RUN_SAMPLES_RATE, run_matcher(run))}[{span}])"
    return bool(prom.query(recorded, window.end + RECORDING_LAG_SECONDS))


def _requested(args: argparse.Namespace, now: float) -> tuple[float, float]:
    try:
        start = parse_time(args.start, now) if args.start else now - SEARCH_DAYS * 86400
        end = parse_time(args.end, now) if args.end else now
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if start >= end:
        raise UsageError(f"--from ({iso(start)}) must be before --to ({iso(end)})")
    return start, end


def _list_runs(prom: Prometheus, start: float, end: float) -> None:
    seen = runs_seen(prom, start, end)
    if not seen:
        raise NoData(f"no run pushed training metrics between {iso(start)} and {iso(end)} "
                     "(is Prometheus scraping the stepscope exporter?)")
    listing = _at_most_listed([f"{shell_word(s.run)} ({s.ranks} rank{'s' * (s.ranks != 1)} on {', '.join(s.nodes)})"
                               for s in seen], "; ")
    raise UsageError(f"--run is required; runs seen between {iso(start)} and {iso(end)}: {listing}")


def runs_listed(runs: Sequence[str]) -> str:
    """Run names as a message lists them: each as a shell writes it for --run (`shell_word`). Listed as they are,
    `exp1 ` (a trailing space from an env file) read as `exp1`, which --run then did not find, and a run named
    `lr=1e-3, bs=64` as two runs."""
    return _at_most_listed([shell_word(run) for run in runs], ", ")


def _at_most_listed(items: Sequence[str], separator: str) -> str:
    """The first LISTED_RUNS items and how many more: a Prometheus of 50,000 runs made a 1.7 MB error line."""
    more = len(items) - LISTED_RUNS
    shown = separator.join(items[:LISTED_RUNS])
    return f"{shown}{separator}and {more} more (narrow them with --from/--to)" if more > 0 else shown


def shell_word(run: str) -> str:
    """`run` as a shell writes it for --run: shlex.quote, or bash's $'...' where it holds a character no terminal
    shows as itself (a line end, an escape): Prometheus stores any label value, and a run pushed through a stock
    Pushgateway named "a\\n\\x1b[31m" split the one-line error and turned the terminal red."""
    if run.isprintable():
        return shlex.quote(run)
    return "$'" + "".join(_ansi_c(char) for char in run) + "'"


def _ansi_c(char: str) -> str:
    """One character inside bash's $'...'."""
    if char in "\\'":
        return "\\" + char
    if char.isprintable():
        return char
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _window(prom: Prometheus, args: argparse.Namespace, now: float) -> tuple[Window, list[str]]:
    """The report's window: --from/--to where they lie inside the run, else the run's life (its idle tail
    cut to a minute)."""
    start, end = _requested(args, now)
    try:
        first, last, scrape_interval = run_life(prom, args.run, start, end)
    except NoData:
        known = [s.run for s in runs_seen(prom, now - SEARCH_DAYS * 86400, now)]
        if args.run in known:
            raise NoData(f"run {args.run!r} has no samples between {iso(start)} and {iso(end)}") from None
        hint = f"runs seen in the last {SEARCH_DAYS} days: {runs_listed(known)}" if known else "no run seen at all"
        raise NoData(f"no data for run {args.run!r} ({hint})") from None
    start = first if _past_the_run(bool(args.start), first - start, scrape_interval) else start
    to_run_end = _past_the_run(bool(args.end), end - last, scrape_interval)
    end = last if to_run_end else end
    default_step = resolution(start, end, scrape_interval)
    last_active = _last_active(prom, args.run, start, end, default_step) if to_run_end else None
    life = (last_active if last_active is not None else end) - start  # the run's, not its idle tail's
    if args.step and args.step > max(life, scrape_interval):
        raise UsageError(f"--step {args.step:g} is longer than the window ({life:g} s from {iso(start)}): "
                         "its points would fall outside the run; give a shorter --step or leave it out")
    step = args.step or default_step
    if last_active is not None:
        end = _idle_tail_cut(start, end, last_active, step)
    window = aligned(start, max(end, start + step), step, scrape_interval)
    nodes = sorted({labels.get("instance", "") for labels in
                    prom.series(selector(TRAINING_INFO, run_matcher(args.run)), window.start, window.end)})
    return window, nodes


def _past_the_run(given: bool, gap: float, scrape_interval: float) -> bool:
    """Whether the window's edge is the run's own: --from (--to) not given, or more than RUN_EDGE_SCRAPES
    scrapes before its first (after its last) sample, `gap` seconds away. A window far wider than the run
    would otherwise get a resolution far coarser than the run (a day for a minute of training: a point per
    2 minutes), whose points miss the rules' recordings of it: no verdict, no shares."""
    return not given or gap > RUN_EDGE_SCRAPES * scrape_interval


def _last_active(prom: Prometheus, run: str, start: float, end: float, step: float) -> float | None:
    """When the run last did something (see _last_activity), None where no rank was seen out of idle. A
    finished run's group stays on the exporter until its TTL, in state idle, or in its last state for a rank
    that died without closing (lost)."""
    busy = prom.query_range(_not_idle_pushes(run), start, end, step)
    pushes = {_rank(series): series for series in
              prom.query_range(pushed_at(run_matcher(run)), start, end, step)}
    return max((_last_activity(series, pushes.get(_rank(series))) for series in busy if series.points),
               default=None)


def _idle_tail_cut(start: float, end: float, last_active: float, step: float) -> float:
    """The window's end shortly after the run's last activity: a tenth of the run, at most a minute, at least
    two points."""
    return min(end, last_active + max(2 * step, min(IDLE_TAIL_SECONDS, 0.1 * (last_active - start))))


def _not_idle_pushes(run: str) -> str:
    """Per rank, its last push's time at each time it was not idle."""
    not_idle = f'{run_matcher(run)},state!="{IDLE_STATE}"'
    return f"({pushed_at(run_matcher(run))}) and on (run, rank, instance) ({selector(TRAINING_STATE, not_idle)} == 1)"


def _rank(series: Series) -> tuple[str, str]:
    return series.labels.get("rank", ""), series.labels.get("instance", "")


def _last_activity(busy: Series, pushes: Series | None) -> float:
    """When a rank last did something: where its first push after the last one seen while it was not idle is
    first seen (its final push, going idle, which carries its last steps' counts); without one, the last time it
    was seen not idle, or where it was first seen lost when its last push was more than LOST_SECONDS before
    that (the exporter kept its last state, the rank was gone: the window then shows it lost, as the timeline
    and the page name it, not in its last state to the end). A rank whose pushes stopped landing for a minute
    on a loaded machine looked lost, and the window ended before its final push was scraped: 2,000 steps of
    2,600 counted."""
    t, push = busy.points[-1]
    later = (at for at, pushed in (pushes.points if pushes is not None else ()) if at > t and pushed > push)
    if t - push <= LOST_SECONDS:
        return next(later, t)
    return next(later, next(at for at, pushed in busy.points if pushed == push and at - pushed > LOST_SECONDS))
