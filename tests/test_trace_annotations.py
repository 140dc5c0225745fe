"""What the tests read from a written trace, on traces shaped like real ones: no GPU needed.

On an H100, a trace with CUDA activity holds every `ProfilerStep#N` twice, once on the CPU timeline
(category `user_annotation`) and once on the GPU timeline (`gpu_user_annotation`): 10 events for 5
steps. A step is counted once, whichever timelines show it.
"""

import gzip
import json
from pathlib import Path
from typing import Any

from stepscope_testkit.traces import kernel_names, step_annotations

HOST_PID, HOST_TID = 4242, 4242
DEVICE, STREAM = 0, 7


def step_events(step: int, gpu: bool) -> list[dict[str, Any]]:
    """One recorded step as Kineto writes it: its CPU annotation, a GEMM, and on CUDA their GPU side."""
    start = 1_000 + 100 * step
    cpu = [
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": HOST_PID, "tid": HOST_TID,
         "ts": start, "dur": 90, "args": {"External id": step}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": HOST_PID, "tid": HOST_TID, "ts": start + 5,
         "dur": 20},
    ]
    if not gpu:
        return cpu
    return [*cpu,
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": HOST_PID, "tid": HOST_TID,
             "ts": start + 10, "dur": 4, "args": {"correlation": step}},
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32",
             "pid": DEVICE, "tid": STREAM, "ts": start + 20, "dur": 50, "args": {"correlation": step}},
            {"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step}", "pid": DEVICE, "tid": STREAM,
             "ts": start + 20, "dur": 50, "args": {"External id": step}},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": step, "pid": DEVICE, "tid": STREAM, "ts": start + 20,
             "bp": "e"}]


def write_trace(path: Path, steps: range, gpu: bool) -> Path:
    """A gzipped Chrome trace of `steps`, with process metadata first as in a real export."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0, "args": {"name": "python3"}},
    ]
    if gpu:
        events.append({"ph": "M", "name": "process_name", "pid": DEVICE, "tid": 0, "args": {"name": "GPU 0"}})
    for step in steps:
        events += step_events(step, gpu)
    trace = {"schemaVersion": 1, "deviceProperties": [], "traceEvents": events, "traceName": str(path)}
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump(trace, handle)
    return path


def test_a_cuda_trace_counts_each_step_once_by_its_cpu_annotation(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "cuda.pt.trace.json.gz", range(1, 6), gpu=True)
    raw = json.loads(gzip.decompress(path.read_bytes()))
    assert sum(str(e.get("name")).startswith("ProfilerStep#") for e in raw["traceEvents"]) == 10  # as on the H100
    assert step_annotations(path) == [f"ProfilerStep#{n}" for n in range(1, 6)]
    assert len(kernel_names(path)) == 5


def test_a_cpu_trace_reads_the_same_and_steps_come_in_numeric_order(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "cpu.pt.trace.json.gz", range(1, 12), gpu=False)
    assert step_annotations(path) == [f"ProfilerStep#{n}" for n in range(1, 12)]  # #10 after #9, not after #1
    assert kernel_names(path) == []
