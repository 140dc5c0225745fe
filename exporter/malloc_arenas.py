"""One glibc malloc arena for the whole exporter, instead of one for each thread that allocates.

glibc gives each thread that calls malloc an arena of its own (up to 8 per CPU), and each keeps the heap
pages it touched. The exporter's threads take turns under the GIL, so a second arena buys no concurrency,
only resident memory: 0.93 MiB of RSS with one fake H100 and a gzip scrape a second (29.5 -> 28.6 MiB,
twice each), where issue 20 asks for no more RSS than nvitop-exporter's. An arena count the environment
sets (MALLOC_ARENA_MAX, GLIBC_TUNABLES) is left as set; where the C library has no mallopt, nothing changes.
"""

import ctypes
import os

M_ARENA_MAX = -8  # malloc.h


def cap_malloc_arenas(arenas: int = 1) -> bool:
    """Caps glibc's arenas before the exporter starts its threads; True when the C library took it."""
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already runs on
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))
