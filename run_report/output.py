"""Writes the report into a temporary directory beside --out and renames it into place at the end, so
a failed or interrupted report never leaves a directory that looks complete.

An existing --out is replaced only when it is empty or an earlier report (its index.html names this
generator); anything else there is left alone with an error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stepscope.report.page import GENERATOR

MARKER = f'<meta name="generator" content="{GENERATOR}">'


class OutputError(Exception):
    """--out cannot be written; the message is one line."""


def is_report(directory: Path) -> bool:
    try:
        with (directory / "index.html").open(encoding="utf-8", errors="replace") as page:
            return MARKER in page.read(4096)
    except OSError:
        return False


def check(out: Path) -> None:
    """Raises OutputError when `out` holds something that is not an earlier report."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"--out {out} exists and is not a directory")
    if any(out.iterdir()) and not is_report(out):
        raise OutputError(f"--out {out} holds files that are not a stepscope report; choose another directory")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yields an empty directory next to `out`; replaces `out` with it when the block succeeds and
    removes it when the block fails."""
    check(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as exc:
        raise OutputError(f"cannot write next to --out {out}: {exc.strerror or exc}") from None
    try:
        yield staging
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, out: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; a report directory is an ordinary one
    if not out.exists():
        staging.rename(out)
        return
    previous = out.with_name(f".{out.name}.previous-{os.getpid()}")
    out.rename(previous)
    staging.rename(out)
    shutil.rmtree(previous, ignore_errors=True)
