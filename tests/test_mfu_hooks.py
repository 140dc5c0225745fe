"""The hooks' tokens and model FLOPs (docs/mfu.md): what a tracker counts and pushes, the settings it
refuses, torch's FLOP counter through `tracker.measure_flops`, and the contract's peak table."""

import re
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.utils.flop_counter import FlopCounterMode

import stepscope.hooks as th
from stepscope.contract import families
from stepscope.contract.peak_flops import (
    BF16,
    BY_NVML_NAME,
    DTYPES,
    FP8,
    FP16,
    FP32,
    GPUS,
    TF32,
    GpuPeak,
    peak_flops,
    rules_table,
)
from stepscope.contract.recordings import GPU_SOURCE_NAME
from stepscope_testkit.fake_nvml.scenario import MODELS


def _pushed(tracker: th.Tracker) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of what the tracker would push now."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(tracker.render()) for s in family.samples}


def _names(tracker: th.Tracker) -> set[str]:
    return {name for name, _ in _pushed(tracker)}


def test_a_run_that_states_nothing_pushes_no_tokens_flops_or_peak() -> None:
    """The default push keeps the series budget: the families appear only once stated."""
    tracker = th.init(run="plain", push_url="")
    tracker.step(samples=8)
    assert not _names(tracker) & {families.TOKENS_TOTAL, families.MODEL_FLOPS_TOTAL, families.PEAK_FLOPS}


def test_stated_flops_count_per_step_and_per_sample_micro_batches_included() -> None:
    tracker = th.init(run="stated", push_url="", flops_per_step=10**18, flops_per_sample=3, flops_dtype="fp8",
                      peak_flops=1.5e15)
    tracker.micro_batch(samples=4, tokens=400)  # gradient accumulation: 3 batches of 4, one optimizer step
    tracker.micro_batch(samples=4, tokens=400)
    tracker.step(samples=4, tokens=400)
    tracker.step(samples=2, tokens=100, flops=7)  # a step that states its own FLOPs
    pushed = _pushed(tracker)
    # exact beyond 2**53: the FLOPs stay an integer while every addend is one
    assert pushed[(families.MODEL_FLOPS_TOTAL, (("dtype", "fp8"),))] == 10**18 + 12 * 3 + 7
    assert "stepscope_model_flops_total{dtype=\"fp8\"} 1000000000000000043" in tracker.render()
    assert pushed[(families.TOKENS_TOTAL, ())] == 1300
    assert pushed[(families.PEAK_FLOPS, ())] == 1.5e15


def test_tokens_appear_with_the_first_step_that_counts_them() -> None:
    tracker = th.init(run="tokens", push_url="")
    tracker.step(samples=1)
    assert families.TOKENS_TOTAL not in _names(tracker)
    tracker.step(samples=1, tokens=2048)
    assert _pushed(tracker)[(families.TOKENS_TOTAL, ())] == 2048
    assert families.MODEL_FLOPS_TOTAL not in _names(tracker)


def test_measure_flops_counts_with_torchs_flop_counter_and_every_step_after_counts_it() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    batch = torch.randn(2, 16, 32)

    def forward_backward() -> None:
        model(batch).sum().backward()

    with FlopCounterMode(display=False) as counter:
        forward_backward()
    tracker = th.init(run="measured", push_url="")
    assert tracker.measure_flops(forward_backward) == counter.get_total_flops() > 0
    for _ in range(3):
        tracker.step(samples=2, tokens=32)
    assert _pushed(tracker)[(families.MODEL_FLOPS_TOTAL, (("dtype", "bf16"),))] == 3 * counter.get_total_flops()


def test_measure_flops_refuses_a_function_without_matmuls() -> None:
    tracker = th.init(run="nothing", push_url="")
    with pytest.raises(ValueError, match="saw no matmul"):
        tracker.measure_flops(lambda: torch.ones(3).add(1))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"flops_dtype": "int8"}, "flops_dtype must be one of fp8, bf16, fp16, tf32, fp32, got 'int8'"),
    ({"flops_per_step": -1}, "flops_per_step must be a number >= 0"),
    ({"flops_per_sample": float("nan")}, "flops_per_sample must be a number >= 0"),
    ({"peak_flops": 0}, "peak_flops must be a number > 0"),
    ({"peak_flops": True}, "peak_flops must be a number > 0"),
])
def test_bad_flops_settings_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        th.Config.resolve(env={}, run="bad", push_url="", **kwargs)
    assert "\n" not in str(error.value)


