"""Writes the report into a temporary directory and moves it into place at the end, so a failed or
interrupted report never leaves a directory that looks complete. A new --out is that directory, made beside
it and renamed. An existing one keeps its inode (it may be a mount point): the directory is made inside it
and its files renamed into it, the earlier page removed first and the new one put back last. A shell sitting
in it (`cd report && stepscope-report ... --out .`), or a server serving it, goes on seeing it, where
replacing the directory left them in a deleted one.

An existing --out is written only when it is empty or an earlier report: its index.html names this
generator and it holds nothing but the files a report writes. Anything else there (the user's notes, a
folder) is left alone with an error: it would sit among the report's files, one of them perhaps replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stepscope.report.page import GENERATOR

MARKER = f'<meta name="generator" content="{GENERATOR}">'
# A report being written inside an existing --out (or one a killed run left there): no file of the user's.
STAGING_PREFIX = ".stepscope-partial-"
SHOWN_ENTRIES = 3  # of what is in the way, named in the error
ABANDONED_SECONDS = 3600.0  # a staging directory untouched this long inside --out is a killed report's
DEFAULT_OUT_PREFIX = "stepscope-report-"
# Of a run's name in the default --out: a directory name is at most 255 bytes (NAME_MAX), and a run 128 characters
# of 4 bytes each; this leaves room for the prefix and the checksum.
MAX_RUN_NAME_BYTES = 200
_NOT_IN_FILE_NAMES = re.compile(r"[^\w.-]+")  # \w: letters and digits of any script, and _


class OutputError(Exception):
    """--out cannot be written; the message is one line."""


def out_directory(text: str) -> Path:
    """--out's value (the report's and the quickstart's): an empty one (a variable that was not set) is refused,
    not taken as the working directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty directory name: give one, or '.' for the working directory")
    return Path(text)


def default_out(run: str) -> Path:
    """`stepscope-report-<run>`: the run's name where it is a safe file name, else what is kept of it (`_` for
    the other characters, cut to MAX_RUN_NAME_BYTES) and the CRC-32 of the whole name. Without the checksum,
    `exp/a` and `exp a` (and every run named in CJK only) shared one directory, and each run's report silently
    replaced the other's."""
    kept = _NOT_IN_FILE_NAMES.sub("_", run).strip(".")
    kept = kept.encode()[:MAX_RUN_NAME_BYTES].decode(errors="ignore")
    if kept != run:
        kept = f"{kept or 'run'}-{zlib.crc32(run.encode()):08x}"
    return Path(DEFAULT_OUT_PREFIX + kept)


def report_files() -> frozenset[str]:
    """The names of the files a report writes. Imported here rather than at the top: the report module
    needs matplotlib, whose absence the command line says in one line before it gets here."""
    from stepscope.report.report import FILES

    return frozenset(FILES)


def is_report(directory: Path) -> bool:
    """Whether `directory` holds an earlier report: its page names this generator."""
    try:
        with (directory / "index.html").open(encoding="utf-8", errors="replace") as page:
            return MARKER in page.read(4096)
    except OSError:
        return False


def foreign_entries(directory: Path) -> list[str]:
    """The entries of `directory` a report does not write (a folder, a link, another file), sorted; a
    folder's name ends with /."""
    ours = report_files()
    with os.scandir(directory) as entries:
        return sorted(f"{entry.name}/" if entry.is_dir(follow_symlinks=False) else entry.name
                      for entry in entries if not (entry.name in ours and entry.is_file(follow_symlinks=False))
                      and not entry.name.startswith(STAGING_PREFIX))


def check(out: Path) -> None:
    """Raises OutputError when `out` holds something that is not an earlier report."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"--out {out} exists and is not a directory")
    with _exclusive(out):
        _check_entries(out)


def _check_entries(out: Path) -> None:
    try:  # a staging directory is a report's own: one a killed report left in an empty --out makes it no other's
        foreign = foreign_entries(out)
        present = sorted(name for name in os.listdir(out) if not name.startswith(STAGING_PREFIX))
    except OSError as exc:
        raise OutputError(f"cannot read --out {out}: {exc.strerror or exc}") from None
    if present and not foreign and not is_report(out):  # a report's files and no page: a move cut short (_publish)
        raise OutputError(f"--out {out} holds a report's files without its page ({_listed(present)}): a report cut "
                          "short as it moved them in; delete them, or choose another directory")
    if present and (foreign or not is_report(out)):
        raise OutputError(f"--out {out} holds files that are not a stepscope report ({_listed(foreign or present)}); "
                          "choose another directory")


def _listed(names: list[str]) -> str:
    """The first SHOWN_ENTRIES names, each on one line (a newline in a name is escaped), and how many more."""
    shown = ", ".join(name if name.isprintable() else ascii(name) for name in names[:SHOWN_ENTRIES])
    more = len(names) - SHOWN_ENTRIES
    return f"{shown} and {more} more" if more > 0 else shown


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Holds an exclusive lock on `directory` for the block, so that reports into one --out check it and move
    their files in one at a time. A report's check made while another's moves were half done (its page removed
    first) found the CSVs without a page and refused them as not a report, and the moves of two reports could
    interleave. Where the filesystem takes no lock (some NFS mounts), the block runs unlocked."""
    try:
        handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # gone, or not a directory: the block's own reads say so
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yields an empty directory next to `out`; puts its files in `out` when the block succeeds and
    removes it when the block fails."""
    check(out)
    try:
        out = out.resolve()  # `.` or `dir/..` has no name to put the staging directory beside
    except OSError as exc:  # a working directory deleted under the shell
        raise OutputError(f"cannot resolve --out {out}: {exc.strerror or exc} (the working directory was "
                          "deleted?)") from None
    try:
        if out.is_dir():  # written in place: staged inside it, so on its filesystem (a mount point's too)
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as exc:
        raise OutputError(f"cannot write --out {out}: {_not_a_folder(out) or exc.strerror or exc}") from None
    try:
        yield staging
        _publish(staging, out)
    except OSError as exc:  # writing or moving the files: a full disk, a directory made read-only
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputError(f"cannot write --out {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _not_a_folder(out: Path) -> str:
    """What mkdir's "File exists" means where a folder above `out` is a file: that file, named; else ""."""
    for parent in out.parents:
        if parent.exists():
            return "" if parent.is_dir() else f"{parent} is a file, not a directory"
    return ""


def _publish(staging: Path, out: Path) -> None:
    if not out.exists():
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; a report directory is an ordinary one
        staging.rename(out)
        return
    with _exclusive(out):
        _publish_in_place(staging, out)


def _publish_in_place(staging: Path, out: Path) -> None:
    # The page goes first and comes back last: a move cut short leaves no page, never the earlier one over
    # this run's CSVs, a directory that would look complete.
    (out / "index.html").unlink(missing_ok=True)
    written = sorted(os.listdir(staging), key=lambda name: name == "index.html")
    for name in written:
        os.replace(staging / name, out / name)
    for name in report_files() - set(written):  # an earlier report's file this one does not write
        (out / name).unlink(missing_ok=True)
    staging.rmdir()
    _remove_abandoned_staging(out)


def _remove_abandoned_staging(out: Path) -> None:
    """Staging directories a killed report (SIGKILL, an OOM, a node going down) left inside `out`: hidden, never
    read, kept for good before. One written to within ABANDONED_SECONDS may be another report's going on."""
    cutoff = time.time() - ABANDONED_SECONDS
    for entry in out.glob(f"{STAGING_PREFIX}*"):
        try:
            if entry.is_dir() and not entry.is_symlink() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:  # gone meanwhile: another report removed it
            continue
