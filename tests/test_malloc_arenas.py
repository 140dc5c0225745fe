"""The exporter caps glibc's malloc arenas at one before its threads start (issue 20: RSS)."""

import ctypes
import os
import subprocess
import sys

import pytest

from stepscope_testkit.processes import REPO_ROOT

try:
    HAS_MALLOC_INFO = hasattr(ctypes.CDLL(None), "malloc_info")
except OSError:
    HAS_MALLOC_INFO = False
glibc_only = pytest.mark.skipif(not HAS_MALLOC_INFO, reason="glibc's malloc_info counts the arenas")

# Four threads allocate through malloc (bytes objects over 512 B bypass pymalloc), then glibc lists its heaps.
THREADS_ALLOCATE = """
import ctypes, sys, threading
from stepscope.exporter.malloc_arenas import cap_malloc_arenas
print(cap_malloc_arenas() if sys.argv[1] == "capped" else "uncapped")
kept, ready, hold = [], threading.Barrier(5), threading.Event()
def allocate():
    kept.append([bytes(4096) for _ in range(64)])
    ready.wait()
    hold.wait()
threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
ready.wait()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
stream = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(stream))
libc.fclose(ctypes.c_void_p(stream))
hold.set()
"""


def heaps(tmp_path, mode: str, **env: str) -> tuple[str, int]:
    """(what cap_malloc_arenas returned, glibc's heaps) in a child whose environment sets no arena count but env."""
    out = tmp_path / f"{mode}.xml"
    clean = {key: value for key, value in os.environ.items() if key not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", THREADS_ALLOCATE, mode, str(out)], capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(REPO_ROOT), **env}, timeout=60, check=True)
    return done.stdout.strip(), out.read_text().count("<heap nr=")


@glibc_only
def test_one_arena_serves_every_thread_unless_the_environment_sets_a_count(tmp_path) -> None:
    assert heaps(tmp_path, "capped") == ("True", 1)
    assert heaps(tmp_path, "uncapped")[1] > 1  # each thread that allocates gets an arena of its own
    assert heaps(tmp_path, "capped", MALLOC_ARENA_MAX="4") == ("False", 4)  # the operator's count stands


def test_the_console_script_caps_the_arenas_before_the_exporter_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.main caps them before importing the server, whose import starts nothing but must come after."""
    from stepscope.exporter import launch, malloc_arenas

    calls: list[str] = []
    monkeypatch.setattr(malloc_arenas, "cap_malloc_arenas", lambda: calls.append("cap"))
    monkeypatch.setattr(launch, "_require_extra", lambda command: None)
    monkeypatch.setitem(sys.modules, "stepscope.exporter.cli", type(sys)("cli"))
    sys.modules["stepscope.exporter.cli"].main = lambda: calls.append("main") or 0  # type: ignore[attr-defined]
    assert launch.main() == 0
    assert calls == ["cap", "main"]
