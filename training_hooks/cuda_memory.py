"""PyTorch's caching-allocator memory of this rank, read from `torch.cuda.memory_stats()` at each push.

NVML shows how much GPU memory a process holds; only the allocator knows how much of it tensors use
(allocated), how much it keeps cached for reuse (reserved), how much is cut into blocks too small to
reuse (inactive split: fragmentation), and how often an allocation failed until the cache was flushed
and retried (`num_alloc_retries`): each retry synchronizes the device and frees cached blocks, so steps
slow down long before an out-of-memory error ends the run.

Read on the pusher thread, never on the training thread, and only once CUDA is initialized (reading
must not create a CUDA context in a process that never used one). Summed over the devices this process's
allocator has served (one per rank, usually), so a rank pushes six series whatever its device count.
The peak is the peak since the previous read: each read resets PyTorch's peak statistics, so a spike
between two pushes shows instead of a process-lifetime maximum that never comes down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AllocatorMemory:
    allocated_bytes: int  # held by tensors now
    reserved_bytes: int  # held by the caching allocator now (allocated plus cached)
    peak_allocated_bytes: int  # the most allocated at once since the previous read
    inactive_split_bytes: int  # cached blocks split below reuse: fragmentation
    alloc_retries: int  # allocations that failed, flushed the cache and retried (cumulative)
    ooms: int  # out-of-memory errors raised by the allocator (cumulative)


STAT_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def read_allocator(cuda: Any) -> AllocatorMemory | None:
    """This process's allocator memory summed over the devices it allocated on, resetting their peaks;
    None when `cuda` (the `torch.cuda` module) is absent, not initialized, or has allocated nothing."""
    if cuda is None or not cuda.is_initialized():
        return None
    totals = dict.fromkeys(STAT_KEYS, 0)
    used = False
    for device in range(cuda.device_count()):
        stats = cuda.memory_stats(device)
        if not stats.get("allocation.all.allocated"):  # cumulative allocations: 0 on a device never used
            continue
        used = True
        for field, key in STAT_KEYS.items():
            totals[field] += int(stats.get(key, 0))
        cuda.reset_peak_memory_stats(device)
    return AllocatorMemory(**totals) if used else None
