"""How every benchmark reports: the machine and its load in the header, titled sections, one file.

Tables from different runs are only comparable when each says where and under what load it ran, so
the header is written the same way by every benchmark rather than typed again in each.
"""

import os
import platform
from pathlib import Path


def machine(*software: str) -> str:
    """'Python 3.11.7, torch 2.13.0, 2 CPUs (x86_64)': the interpreter, the given software, the CPUs."""
    return ", ".join([f"Python {platform.python_version()}", *software,
                      f"{os.cpu_count()} CPUs ({platform.machine()})"])


def load_average() -> str:
    """The 1-minute load average now: benchmarks run on a shared machine, and their tables say so."""
    return f"load average {os.getloadavg()[0]:.1f}"


def sections(parts: list[tuple[str, str]]) -> str:
    """Titled sections of a results file, each a second-level heading and its body."""
    return "".join(f"\n## {title}\n\n{body}\n" for title, body in parts)


def publish(path: Path, text: str) -> None:
    """Prints the results and writes them to `path` (benchmarks/results/…), creating the folder."""
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
