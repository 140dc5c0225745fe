"""The step-time bounds the ranks of a run on this node want: their agreement when they share no store.

A run's buckets are its ranks' summed per `le`, and a bound only some ranks export lacks the others'
counts: a dip, which VictoriaMetrics (1.79) repairs by lowering every bucket below it (run p95 +2,554% to +7,121%
measured, docs/engines.md). Ranks with a torch process group agree on one set of blocks through its store
(stepscope.hooks.run_bounds); ranks without one (or whose store failed) push to the exporter of their node
anyway, so it serves as their store: each push may carry the fine blocks its rank wants, per histogram
(BOUNDS_HEADER, JSON `{"step": [12, 13], "phase:forward": [9]}`), and the answer says how many of the run's
ranks on this node want each block (RUN_BOUNDS_HEADER, `{"step": {"12": 3, "13": 1}}`). Each rank then
exports every block the run wants, at its own exact counts. A push without the header withdraws its rank's
blocks; a group that expires or is deleted takes its rank's with it. Ranks on other nodes are not counted.
"""

import json
import threading
from collections import Counter
from collections.abc import Iterable, Mapping

from stepscope.contract import GRID_OCTAVES, STEPS_PER_OCTAVE, json_text
from stepscope.exporter.ingest.errors import Rejected, clip

BOUNDS_HEADER = "Stepscope-Bounds"
RUN_BOUNDS_HEADER = "Stepscope-Run-Bounds"
# 33 histograms of at most 14 blocks each take about 2,000 characters, long phase names 4,000 more; the request head
# may hold 16 KiB (exporter.http_exchange).
MAX_HEADER_CHARS = 8192
# Bounds on the hooks' grid: a block (two bounds, stepscope.hooks.timing.BLOCK) is numbered below this.
GRID_BOUNDS = (GRID_OCTAVES[1] - GRID_OCTAVES[0]) * STEPS_PER_OCTAVE
PHASE_PREFIX = "phase:"

Wanted = Mapping[str, frozenset[int]]  # histogram ("step", "phase:<name>") -> blocks


def parse_wanted(raw: str | None, max_histograms: int, max_name_length: int) -> Wanted | None:
    """The blocks a push's BOUNDS_HEADER wants (None: no header); a malformed one is refused (400), so that a
    hook's bug shows in its push errors rather than as quantiles that read off."""
    if raw is None:
        return None
    problem = f"header {BOUNDS_HEADER} "
    if len(raw) > MAX_HEADER_CHARS:
        raise Rejected(400, "malformed", problem + f"has {len(raw)} characters, over {MAX_HEADER_CHARS}")
    try:
        value = json_text.loads(raw)
    except ValueError:
        raise Rejected(400, "malformed", problem + f"is not JSON: {clip(raw)!r}") from None
    if not isinstance(value, dict) or len(value) > max_histograms:
        raise Rejected(400, "malformed", problem + f"must be an object of at most {max_histograms} histograms, "
                                                   f"each a list of block numbers: {clip(raw)!r}")
    wanted: dict[str, frozenset[int]] = {}
    for name, blocks in value.items():
        if not _is_histogram(name, max_name_length):
            raise Rejected(400, "malformed", problem + f"names histogram {clip(name)!r}: "
                                                       f"\"step\" or \"{PHASE_PREFIX}<phase>\" expected")
        if not isinstance(blocks, list) or not all(_is_block(block) for block in blocks):
            raise Rejected(400, "malformed", problem + f"gives {clip(name)!r} blocks {clip(str(blocks))}: "
                                                       f"a list of integers from 0 to {GRID_BOUNDS - 1} expected")
        wanted[name] = frozenset(blocks)
    return wanted


def _is_histogram(name: str, max_name_length: int) -> bool:
    phase = name.removeprefix(PHASE_PREFIX)
    return name == "step" or (name.startswith(PHASE_PREFIX) and 0 < len(phase) <= max_name_length)


def _is_block(block: object) -> bool:
    return type(block) is int and 0 <= block < GRID_BOUNDS


class NodeBounds:
    """Each pushing rank's wanted blocks, and the run's counts of them over the ranks pushing here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted: dict[tuple[str, str], Wanted] = {}  # (run, rank) -> its blocks

    def on_push(self, run: str, rank: str, wanted: Wanted | None) -> dict[str, str]:
        """Records the rank's blocks (None withdraws them) and answers the run's counts, its own included;
        no header for a rank that sent none (a Pushgateway client, or one agreeing through a store)."""
        with self._lock:
            if wanted is None:
                self._wanted.pop((run, rank), None)
                return {}
            self._wanted[(run, rank)] = wanted
            counts: dict[str, Counter[int]] = {}
            for (other_run, _), blocks in self._wanted.items():
                if other_run == run:
                    for name, numbers in blocks.items():
                        counts.setdefault(name, Counter()).update(numbers)
        answer = {name: {str(block): count for block, count in sorted(c.items())} for name, c in counts.items()}
        return {RUN_BOUNDS_HEADER: json.dumps(answer, separators=(",", ":"))}

    def forget_except(self, live: Iterable[tuple[str, str]]) -> None:
        """Drops the blocks of ranks whose groups are gone (expired or deleted)."""
        keep = set(live)
        with self._lock:
            for key in [key for key in self._wanted if key not in keep]:
                del self._wanted[key]
