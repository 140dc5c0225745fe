"""MFU on a real GPU (marked gpu; skipped without NVML and a CUDA device): a bf16 matmul loop whose FLOPs
are known exactly (2·m·n·k per product) states them per step; the real exporter (real NVML names the
GPU), a real Prometheus and the shipped rules record its MFU, which must equal the FLOP/s the loop
measured itself over the same minute, over the table's dense bf16 peak for that GPU, within 2%. And a
bf16 transformer on the GPU whose FLOPs the hooks count once with torch's FLOP counter exports exactly
the counter's own count per step.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import stepscope.hooks as th
from grafana.rules import RULE_FILES
from stepscope.contract.peak_flops import peak_flops
from stepscope_testkit.processes import REPO_ROOT, running_exporter, sample_values
from tests.support.prometheus import query, running_prometheus, wait_for


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not _nvml_works(),
                       reason="needs an NVIDIA driver (NVML) and a CUDA GPU visible to torch"),
    pytest.mark.timeout(400),
]

SIZE = 8192  # m = n = k
PRODUCTS = 8  # matmuls per step
FLOPS_PER_STEP = PRODUCTS * 2 * SIZE**3
TOLERANCE = 0.02
LOOP = """
import json, time, torch
import stepscope.hooks as th
a = torch.randn({size}, {size}, device="cuda", dtype=torch.bfloat16)
b = torch.randn({size}, {size}, device="cuda", dtype=torch.bfloat16)
tracker = th.init(run="matmul", push_url={url!r}, push_interval=1, flops_per_step={flops}, flops_dtype="bf16")
with open({log!r}, "w") as log:
    done = 0
    while True:
        for _ in range({products}):
            c = a @ b
        torch.cuda.synchronize()
        tracker.step(samples=1)
        done += {flops}
        log.write(json.dumps([time.time(), done]) + "\\n")
        log.flush()
"""


def _achieved(log: Path, start: float, end: float) -> float:
    """FLOP/s the loop measured itself between two Unix times (synchronized steps)."""
    points = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    inside = [(t, flops) for t, flops in points if start <= t <= end]
    (t0, f0), (t1, f1) = inside[0], inside[-1]
    return (f1 - f0) / (t1 - t0)


def test_a_bf16_matmul_loops_mfu_is_its_achieved_flops_over_the_tables_peak(tmp_path: Path) -> None:
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name, "bf16")
    if peak is None:
        pytest.skip(f"{name!r} is not in stepscope.contract.peak_flops")
    log = tmp_path / "loop.jsonl"
    with running_exporter(tmp_path) as exporter:
        address = exporter.url.removeprefix("http://")
        with running_prometheus(tmp_path, {"gpu-node": address}, RULE_FILES) as prometheus:
            code = LOOP.format(size=SIZE, url=exporter.url, flops=FLOPS_PER_STEP, log=str(log), products=PRODUCTS)
            loop = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                                    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            try:
                assert wait_for(lambda: query(prometheus.url, 'run:stepscope_mfu:ratio_rate1m{run="matmul"}'), 120)
                time.sleep(75)  # a 1m rate window of steady state only
                (recorded,) = query(prometheus.url, 'timestamp(run:stepscope_mfu:ratio_rate1m{run="matmul"})')
                at = float(recorded["value"][1])
                (mfu,) = query(prometheus.url, f'run:stepscope_mfu:ratio_rate1m{{run="matmul"}} @ {at}')
            finally:
                loop.kill()
                loop.wait()
    expected = _achieved(log, at - 60, at) / peak
    print(f"\n{name}: recorded MFU {float(mfu['value'][1]):.4f}, the loop's own {expected:.4f} "
          f"(peak {peak / 1e12:.1f} TFLOP/s bf16)")
    assert float(mfu["value"][1]) == pytest.approx(expected, rel=TOLERANCE)


def test_a_bf16_transformer_on_the_gpu_exports_the_flop_counters_own_count_per_step() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda()
    batch = torch.randn(8, 256, 512, device="cuda")

    def forward_backward() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch).float().pow(2).mean()
        loss.backward()

    with FlopCounterMode(display=False) as counter:
        forward_backward()
    tracker = th.init(run="gpu-transformer", push_url="")
    assert tracker.measure_flops(forward_backward) == counter.get_total_flops() > 0
    for _ in range(5):
        forward_backward()
        tracker.step(samples=8, tokens=8 * 256)
    torch.cuda.synchronize()
    pushed = sample_values(tracker.render(), "stepscope_model_flops_total", dtype="bf16")
    assert pushed == [5 * counter.get_total_flops()]
