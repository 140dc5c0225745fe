"""`stepscope-quickstart`: the whole path from a training loop to its verdict and report, on one machine,
without Docker and without a GPU, in about two minutes.

It starts the exporter, a real Prometheus (the `prometheus` binary on PATH) loading the shipped rule
files, and the demo training of run `quickstart` in two acts: a loader that sleeps 50 ms per batch
(data-bound), then the same loader in 4 worker processes (the usual fix). Each act lasts until the rules
have judged it (they judge a run after 30 s of training), then the run report is written, and its path
and the verdicts Prometheus recorded are printed. Each process it starts runs in a session of its own
(Ctrl-C in the terminal reaches only this one) and is stopped on the way out, whatever the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import NoReturn

import requests

from stepscope.contract import STEPS_TOTAL, selector
from stepscope.contract import verdicts as v
from stepscope.contract.recordings import RUN_DATALOADER_SHARE, RUN_VERDICT
from stepscope.report.output import out_directory
from stepscope.report.prometheus import Prometheus, PrometheusError
from stepscope.report.window import run_matcher

PROG = "stepscope-quickstart"
RUN = "quickstart"
RULES = Path("grafana") / "rules_out"  # in the checkout, where `python -m grafana generate` writes them
INSTALL_PROMETHEUS = "sudo apt-get install prometheus"
INSTALL_EXTRAS = ("pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU build), then "
                  "pip install '.[exporter,torch,report]'")
NEEDED_MODULES = {"h11": "the exporter", "torch": "the demo training", "matplotlib": "the report"}
DEMO = ("--run", RUN, "--slow-loader", "0.05", "--extra-step-seconds", "0.03", "--push-interval", "1")
ACTS = (  # (what it shows, demo flags on top of DEMO, the verdict that ends it)
    ("act 1, data-bound: the loader sleeps 50 ms per batch", (), v.DATA_BOUND),
    ("act 2, fixed: the same loader in 4 worker processes (--loader-workers 4)", ("--loader-workers", "4"),
     v.HOST_BOUND),  # a CPU run: host time is its work (a model that keeps a GPU busy would read gpu_bound)
)
HOLD_SECONDS = 10  # an act ends once its verdict has held this long
ACT_LIMIT_SECONDS = 100  # or after this long, verdict or not (the rules need ~35 s)
PROGRESS_SECONDS = 10
STOP_SECONDS = 10  # SIGTERM, then SIGKILL after this long
PR_SET_PDEATHSIG = 1
INTERRUPTED = 130  # the exit code of Ctrl-C or SIGTERM, the report's and the quickstart's


class QuickstartError(Exception):
    """Something it needs is missing or a process it started failed; the message is one line."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path

    def check(self) -> None:
        """Raises QuickstartError with the line of its log that says why, when the process ended by itself."""
        code = self.process.poll()
        if code is not None:
            raise QuickstartError(f"{self.name} exited with code {code}: {self._cause()} (log: {self.log})")

    def _cause(self) -> str:
        """Prometheus's first error (what it failed on: a rule file and its parse error), as its last one only
        says that loading its configuration failed and names the quickstart's own prometheus.yml; else the last
        line (the exporter's one-line error)."""
        lines = self.log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
        return next((line for line in lines if "level=error" in line), lines[-1])


@dataclass
class Children:
    """The processes started, each the leader of its own session; stop() ends every one."""

    workdir: Path
    running: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str]) -> Child:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=_die_with_parent)
        child = Child(name, process, log)
        self.running.append(child)
        return child

    def stop(self, child: Child) -> None:
        """SIGTERM to the child's whole session (the demo's loader workers too), SIGKILL when it lingers."""
        _signal_group(child.process, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=STOP_SECONDS)
        _signal_group(child.process, signal.SIGKILL)  # what is left of the session (workers), if anything
        child.process.wait()
        if child in self.running:
            self.running.remove(child)

    def stop_all(self) -> None:
        for child in reversed(self.running[:]):  # the demo first: it pushes its last state to the exporter
            self.stop(child)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when this process dies without stopping it (a SIGKILL)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class Setup:
    prometheus: str
    rules: list[Path]
    out: Path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     allow_abbrev=False)
    parser.add_argument("--out", type=out_directory, default=Path(f"stepscope-report-{RUN}"), metavar="DIR",
                        help=f"the report's directory (default: stepscope-report-{RUN})")
    parser.add_argument("--rules", type=Path, default=None, metavar="DIR",
                        help=f"the rule files to load (default: {RULES} of the working directory, else the checkout's)")
    return parser.parse_args(argv)


