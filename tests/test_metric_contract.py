"""The README's metric table is the contract: a real scrape publishes exactly the families it lists.

Every collector runs (the fake NVML with an H100 for GPM and NVLink, a GH200 for C2C, a throttled
A100 with an XID, this test process holding GPU memory) and real training hooks push, after measuring
their limits and taking a profiler trace on request, so every documented family has data.
"""

import os
import re
import subprocess
import time
from pathlib import Path

import torch  # noqa: F401  (the profiler trace needs torch in the process; the hooks never import it)
from prometheus_client.parser import text_string_to_metric_families

import training_hooks
from tests.fake_nvml.scenario import make_gpu, write_scenario
from tests.support.processes import REPO_ROOT, running_exporter, scrape
from tests.support.traces import rank_tracing, request_state, request_trace, wait_until

GIB = 1024**3


def readme_metric_names() -> set[str]:
    section = (REPO_ROOT / "README.md").read_text().split("<!-- section: exporter -->")[1]
    section = section.split("<!-- /section: exporter -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `stepscope_")]
    return {name for row in rows for name in re.findall(r"`(stepscope_\w+)`", row.split("|")[1])}


def scraped_metric_names(text: str) -> set[str]:
    """Family names as written in the exposition (counters with `_total`, histograms bare)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def wait_for_every_family(url: str, wanted: set[str], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(url)
        if wanted <= scraped_metric_names(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.3)


def test_a_full_scrape_publishes_exactly_the_readme_families(tmp_path: Path) -> None:
    documented = readme_metric_names()
    assert len(documented) > 50, "the README table was not found or lost rows"
    scenario = {
        "driver_version": "550.54.15",
        "gpus": [
            make_gpu(0, "H100", processes=[(os.getpid(), 2 * GIB)]),
            make_gpu(1, "A100", throttle=["sw_power_cap"]),
            make_gpu(2, "GH200"),
        ],
        "xid_events": [{"gpu": 1, "xid": 79}],
    }
    with running_exporter(tmp_path, fake_nvml_scenario=write_scenario(tmp_path / "nvml.json", scenario)) as exporter:
        tracker = training_hooks.init(run="contract", rank=0, push_url=exporter.url, push_interval=0.2,
                                      trace_dir=str(tmp_path / "traces"))
        tracker.measure_limits([[1, 2]] * 6, lambda batch: None, batches=2)
        wait_until(lambda: rank_tracing(exporter.url, "contract", 0) == "ready", 30, "the first push")
        trace = request_trace(exporter.url, "contract", 0, steps=1)
        for batch in tracker.loader(range(200)):
            with tracker.phase("forward"):
                sum(range(1000 + batch))
            tracker.step(samples=8)
            if request_state(exporter.url, trace)["state"] in ("done", "failed"):
                break
            time.sleep(0.05)
        tracker.close()
        text = wait_for_every_family(exporter.url, documented)
    published = scraped_metric_names(text)
    assert published - documented == set(), "published but not in the README table"
    assert documented - published == set(), "in the README table but not published"
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
