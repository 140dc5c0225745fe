"""End to end: tokens/s, model FLOP/s and MFU from real training-hook processes through a real exporter
(fake NVML naming each GPU's model in stepscope_gpu_info) to a real Prometheus loading the shipped rules.

Three runs, one rank each, each holding memory on its own GPU:
  transformer  a small TransformerEncoder trained on the CPU; its FLOPs per step counted once with
               torch's FLOP counter (stepscope.hooks.flops.count_flops, before th.init, so the FLOPs
               series is born with the steps' and their 1m rates compare exactly from the start), bf16
               stated, on an H100 80GB HBM3
  stated       FLOPs per step stated (flops_per_step=), tf32 stated, on an A100-SXM4-80GB
  unknown      FLOPs per step stated, bf16, on a GPU model the peak table lacks: no MFU, not a guess
The test counts the transformer's FLOPs itself with the same counter on the same shapes, and reads the
peaks from the contract's table by the names the fake NVML reports.
"""

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from torch.utils.flop_counter import FlopCounterMode

from grafana.rules import RULE_FILES
from stepscope.contract.peak_flops import peak_flops
from stepscope_testkit.fake_nvml.scenario import make_gpu, write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.dashboard_queries import panel_queries
from tests.support.prometheus import query, running_prometheus, wait_for

NODE = "mfu-node"
# The Training dashboard's "Throughput and MFU" row (tests/test_bundle_e2e.py leaves it to this module)
MFU_PANELS = ("MFU", "Tokens/s", "Model FLOP/s", "Peak FLOP/s of the run's GPUs",
              "MFU per rank, and tensor-core activity", "Tokens/s and samples/s per rank")
UNKNOWN_GPU = "NVIDIA Fake GPU 9000"
STATED_FLOPS = 2.5e12  # per step of the `stated` and `unknown` runs
BATCH, SEQUENCE, WIDTH = 4, 32, 64  # the transformer's batch: BATCH x SEQUENCE tokens of WIDTH features
MODEL = f"""
import torch
torch.manual_seed(0)
torch.set_num_threads(1)
layer = torch.nn.TransformerEncoderLayer({WIDTH}, 4, 2 * {WIDTH}, batch_first=True, dropout=0.0)
model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
batch = torch.randn({BATCH}, {SEQUENCE}, {WIDTH})


def forward_backward():
    model(batch).pow(2).mean().backward()
"""
TRANSFORMER = MODEL + f"""
import time
import stepscope.hooks as th
from stepscope.hooks.flops import count_flops
flops = count_flops(forward_backward)
tracker = th.init(run="transformer", push_url={{url!r}}, push_interval=1, flops_per_step=flops, flops_dtype="bf16")
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
optimizer.zero_grad()
while True:
    forward_backward()
    optimizer.step()
    optimizer.zero_grad()
    tracker.step(samples={BATCH}, tokens={BATCH} * {SEQUENCE})
    time.sleep(0.05)
"""
STATED = """
import time
import stepscope.hooks as th
tracker = th.init(run={run!r}, push_url={url!r}, push_interval=1, flops_per_step={flops!r}, flops_dtype={dtype!r})
while True:
    time.sleep(0.05)
    tracker.step(samples=8, tokens=8 * 512)
"""

pytestmark = pytest.mark.timeout(180)


@dataclass
class Stack:
    prometheus: str
    gpus: dict[str, str]  # run -> the NVML name of the GPU it holds memory on


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def _by_run(base_url: str, expr: str) -> dict[str, float]:
    return {item["metric"]["run"]: float(item["value"][1]) for item in query(base_url, expr)}