def preflight(args: argparse.Namespace) -> Setup:
    """Everything that can be known missing before a process starts."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise QuickstartError(f"prometheus is not on PATH: install it ({INSTALL_PROMETHEUS} on Debian and "
                              "Ubuntu) or put the binary from prometheus.io on PATH")
    missing = [f"{module} ({what})" for module, what in NEEDED_MODULES.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        raise QuickstartError(f"missing {', '.join(missing)}: in the checkout, {INSTALL_EXTRAS}")
    rules_dir = args.rules or _checkout_rules()
    rules = sorted(rules_dir.glob("*.rules.yml"))
    if not rules:
        raise QuickstartError(f"no *.rules.yml in {rules_dir}: run it from the stepscope checkout or pass --rules")
    from stepscope.report import output

    try:
        output.check(args.out)
    except output.OutputError as exc:
        raise QuickstartError(str(exc)) from None
    return Setup(prometheus, rules, args.out)


def _checkout_rules() -> Path:
    """The working directory's grafana/rules_out, else the one of the checkout this module runs from."""
    here = Path.cwd() / RULES
    source = Path(__file__).resolve().parents[1] / RULES
    return here if here.is_dir() or not source.is_dir() else source


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, child: Child, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child.check()
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).ok:
                return
        time.sleep(0.2)
    raise QuickstartError(f"{child.name} did not answer {url} within {timeout:g} s (log: {child.log})")


