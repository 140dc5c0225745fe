"""The commands the README and the reference pages under docs/ show, read from their ```bash blocks, a
way to run one as a user would, and the pages' marked sections (`<!-- section: NAME -->`), wherever a
section lives."""

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from stepscope_testkit.processes import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
VENV_BIN = Path(sys.executable).parent  # `python`, `torchrun`, `stepscope-*` as an activated venv has them


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of every ```bash block: continuation lines joined, comments and blank lines dropped."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            command = _strip_comment(line).strip()
            if command:
                commands.append(" ".join(command.split()))
    return commands


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (the README quotes no `#`)."""
    return "" if line.lstrip().startswith("#") else re.split(r"\s#", line, maxsplit=1)[0]


def documents() -> list[Path]:
    """The README, then every reference page (docs/*.md), in a fixed order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def documented_commands() -> list[str]:
    """Every command of the README and the reference pages, each once (a page may repeat the guide's)."""
    return list(dict.fromkeys(c for path in documents() for c in readme_commands(path.read_text())))


def readme_command(prefix: str) -> str:
    """The one command starting with `prefix` that the README or a reference page shows."""
    (command,) = [c for c in documented_commands() if c.startswith(prefix)]
    return command


def doc_section(name: str) -> str:
    """The text between `<!-- section: name -->` and its end marker, in whichever page holds it."""
    begin, end = f"<!-- section: {name} -->", f"<!-- /section: {name} -->"
    (text,) = [t for t in (path.read_text() for path in documents()) if begin in t]
    return text[text.index(begin):text.index(end)]


def shell_env(extra: Mapping[str, str] | None = None, bin_dir: Path = VENV_BIN) -> dict[str, str]:
    """The environment of a shell whose venv is activated, with the checkout importable."""
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT),
            "OMP_NUM_THREADS": "1", **(extra or {})}


def start_shell(command: str, log: Path, env: Mapping[str, str], cwd: Path = REPO_ROOT) -> subprocess.Popen:
    """`bash -c command` in its own session (so a stop reaches every process it started)."""
    with open(log, "wb") as out:
        return subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                cwd=cwd, start_new_session=True)


def stop_shells(shells: Mapping[str, subprocess.Popen]) -> None:
    """SIGTERM to each shell's whole session (a demo, torchrun and its workers), SIGKILL after 15 s."""
    for shell in shells.values():
        if shell.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGTERM)
    for shell in shells.values():
        try:
            shell.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
