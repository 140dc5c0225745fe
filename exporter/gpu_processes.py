"""The GPU collector's latest view of which pids hold GPU memory, handed to the process collector.

Keeps NVML calls inside the GPU collector while the process collector owns per-process series.
"""

import threading
from collections.abc import Mapping
from types import MappingProxyType


class GpuProcessTable:
    """pid -> {gpu index -> bytes of GPU memory used}, replaced whole on every GPU cycle."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: Mapping[int, Mapping[str, int]] = MappingProxyType({})

    def replace(self, table: Mapping[int, Mapping[str, int]]) -> None:
        frozen = MappingProxyType({pid: MappingProxyType(dict(gpus)) for pid, gpus in table.items()})
        with self._lock:
            self._table = frozen

    def get(self) -> Mapping[int, Mapping[str, int]]:
        with self._lock:
            return self._table