def start_exporter(children: Children) -> str:
    port = free_port()
    exporter = children.start("exporter", [sys.executable, "-m", "stepscope.exporter",
                                           "--web.listen-address", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/-/ready", exporter)
    return url


def start_prometheus(children: Children, setup: Setup, exporter_url: str) -> str:
    """Prometheus scraping the exporter every second and evaluating the rules every second (the shipped
    stacks use 15 s; the rules' 1-minute windows and the 30 s before a verdict are the same)."""
    config = children.workdir / "prometheus.yml"
    target = exporter_url.removeprefix("http://")
    config.write_text(json.dumps({  # JSON is YAML: no quoting to get wrong in paths or the host name
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path.resolve()) for path in setup.rules],
        "scrape_configs": [{"job_name": "stepscope", "static_configs": [
            {"targets": [target], "labels": {"instance": socket.gethostname()}}]}],
    }))
    port = free_port()
    prometheus = children.start("prometheus", [
        setup.prometheus, f"--config.file={config}", f"--storage.tsdb.path={children.workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/-/ready", prometheus)
    return url


def _value(prom: Prometheus, expr: str) -> float | None:
    found = prom.query(expr, time.time())
    return found[0].last if found else None


def current_verdict(prom: Prometheus) -> str | None:
    found = prom.query(f"{selector(RUN_VERDICT, run_matcher(RUN))} == 1", time.time())
    return found[0].labels.get("verdict") if found else None


def progress(prom: Prometheus, seconds: float, verdict: str | None) -> str:
    steps = _value(prom, f"sum({selector(STEPS_TOTAL, run_matcher(RUN))})")
    share = _value(prom, selector(RUN_DATALOADER_SHARE, run_matcher(RUN)))
    parts = [f"  {seconds:3.0f} s", f"{steps or 0:,.0f} steps"]
    if share is not None:
        parts.append(f"waiting for data {share:.0%} of the step")
    parts.append(f"verdict {verdict}" if verdict else "no verdict yet (the rules judge a run after 30 s of training)")
    return ", ".join(parts)


def act(children: Children, prom: Prometheus, exporter_url: str, title: str, flags: Sequence[str],
        wanted: str) -> None:
    """Trains until the rules' verdict has been `wanted` for HOLD_SECONDS (or ACT_LIMIT_SECONDS pass)."""
    argv = [sys.executable, "-m", "stepscope.hooks.demo", *DEMO, *flags, "--push-url", exporter_url]
    print(f"{title}\n  {' '.join(['python', *argv[1:]])}", flush=True)
    demo = children.start("demo", argv)
    began = time.monotonic()
    held_since: float | None = None
    shown, said = began, None
    while time.monotonic() - began < ACT_LIMIT_SECONDS:
        time.sleep(1)
        demo.check()
        verdict, now = current_verdict(prom), time.monotonic()
        if verdict != said or now - shown >= PROGRESS_SECONDS:
            print(progress(prom, now - began, verdict), flush=True)
            shown, said = now, verdict
        held_since = (held_since or now) if verdict == wanted else None
        if held_since is not None and now - held_since >= HOLD_SECONDS:
            break
    else:
        print(f"  no {wanted} verdict after {ACT_LIMIT_SECONDS} s; going on", flush=True)
    children.stop(demo)  # SIGTERM: the hooks push state idle on the way out


def verdicts_seen(prom: Prometheus, start: float) -> list[tuple[str, float]]:
    """The run's verdicts in order, each with how long it held, from Prometheus's recorded rule."""
    found = prom.query_range(f"{selector(RUN_VERDICT, run_matcher(RUN))} == 1", start, time.time(), 1)
    at = sorted((t, series.labels.get("verdict", "?")) for series in found for t, _ in series.points)
    seen: list[tuple[str, float]] = []
    for _, verdict in at:  # a point a second
        held = seen.pop()[1] if seen and seen[-1][0] == verdict else 0
        seen.append((verdict, held + 1))
    return seen


def report(prom_url: str, out: Path, logs: Path) -> None:
    """The report of the run. The report catches Ctrl-C (and the SIGTERM that _interrupt turns into one)
    itself and returns 130: that is the user's interruption, not a failure, so it is raised on as one."""
    from stepscope.report.cli import main as report_main

    code = report_main(["--prometheus", prom_url, "--run", RUN, "--out", str(out)])
    if code == INTERRUPTED:
        raise KeyboardInterrupt
    if code != 0:
        raise QuickstartError(f"the report failed (its reason is above); the logs are kept in {logs}")


def quickstart(setup: Setup, children: Children) -> None:
    exporter_url = start_exporter(children)
    prom_url = start_prometheus(children, setup, exporter_url)
    print(f"{PROG}: exporter {exporter_url}/metrics, Prometheus {prom_url} with "
          f"{', '.join(str(path) for path in setup.rules)}; run {RUN!r}", flush=True)
    prom = Prometheus(prom_url, timeout=10)
    start = time.time()
    for title, flags, wanted in ACTS:
        act(children, prom, exporter_url, title, flags, wanted)
    time.sleep(2)  # two scrapes: Prometheus holds the last push (state idle), where the report ends the run
    report(prom_url, setup.out, children.workdir)
    print(f"report: {(setup.out / 'index.html').resolve()}")
    seen = verdicts_seen(prom, start)
    print("verdicts seen, in order: " + (", ".join(f"{name} ({seconds:.0f} s)" for name, seconds in seen)
                                         or "none"))


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup = preflight(args)
    except QuickstartError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, a closed terminal: stop the children as Ctrl-C does
    children = Children(Path(tempfile.mkdtemp(prefix=f"{PROG}-")))
    failed = False
    try:
        quickstart(setup, children)
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; stopping what it started", file=sys.stderr)
        return INTERRUPTED
    except (QuickstartError, PrometheusError) as exc:
        failed = True
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the stopping short
            signal.signal(signum, signal.SIG_IGN)
        children.stop_all()
        if not failed:
            shutil.rmtree(children.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
