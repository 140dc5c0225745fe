"""stepscope_contract is the metric contract (the README's table is generated from it): a real scrape
publishes exactly its families, each with the contract's type and labels.

Every collector runs (the fake NVML with an H100 for GPM and NVLink, a GH200 for C2C, a throttled
A100 with an XID, this test process holding GPU memory) and real training hooks push, after measuring
their limits and taking a profiler trace on request, so every documented family has data.
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (the profiler trace needs torch in the process; the hooks never import it)
from prometheus_client.parser import text_string_to_metric_families

import stepscope.hooks
import stepscope.hooks.tracker
from stepscope.contract import FAMILIES, families
from stepscope_testkit.fake_cuda import FakeCuda
from stepscope_testkit.fake_nvml.scenario import make_gpu, write_scenario
from stepscope_testkit.processes import running_exporter, scrape
from stepscope_testkit.traces import rank_tracing, request_state, request_trace, wait_until

GIB = 1024**3


def scraped_families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Family name as written in the exposition (counters with `_total`, histograms bare) -> (type, labels)."""
    return {
        family.name + "_total" if family.type == "counter" else family.name:
            (family.type, {label for sample in family.samples for label in sample.labels} - {"le"})
        for family in text_string_to_metric_families(text)
    }


def families_with_samples(text: str) -> set[str]:
    """The names (as scraped_families writes them) of the families that hold at least one sample: a
    collector publishes its families' HELP and TYPE before it has anything to put in them (the process
    families before the first push registered a process)."""
    return {family.name + "_total" if family.type == "counter" else family.name
            for family in text_string_to_metric_families(text) if family.samples}


def wait_for_every_family(url: str, wanted: set[str], timeout: float = 30.0) -> str:
    """A scrape in which every wanted family holds samples, or the last one tried."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(url)
        if wanted <= families_with_samples(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.3)


def test_a_full_scrape_publishes_exactly_the_contract_families(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    documented = set(FAMILIES) - {families.TLS_CERTIFICATE_EXPIRY}  # only with TLS: tests/test_web_attacks.py
    documented -= {families.GPU_POD_INFO, families.PROCESS_POD_INFO}  # Kubernetes only: tests/test_pod_attribution.py
    scenario = {
        "driver_version": "550.54.15",
        "gpus": [
            make_gpu(0, "H100", processes=[(os.getpid(), 2 * GIB)]),
            make_gpu(1, "A100", throttle=["sw_power_cap"]),
            make_gpu(2, "GH200"),
        ],
        "xid_events": [{"gpu": 1, "xid": 79}],
    }
    cuda = FakeCuda()  # the allocator's families come from a process on CUDA
    cuda.allocators[0].allocate(3 * GIB)
    monkeypatch.setattr(stepscope.hooks.tracker, "_cuda_module", lambda: cuda)
    with running_exporter(tmp_path, fake_nvml_scenario=write_scenario(tmp_path / "nvml.json", scenario)) as exporter:
        tracker = stepscope.hooks.init(run="contract", rank=0, push_url=exporter.url, push_interval=0.2,
                                      trace_dir=str(tmp_path / "traces"), flops_per_step=6e9,
                                      peak_flops=989.4e12)
        tracker.measure_limits([[1, 2]] * 6, lambda batch: None, batches=2)
        wait_until(lambda: rank_tracing(exporter.url, "contract", 0) == "ready", 30, "the first push")
        trace = request_trace(exporter.url, "contract", 0, steps=1)
        for batch in tracker.loader(range(200)):
            with tracker.phase("forward"):
                sum(range(1000 + batch))
            tracker.step(samples=8, tokens=8 * 512, global_step=tracker.steps + 1)  # as a framework passes it
            if request_state(exporter.url, trace)["state"] in ("done", "failed"):
                break
            time.sleep(0.05)
        with tracker.phase("forward"):  # a push inside a phase publishes the phase it is in (none once closed)
            text = wait_for_every_family(exporter.url, documented)
        tracker.close()
    published = scraped_families(text)
    assert set(published) - documented == set(), "published but not in stepscope_contract"
    assert documented - set(published) == set(), "in stepscope_contract but not published"
    for name, (type_, labels) in published.items():
        spec = FAMILIES[name]
        assert type_ == spec.type, name
        assert set(spec.labels) <= labels <= set(spec.labels + spec.optional), name
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