def _at_evaluation(base_url: str, record: str, counter: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each run's (one rank's) recorded value, and the 1m rate of `counter` at the time the rule recorded it."""
    recorded = query(base_url, f"timestamp({record})")
    values, others = {}, {}
    for item in recorded:
        run, at = item["metric"]["run"], float(item["value"][1])
        values[run] = float(query(base_url, f'{record}{{run="{run}"}} @ {at}')[0]["value"][1])
        rate = f'sum(rate({counter}{{run="{run}"}}[1m] @ {at}))'
        others[run] = float(query(base_url, rate)[0]["value"][1])
    return values, others


def _agree_at_an_evaluation(base_url: str, record: str, counter: str, per_unit: dict[str, float]) -> None:
    """The recording is the counter's 1m rate times `per_unit` at the evaluation that recorded it. A scrape
    begun before an evaluation can be stored after it (seen under load), so the rate read back later may
    hold one sample more: the check passes once some evaluation within 30 s agrees to 1e-9."""
    def agrees() -> bool:
        rates, counted = _at_evaluation(base_url, record, counter)
        return rates == pytest.approx({run: counted[run] * unit for run, unit in per_unit.items()}, rel=1e-9)

    assert wait_for(agrees, 30), _at_evaluation(base_url, record, counter)


def _transformer_flops_per_step() -> int:
    """The FLOP counter's own count of one forward and backward of the trainer's model, in this process."""
    scope: dict = {}
    exec(MODEL, scope)
    with FlopCounterMode(display=False) as counter:
        scope["forward_backward"]()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("mfu")
    gpus = [make_gpu(0, "H100"), make_gpu(1, "A100"), make_gpu(2, "H100", name=UNKNOWN_GPU)]
    scenario = {"driver_version": "550.54.15", "gpus": gpus, "xid_events": []}
    path = write_scenario(tmp / "nvml.json", scenario)
    with running_exporter(tmp, fake_nvml_scenario=path) as exporter:
        address = exporter.url.removeprefix("http://")
        with running_prometheus(tmp, {NODE: address}, RULE_FILES) as prometheus:
            trainers = {
                "transformer": _start(TRANSFORMER.format(url=exporter.url)),
                "stated": _start(STATED.format(run="stated", url=exporter.url, flops=STATED_FLOPS, dtype="tf32")),
                "unknown": _start(STATED.format(run="unknown", url=exporter.url, flops=STATED_FLOPS, dtype="bf16")),
            }
            try:
                for index, proc in enumerate(trainers.values()):  # each trainer holds memory on its GPU
                    gpus[index]["processes"] = [{"pid": proc.pid, "used_memory": 8 << 30}]
                write_scenario(path, scenario)
                expected = {"transformer", "stated", "unknown"}
                assert wait_for(lambda: set(_by_run(prometheus.url, "run:stepscope_model_flops:rate1m")) == expected
                                and len(_by_run(prometheus.url, "run:stepscope_mfu:ratio_rate1m")) == 2, 90), (
                    f"{_by_run(prometheus.url, 'run:stepscope_mfu:ratio_rate1m')}\n{exporter.log()}")
                yield Stack(prometheus.url, {run: gpus[i]["name"] for i, run in enumerate(trainers)})
            finally:
                for proc in trainers.values():
                    proc.kill()
                    proc.wait()


def test_the_flops_the_hooks_export_per_step_are_the_flop_counters(stack: Stack) -> None:
    """What Prometheus scraped: the transformer's FLOPs over its steps is the counter's count for one step
    (counted before the first step, so every push holds steps x that count)."""
    expected = _transformer_flops_per_step()
    assert expected > 0
    per_step = _by_run(stack.prometheus, "stepscope_model_flops_total / on (run, rank, instance) stepscope_steps_total")
    assert per_step["transformer"] == expected
    assert per_step["stated"] == STATED_FLOPS
    dtypes = {item["metric"]["run"]: item["metric"]["dtype"]
              for item in query(stack.prometheus, "stepscope_model_flops_total")}
    assert dtypes == {"transformer": "bf16", "stated": "tf32", "unknown": "bf16"}


def test_mfu_is_the_model_flop_rate_over_the_tables_peak_for_the_gpu_and_dtype(stack: Stack) -> None:
    peaks = {"transformer": peak_flops(stack.gpus["transformer"], "bf16"),
             "stated": peak_flops(stack.gpus["stated"], "tf32")}
    assert peaks == {"transformer": 989.4e12, "stated": 156e12}  # H100 SXM bf16, A100 tf32 (dense)
    # the rank's MFU and FLOP rate are recorded in one group at one evaluation: exactly rate / peak
    ratio = _by_run(stack.prometheus, "run_rank:stepscope_mfu:ratio_rate1m / on (run, rank, instance) "
                                      "sum by (run, rank, instance) (run_rank:stepscope_model_flops:rate1m)")
    assert ratio == pytest.approx({run: 1 / peak for run, peak in peaks.items()}, rel=1e-9)
    # and the recorded FLOP rate is the rank's steps per second times its FLOPs per step
    flops_per_step = {"transformer": _transformer_flops_per_step(), "stated": STATED_FLOPS, "unknown": STATED_FLOPS}
    _agree_at_an_evaluation(stack.prometheus, "run_rank:stepscope_model_flops:rate1m", "stepscope_steps_total",
                            flops_per_step)
    mfu = _by_run(stack.prometheus, "run:stepscope_mfu:ratio_rate1m")
    assert set(mfu) == {"transformer", "stated"}  # the unknown GPU has no peak: no MFU rather than a guess
    assert 0 < mfu["transformer"] < 1e-3  # a CPU loop "on" an H100
    # what StepscopeMfuBelowTensorActivity reads: with no eval or checkpoint break, the MFU of the evaluation
    held = _by_run(stack.prometheus, "run:stepscope_mfu:held_ratio_rate1m / on (run) run:stepscope_mfu:ratio_rate1m")
    assert held == pytest.approx(dict.fromkeys(mfu, 1.0), rel=1e-9)
    peak = _by_run(stack.prometheus, "run:stepscope_peak_flops_per_second:sum")
    assert peak == pytest.approx(peaks, rel=1e-9)


def test_tokens_per_second_follow_the_tokens_each_step_states(stack: Stack) -> None:
    tokens = _by_run(stack.prometheus, "stepscope_tokens_total / on (run, rank, instance) stepscope_samples_total")
    assert tokens == {"transformer": SEQUENCE, "stated": 512, "unknown": 512}
    # the recorded tokens/s is the tokens counter's rate (the tokens series is born at the first step, the
    # samples one at the first push: their 1m rates differ while a run is younger than a minute)
    _agree_at_an_evaluation(stack.prometheus, "run_rank:stepscope_tokens:rate1m", "stepscope_tokens_total",
                            dict.fromkeys(tokens, 1.0))


def test_every_query_of_the_dashboards_throughput_row_shows_data(stack: Stack) -> None:
    """The row's panels read the recordings above (tensor-core activity, a GPU reading of settled runs, is
    left to the other tests: the fake's GPUs here read none while the run is this young)."""
    queries = [q for q in panel_queries() if q.dashboard == "stepscope-training.json" and q.panel in MFU_PANELS]
    assert {q.panel for q in queries} == set(MFU_PANELS)
    empty = [f"{q.panel} / {q.ref_id}: {q.expr}" for q in queries
             if not query(stack.prometheus, q.expr) and "tensor_active" not in q.expr]
    assert empty == []
