"""PyTorch's allocator families on a real GPU (marked gpu; skipped where torch sees no CUDA device): a loop
that fragments the caching allocator's cache under a memory cap until allocations fail, flush the cache and
retry, the case StepscopeCudaAllocRetries warns of. The pushed body must carry the retries, the fragmented
(inactive split) bytes while the cache holds them, and the peak since the previous push. On the CPU the same
families are proven with the fake allocator (tests/test_cuda_memory.py) and the alert with promtool
(grafana/rules/tests/torch_memory.yml).
"""

import pytest
import torch

import stepscope.hooks as th
from stepscope.contract import families
from stepscope_testkit.processes import sample_values

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch"),
]

MIB = 2**20
CAP_BYTES = 1024 * MIB  # the allocator's ceiling here: torch.cuda.set_per_process_memory_fraction
SMALL_BYTES, LARGE_BYTES = 24 * MIB, 72 * MIB  # small blocks cached apart; a large one fits none of them


def fragment(rounds: int) -> None:
    """Each round fills the cap with small blocks, frees every other one (cached, not adjacent: no free
    run of 72 MiB), then asks for large blocks: the cache cannot serve them and the cap forbids a new
    cudaMalloc, so the allocator frees its cached blocks and retries (num_alloc_retries)."""
    for _ in range(rounds):
        small = [torch.empty(SMALL_BYTES, dtype=torch.uint8, device="cuda")
                 for _ in range(CAP_BYTES // SMALL_BYTES - 2)]
        del small[::2]
        large = [torch.empty(LARGE_BYTES, dtype=torch.uint8, device="cuda") for _ in range(3)]
        del small, large


def pushed(text: str, family: str) -> float:
    [value] = sample_values(text, family)
    return value


def test_a_fragmenting_loop_makes_retries_climb_in_the_pushed_body() -> None:
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total, 0)
    torch.cuda.empty_cache()
    held = torch.zeros(1, device="cuda")  # the families are pushed once the allocator has served this process
    tracker = th.init(run="gpu-memory", push_url="")
    try:
        before = pushed(tracker.render(), families.CUDA_ALLOC_RETRIES)
        fragment(rounds=5)
        after = tracker.render()
        retries = pushed(after, families.CUDA_ALLOC_RETRIES)
        print(f"\nretries {before:g} -> {retries:g}; peak {pushed(after, families.CUDA_MEMORY_PEAK) / MIB:.0f} MiB;"
              f" reserved {pushed(after, families.CUDA_MEMORY_RESERVED) / MIB:.0f} MiB")
        assert retries >= before + 5  # at least one flush-and-retry per round
        assert pushed(after, families.CUDA_MEMORY_PEAK) >= 3 * LARGE_BYTES
        assert pushed(after, families.CUDA_MEMORY_RESERVED) <= CAP_BYTES
        assert pushed(after, families.CUDA_OOMS) == 0
    finally:
        tracker.close()
        del held
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
