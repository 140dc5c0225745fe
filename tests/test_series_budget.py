"""The default node exposition stays within the series budget that lets one Prometheus carry a
cluster (docs/deployment.md, "Scaling"): a real exporter scrape of a node with 8 GPUs and 8 ranks of the 9
standard phases holds at most 1,000 series besides those of the machine's own devices. Those (2 a NIC, 5 a
disk, 2 a filesystem: 11 on this 2-NIC machine, about 35 on a GPU node with 8 InfiniBand NICs) are the
machine's, not the node's GPUs and ranks: counted in, the budget held here by 0 series and failed on a
machine with one more NIC. Per-phase buckets, which no rule, panel or alert reads, are off by default and
come back behind the documented switch."""

from pathlib import Path

from stepscope_testkit.node_scrape import GPUS, capture_node_scrape

BUDGET = 1000
DEVICE_FAMILIES = ("stepscope_node_network_", "stepscope_node_disk_", "stepscope_node_filesystem_")
PHASES = 9


def _series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _of_devices(line: str) -> bool:
    return line.startswith(DEVICE_FAMILIES)


def _phase_buckets(series: list[str]) -> int:
    return sum(1 for line in series if line.startswith("stepscope_step_phase_seconds_bucket{"))


def test_default_node_scrape_is_within_the_series_budget(tmp_path: Path) -> None:
    series = _series(capture_node_scrape(tmp_path))
    devices = sum(1 for line in series if _of_devices(line))
    print(f"\n{len(series)} series in one node scrape (8 GPUs, 8 ranks x 9 phases), {devices} of its devices")
    assert devices > 0 and len(series) - devices <= BUDGET
    assert _phase_buckets(series) == GPUS * PHASES  # le="+Inf" only: the histogram's minimum
    assert sum(1 for line in series if line.startswith("stepscope_process_gpu_memory_bytes{")) == GPUS


def test_phase_buckets_come_back_behind_the_switch(tmp_path: Path) -> None:
    series = _series(capture_node_scrape(tmp_path, phase_buckets=True))
    assert _phase_buckets(series) > 10 * GPUS * PHASES
