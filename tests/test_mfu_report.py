"""The report's tokens and MFU (docs/mfu.md), from series as Prometheus returns them: the headline names
the MFU where the run has one, the key numbers show tokens, tokens/s, FLOP/s and MFU with the peak, and a
run that counts neither shows none of them. The H100 figures are the corpus mlp_bf16's (NVML 0.98, SM
active 0.73, tensor cores 0.58, MFU 0.51 from its FLOP counter count over its measured step time)."""

import csv
from pathlib import Path

import pytest

from stepscope.contract import verdicts
from stepscope.report import page, queries, report
from stepscope.report.collect import RunData
from stepscope.report.mfu import flops_per_second, mfu_percent
from stepscope.report.prometheus import Series
from stepscope.report.window import Window

WINDOW = Window(1000.0, 1100.0, 10.0)
TIMES = tuple(1000.0 + 10 * i for i in range(10))
H100_BF16 = 989.4e12


def _series(value: float, labels: dict[str, str] | None = None) -> list[Series]:
    return [Series(labels or {}, tuple((t, value) for t in TIMES))]


def _data(**over: float) -> RunData:
    """A GPU-bound run of one rank on an H100, in state train with a verdict at every point, plus `over`."""
    built = queries.build("r", WINDOW, [])
    series = {name: [] for name in built.over_time}
    series["verdict"] = _series(1.0, {"verdict": verdicts.GPU_BOUND})
    series["state"] = _series(1.0, {"rank": "0", "state": "train"})
    series.update(run_gpu_nvml=_series(0.98), run_gpu_sm_active=_series(0.73), run_gpu_tensor_active=_series(0.58))
    series.update({name: _series(value) for name, value in over.items()})
    totals = {name: [] for name in built.totals}
    rank = {"rank": "0", "instance": "n"}
    totals["state_seconds"] = [Series({**rank, "state": "train"}, ((1100.0, 100.0),))]  # the window, training
    if "run_peak_flops" in over:  # 4e6 tokens/s and 51% of the H100's peak over 100 s
        totals["tokens"] = [Series(rank, ((1100.0, 4.0e8),))]
        totals["model_flops"] = [Series(rank, ((1100.0, 0.51 * H100_BF16 * 100),))]
    return RunData("r", WINDOW, ("n",), totals, series)


def test_the_headline_names_the_mfu_and_the_page_its_figures() -> None:
    built = report.build(_data(run_peak_flops=H100_BF16), "http://prometheus")
    assert built.assessment.headline == (
        "GPU-bound: the GPUs are busy (SM active 0.73, tensor cores 0.58; MFU 51%; 100% of the training time)")
    html = page.render(built, {}, [])
    assert "MFU while training (model FLOP/s over the GPUs&#x27; dense peak of 989 TFLOP/s)" in html
    assert "<td>51%</td>" in html and "<td>505 TFLOP/s</td>" in html
    assert "<td>400,000,000</td>" in html and "<td>4,000,000</td>" in html


def test_run_summary_csv_holds_the_tokens_flops_and_mfu(tmp_path: Path) -> None:
    built = report.build(_data(run_peak_flops=H100_BF16), "http://prometheus")
    report.write(built, tmp_path)
    row = next(csv.DictReader((tmp_path / "run_summary.csv").open()))
    assert (row["tokens"], row["tokens_per_second"]) == ("400000000", "4000000")
    assert float(row["mfu_ratio"]) == pytest.approx(0.51) and float(row["peak_flops_per_second"]) == H100_BF16
    assert float(row["model_flops_per_second"]) == pytest.approx(0.51 * H100_BF16)


def test_a_run_without_tokens_or_flops_shows_none_of_them(tmp_path: Path) -> None:
    built = report.build(_data(), "http://prometheus")
    report.write(built, tmp_path)
    row = next(csv.DictReader((tmp_path / "run_summary.csv").open()))
    assert [row[name] for name in ("tokens", "tokens_per_second", "model_flops_per_second", "mfu_ratio")] == [""] * 4
    assert "MFU" not in built.assessment.headline
    assert "MFU while training" not in page.render(built, {}, []) and "tokens (all ranks)" not in page.render(
        built, {}, [])


def test_figures_in_words() -> None:
    assert mfu_percent(0.384) == "38%" and mfu_percent(0.00012) == "0.012%" and mfu_percent(None) == "no data"
    assert flops_per_second(5.0537e14) == "505 TFLOP/s" and flops_per_second(6.1e7) == "61 MFLOP/s"


def test_tokens_and_flops_per_second_of_a_short_run_are_its_counts_over_its_training_seconds() -> None:
    """A 40 s loop at 1,985 tokens/s: the rules' 1-minute rate of the young series read 1,125 (43% low); the
    report divides the exact counts by the rank's seconds in train."""
    data = _data(run_peak_flops=1e12, run_tokens_rate=1125.2, run_model_flops_rate=1125.2e7, run_mfu=0.011)
    rank = {"rank": "0", "instance": "n"}
    data.totals.update(tokens=[Series(rank, ((1100.0, 79400.0),))],
                       model_flops=[Series(rank, ((1100.0, 79400.0e7),))],
                       state_seconds=[Series({**rank, "state": "train"}, ((1100.0, 40.0),)),
                                      Series({**rank, "state": "setup"}, ((1100.0, 2.0),))])
    done = report.build(data, "http://prometheus").assessment.throughput
    assert done.tokens_per_second == pytest.approx(1985.0)
    assert done.flops_per_second == pytest.approx(1985.0e7) and done.mfu == pytest.approx(0.01985)
