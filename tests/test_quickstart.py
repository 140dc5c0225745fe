"""`stepscope-quickstart` as a newcomer runs it: the exporter, a real Prometheus with the shipped rules,
the demo in two acts, then the report; Ctrl-C at any point leaves no process behind, and without
`prometheus` on PATH it says in one line how to install it.

Its processes are found by a marker in their environment, which every descendant inherits (Prometheus,
the demo, the demo's loader workers), so a process left behind is found whatever it became.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from stepscope_testkit.processes import REPO_ROOT
from tests.support.readme import readme_command, shell_env

pytestmark = pytest.mark.timeout(280)

MARK = "STEPSCOPE_QUICKSTART_TEST_MARK"


def marked_processes(mark: str) -> list[str]:
    """'pid: command line' of every live process whose environment carries the marker `mark`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if f"{MARK}={mark}".encode() in environ:
            found.append(f"{proc.name}: {cmdline}")
    return found


def quickstart_env(tmp_path: Path, mark: str) -> dict[str, str]:
    """An activated venv's shell, the marker, and temporary files under tmp_path."""
    return shell_env({MARK: mark, "TMPDIR": str(tmp_path)})


@pytest.mark.alone  # scripts/test.sh says why
def test_the_readme_quickstart_ends_with_the_report_and_both_verdicts(tmp_path: Path) -> None:
    """The README's command (its report written under tmp_path, not into the checkout): a data-bound act,
    then the fixed one, judged by the shipped rules; the report's path and the verdicts in order; nothing
    left running."""
    mark, out = uuid.uuid4().hex, tmp_path / "report"
    command = f"{readme_command('.venv/bin/stepscope-quickstart')} --out {out}"
    began = time.monotonic()
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO_ROOT,
                            env=quickstart_env(tmp_path, mark), timeout=260)
    print(f"{command}: {time.monotonic() - began:.0f} s\n{result.stdout}")  # shown when the test fails
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"report: {out / 'index.html'}" in lines
    assert (out / "index.html").is_file() and (out / "run_summary.csv").is_file()
    (seen,) = [line.removeprefix("verdicts seen, in order: ") for line in lines if line.startswith("verdicts seen")]
    names = [part.split(" (")[0] for part in seen.split(", ")]
    assert "data_bound" in names and "host_bound" in names, seen
    assert names.index("data_bound") < len(names) - 1 - names[::-1].index("host_bound"), seen  # fixed last
    assert "Traceback" not in result.stderr
    assert marked_processes(mark) == []


# A terminal's foreground job starts with SIGINT at its default. A suite started in the background of a
# non-interactive shell (`cmd &`) runs with SIGINT ignored, which every child inherits through exec, and a
# Python started so never raises KeyboardInterrupt: the quickstart is started as from a terminal.
AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_stopping_it_midway_leaves_no_process_behind(tmp_path: Path, how: str) -> None:
    """Ctrl-C in a terminal is SIGINT to the foreground process group: the quickstart stops what it
    started and exits 130. SIGKILL gives it no chance: its children are told by the kernel (SIGTERM)."""
    mark = uuid.uuid4().hex
    log = tmp_path / "quickstart.log"
    with open(log, "wb") as output:
        quickstart = subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "stepscope.report.quickstart",
                                       "--out", str(tmp_path / "report")], stdout=output, stderr=subprocess.STDOUT,
                                      cwd=REPO_ROOT, env=quickstart_env(tmp_path, mark), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any("stepscope.hooks.demo" in p for p in marked_processes(mark)):  # all three started
            assert quickstart.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        if how == "ctrl-c":
            os.killpg(quickstart.pid, signal.SIGINT)
            assert quickstart.wait(timeout=60) == 130
            text = log.read_text()
            assert "interrupted; stopping what it started" in text and "Traceback" not in text, text
        else:
            quickstart.kill()
            quickstart.wait()
        deadline = time.monotonic() + 30
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked_processes(mark) == []
    finally:
        if quickstart.poll() is None:
            quickstart.kill()
        for process in marked_processes(mark):  # a failed case leaves nothing running for the next tests
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(process.split(":")[0]), signal.SIGKILL)
    assert not (tmp_path / "report").exists()


