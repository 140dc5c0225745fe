"""The GPU collector's latest view of which pids hold GPU memory, handed to the process collector.

Keeps NVML calls inside the GPU collector while the process collector owns per-process series.
"""

from collections.abc import Mapping
from types import MappingProxyType


class GpuProcessTable:
    """pid -> {gpu index -> bytes of GPU memory used}, replaced whole on every GPU cycle.

    Readers get an immutable mapping and the swap is one reference assignment, so no lock is needed.
    """

    def __init__(self) -> None:
        self._table: Mapping[int, Mapping[str, int]] = MappingProxyType({})

    def replace(self, table: Mapping[int, Mapping[str, int]]) -> None:
        self._table = MappingProxyType({pid: MappingProxyType(dict(gpus)) for pid, gpus in table.items()})

    def get(self) -> Mapping[int, Mapping[str, int]]:
        return self._table
