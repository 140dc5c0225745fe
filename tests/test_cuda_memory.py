"""PyTorch's caching-allocator memory per rank: read from torch.cuda.memory_stats() at each push (the fake
CUDA's allocator stands in for a GPU's), pushed, published by the exporter, and recorded per GPU by the
shipped rules in a real Prometheus, where the dashboards' allocator queries answer. The alerts' cases
(retries that keep climbing, a full cache against real pressure) are promtool cases in
grafana/rules/tests/torch_memory.yml."""

import csv
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import stepscope.hooks as th
import stepscope.hooks.tracker
from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings
from stepscope.hooks.cuda_memory import AllocatorMemory, read_allocator
from stepscope.report.csvs import CUDA_HEADER
from stepscope_testkit.fake_cuda import FakeCuda
from stepscope_testkit.fake_nvml.scenario import GIB, make_gpu, write_scenario
from stepscope_testkit.processes import running_exporter, scrape
from tests.support.dashboard_queries import panel_queries
from tests.support.prometheus import query, running_prometheus, wait_for

MIB = 2**20
NODE = "node-1"
ALLOCATOR_PANELS = {("stepscope-training.json", "PyTorch allocator memory per rank"),
                    ("stepscope-training.json", "Allocation retries and OOMs per rank"),
                    ("stepscope-node.json", "GPU memory in PyTorch's allocators")}


def test_reads_the_allocator_and_its_peak_since_the_previous_read() -> None:
    cuda = FakeCuda(device_memory=64 * MIB)
    allocator = cuda.allocators[0]
    allocator.free(allocator.allocate(40 * MIB))
    allocator.allocate(10 * MIB)  # from the cached 40 MiB block; 30 MiB of it stay cached
    assert read_allocator(cuda) == AllocatorMemory(10 * MIB, 40 * MIB, 40 * MIB, 30 * MIB, 0, 0)
    big = allocator.allocate(50 * MIB)  # fits no cached block; 40 + 50 > 64: frees the cache, retries
    assert read_allocator(cuda) == AllocatorMemory(60 * MIB, 60 * MIB, 60 * MIB, 0, 1, 0)
    with pytest.raises(RuntimeError, match="out of memory"):
        allocator.allocate(10 * MIB)
    allocator.free(big)
    assert read_allocator(cuda) == AllocatorMemory(10 * MIB, 60 * MIB, 60 * MIB, 50 * MIB, 2, 1)
    assert read_allocator(cuda).peak_allocated_bytes == 10 * MIB  # the peak of the last interval only


def test_sums_the_devices_the_process_allocated_on_and_skips_the_others() -> None:
    cuda = FakeCuda(devices=3)
    cuda.allocators[0].allocate(4 * MIB)
    cuda.allocators[2].allocate(6 * MIB)
    memory = read_allocator(cuda)
    assert (memory.allocated_bytes, memory.reserved_bytes) == (10 * MIB, 10 * MIB)
    assert read_allocator(FakeCuda(devices=2)) is None  # CUDA initialized, nothing allocated


def test_reads_nothing_without_cuda_or_before_cuda_is_initialized() -> None:
    """Reading must not create a CUDA context: an uninitialized torch.cuda is not asked for stats."""
    asked: list[int] = []
    uninitialized = types.SimpleNamespace(is_initialized=lambda: False, device_count=lambda: 1,
                                          memory_stats=asked.append)
    assert read_allocator(None) is None
    assert read_allocator(uninitialized) is None
    assert asked == []


def test_a_rank_pushes_the_allocator_families_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = th.init(run="cpu", push_url="", handle_sigterm=False)
    assert "stepscope_torch_cuda" not in cpu.render()
    cpu.close()
    cuda = FakeCuda()
    cuda.allocators[0].allocate(3 * MIB)
    monkeypatch.setattr(stepscope.hooks.tracker, "_cuda_module", lambda: cuda)
    tracker = th.init(run="gpu", push_url="", handle_sigterm=False)
    text = tracker.render()
    tracker.close()
    assert f"{families.CUDA_MEMORY_ALLOCATED} {3 * MIB}" in text.splitlines()
    assert f"{families.CUDA_MEMORY_RESERVED} {4 * MIB}" in text.splitlines()  # one 2 MiB segment more
    assert f"{families.CUDA_ALLOC_RETRIES} 0" in text.splitlines()


def test_the_allocator_reaches_the_recorded_series_and_the_dashboards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process trains on GPU 0 of the fake NVML (it holds 70 GiB there); its fake allocator gives 24
    GiB to tensors and keeps 40 GiB cached: the per-GPU recordings say so, and every allocator query of
    the Training and Node dashboards answers. A 30 GiB spike between two pushes shows as a 54 GiB peak,
    which the run report names with the window's most reserved."""
    cuda = FakeCuda()
    allocator = cuda.allocators[0]
    allocator.free(allocator.allocate(64 * GIB))
    allocator.allocate(24 * GIB)
    read_allocator(cuda)  # the peak of what came before the run: read and reset
    monkeypatch.setattr(stepscope.hooks.tracker, "_cuda_module", lambda: cuda)
    scenario = {"driver_version": "550.54.15", "gpus": [make_gpu(0, "H100", processes=[(os.getpid(), 70 * GIB)])]}
    with running_exporter(tmp_path, fake_nvml_scenario=write_scenario(tmp_path / "nvml.json", scenario)) as exporter, \
            running_prometheus(tmp_path, {NODE: exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        # pushes 2 s apart, scrapes every second: every push's peak is scraped
        tracker = th.init(run="alloc", rank=0, push_url=exporter.url, push_interval=2, handle_sigterm=False)
        try:
            for _ in tracker.loader(range(3)):
                tracker.step(samples=1)

            def recorded(name: str) -> float | None:
                found = query(prometheus.url, f'{name}{{instance="{NODE}",gpu="0"}}')
                return float(found[0]["value"][1]) if found else None

            assert wait_for(lambda: recorded(recordings.GPU_TORCH_CACHED) == 40 * GIB, 60), scrape(exporter.url)
            assert recorded(recordings.GPU_TORCH_ALLOCATED) == 24 * GIB
            wanted = [q for q in panel_queries() if (q.dashboard, q.panel) in ALLOCATOR_PANELS]
            assert {(q.dashboard, q.panel) for q in wanted} == ALLOCATOR_PANELS
            unanswered = lambda: [q.expr for q in wanted if not query(prometheus.url, q.expr)]  # noqa: E731
            assert wait_for(lambda: not unanswered(), 60), unanswered()  # rate() needs two scrapes
            allocator.free(allocator.allocate(30 * GIB))
            peak = f'{families.CUDA_MEMORY_PEAK}{{run="alloc"}} == {54 * GIB}'
            assert wait_for(lambda: query(prometheus.url, peak), 30)
            report = tmp_path / "report"
            done = subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", prometheus.url,
                                   "--run", "alloc", "--out", str(report)], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            [row] = csv.DictReader((report / "rank_summary.csv").open())
            assert [float(row[c]) for c in CUDA_HEADER] == [54 * GIB, 64 * GIB, 0, 0]
            assert "GPU memory (PyTorch's allocator)" in (report / "index.html").read_text()
        finally:
            tracker.close()