def test_the_environment_states_the_dtype_and_the_peak() -> None:
    config = th.Config.resolve(env={"STEPSCOPE_FLOPS_DTYPE": "tf32", "STEPSCOPE_PEAK_FLOPS": "156e12"}, run="env")
    assert (config.flops_dtype, config.peak_flops) == ("tf32", 156e12)
    with pytest.raises(ValueError, match="STEPSCOPE_PEAK_FLOPS must be FLOP/s"):
        th.Config.resolve(env={"STEPSCOPE_PEAK_FLOPS": "a lot"}, run="env")


def test_the_peak_table_knows_every_model_the_fake_nvml_and_the_corpus_name() -> None:
    """The H100 of ../shared/corpus reported "NVIDIA H100 80GB HBM3"; the fake NVML names the others."""
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    for model in MODELS.values():
        assert model["name"] in BY_NVML_NAME, model["name"]
    assert peak_flops("Tesla T4", "bf16") is None  # no bf16 on a T4: no MFU rather than a guess
    assert peak_flops("NVIDIA Fake GPU 9000", "bf16") is None


def test_every_part_has_sources_names_and_dense_figures_that_rise_with_narrower_types() -> None:
    names = [name for gpu in GPUS for name in gpu.nvml_names]
    assert len(names) == len(set(names))
    for gpu in GPUS:
        assert gpu.source.startswith("https://") and set(gpu.tflops) <= set(DTYPES), gpu.part
        figures = [gpu.tflops[dtype] for dtype in DTYPES if dtype in gpu.tflops]
        assert figures == sorted(figures, reverse=True), gpu.part  # fp8 >= bf16 = fp16 >= tf32 >= fp32


def test_the_rules_table_matches_each_name_exactly() -> None:
    """The names become one RE2 alternation per peak; Prometheus anchors it, so "NVIDIA L4" never
    matches an "NVIDIA L40S" (both in the table with different peaks)."""
    terms = re.findall(r'name=~"([^"]*)"\}\) \* (\S+)$', rules_table("bf16", GPU_SOURCE_NAME), re.M)
    assert len(terms) >= 5
    for alternation, value in terms:
        matched = [name for name in BY_NVML_NAME if re.fullmatch(alternation, name)]
        assert matched and all(BY_NVML_NAME[name].peak("bf16") == pytest.approx(float(value)) for name in matched)
    assert {name for alternation, _ in terms for name in BY_NVML_NAME if re.fullmatch(alternation, name)} == {
        name for name, gpu in BY_NVML_NAME.items() if gpu.peak("bf16") is not None}
    with pytest.raises(ValueError, match="flops_dtype must be one of"):
        rules_table("int4", GPU_SOURCE_NAME)


def _documented_peaks() -> dict[str, list[str]]:
    """docs/mfu.md's dense TFLOP/s table: part -> its fp8, bf16 / fp16, tf32 and fp32 cells."""
    text = (Path(__file__).parents[1] / "docs" / "mfu.md").read_text()
    table = text[text.index("| part | NVML names |"):].split("\n\n")[0].splitlines()[2:]
    return {cells[0]: cells[2:] for cells in ([cell.strip() for cell in row.strip("|").split("|")] for row in table)}


def _peak_cells(gpu: GpuPeak) -> list[str]:
    """The cells docs/mfu.md should show for `gpu`: empty where it lacks the math, "fp16 N" where only fp16 has it."""
    def figure(dtype: str) -> str:
        return f"{gpu.tflops[dtype]:g}" if dtype in gpu.tflops else ""
    half = figure(BF16) or (f"fp16 {figure(FP16)}" if FP16 in gpu.tflops else "")
    return [figure(FP8), half, figure(TF32), figure(FP32)]


def test_the_documented_peak_table_is_the_contracts() -> None:
    """docs/mfu.md copies stepscope.contract.peak_flops by hand: each part's row (the A100's says "(SXM and PCIe)")
    shows the contract's figures, and there is a row for every part and none besides."""
    documented = _documented_peaks()
    rows = {gpu.part: next((row for row in documented if row == gpu.part or row.startswith(f"{gpu.part} (")), None)
            for gpu in GPUS}
    assert sorted(filter(None, rows.values())) == sorted(documented), "a documented part the contract lacks"
    for gpu in GPUS:
        assert rows[gpu.part] is not None, f"no row for {gpu.part}"
        assert documented[rows[gpu.part]] == _peak_cells(gpu), gpu.part