def test_the_readme_install_line_keeps_the_cpu_torch_installed_before_it() -> None:
    """The README installs the CPU build of torch first, then the extras: resolved here (--dry-run) in the
    test venv, which holds that CPU build, the extras want no other torch and none of PyPI's CUDA wheels."""
    line = readme_command(".venv/bin/pip install '.[exporter,torch,report]'")
    result = subprocess.run(["bash", "-c", line.replace("pip install", "pip install --dry-run", 1)],
                            capture_output=True, text=True, cwd=REPO_ROOT, env=shell_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (would,) = [line for line in result.stdout.splitlines() if line.startswith("Would install")]
    assert "stepscope-" in would and "torch" not in would and "nvidia" not in would, would


def test_without_prometheus_it_says_how_to_install_it(tmp_path: Path) -> None:
    """One line naming the package and the command, exit 2, before anything starts."""
    result = subprocess.run([sys.executable, "-m", "stepscope.report.quickstart", "--out", str(tmp_path / "r")],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                            env={**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "sudo apt-get install prometheus" in result.stderr, result.stderr
    assert not (tmp_path / "r").exists()


def test_an_out_directory_holding_other_files_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """As stepscope-report refuses it: one line, exit 2, the directory left as it was, no process started."""
    mark = uuid.uuid4().hex
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = subprocess.run([sys.executable, "-m", "stepscope.report.quickstart", "--out", str(tmp_path / "mine")],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                            env=quickstart_env(tmp_path, mark))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "holds files that are not a stepscope report" in result.stderr
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"] and marked_processes(mark) == []



@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary")
def test_a_rule_file_prometheus_refuses_is_named_with_its_error(tmp_path: Path) -> None:
    """--rules with a rule that does not parse: the error was Prometheus's last log line, 'error loading config
    from \"/tmp/stepscope-quickstart-.../prometheus.yml\": one or more errors occurred ...', naming a file the
    user never wrote and not the rule file; it is now Prometheus's first error, which names both."""
    from stepscope.report import quickstart

    rules = tmp_path / "my rules" / "x.rules.yml"
    rules.parent.mkdir()
    rules.write_text("groups:\n- name: x\n  rules:\n  - record: a\n    expr: sum(\n")
    children = quickstart.Children(tmp_path)
    setup = quickstart.Setup(shutil.which("prometheus"), [rules], tmp_path / "out")
    try:
        with pytest.raises(quickstart.QuickstartError) as failed:
            quickstart.start_prometheus(children, setup, "http://127.0.0.1:9")
    finally:
        children.stop_all()
    assert str(failed.value).startswith("prometheus exited with code 1: ")
    assert str(rules) in str(failed.value) and "unclosed left parenthesis" in str(failed.value)


def test_an_empty_out_is_refused_not_taken_for_the_working_directory(capsys: pytest.CaptureFixture[str]) -> None:
    """`--out "$DIR"` with DIR unset: as stepscope-report refuses it. Before, it was the working directory: the
    report went there when it was empty (in the checkout, it said the checkout was not a report)."""
    from stepscope.report import quickstart

    with pytest.raises(SystemExit) as exited:
        quickstart.parse_args(["--out", ""])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("stepscope-quickstart: error: argument --out: an empty "
                                                        "directory name: give one, or '.' for the working directory")


def _quickstart_whose_report_returns(code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """The quickstart with its acts skipped and a report that returns `code` (the report answers Ctrl-C
    and SIGTERM while it writes with 130 itself), temporary files under tmp_path."""
    from stepscope.report import cli, quickstart

    monkeypatch.setattr(quickstart.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cli, "main", lambda argv: code)
    monkeypatch.setattr(quickstart, "quickstart", lambda setup, children: quickstart.report(
        "http://127.0.0.1:9", setup.out, children.workdir))
    monkeypatch.chdir(REPO_ROOT)
    try:
        return quickstart.main(["--out", str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_ctrl_c_while_the_report_is_written_is_an_interruption_exit_130(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _quickstart_whose_report_returns(130, tmp_path, monkeypatch) == 130
    assert capsys.readouterr().err.strip() == "stepscope-quickstart: interrupted; stopping what it started"
    assert list(tmp_path.glob("stepscope-quickstart-*")) == []  # nothing failed: its logs go


def test_a_failed_report_names_the_directory_its_logs_are_kept_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _quickstart_whose_report_returns(2, tmp_path, monkeypatch) == 1
    [kept] = tmp_path.glob("stepscope-quickstart-*")
    assert capsys.readouterr().err.strip() == ("stepscope-quickstart: error: the report failed (its reason is "
                                               f"above); the logs are kept in {kept}")
