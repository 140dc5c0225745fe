"""Makes the README's pictures of a real report: `PYTHONPATH=. .venv/bin/python scripts/report_pictures.py`.

Starts the exporter (with the test suite's scripted fake NVML: this machine has no GPU), a Prometheus
with the shipped rules, and two demo runs that end by themselves: `ddp`, 4 synchronous ranks on gloo
with rank 2 slow in forward, and `data`, one rank with a slow loader; both evaluate now and then.
Then builds their reports with stepscope-report and photographs parts of the pages in headless
Chromium into docs/report/. About five minutes.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grafana.rules import RULE_FILES
from stepscope_testkit.fake_nvml.scenario import write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.browser import headless_chromium
from tests.support.demos import gpus_for_runs, start_ddp_demos, start_demo, stop
from tests.support.prometheus import query, running_prometheus, wait_for

OUT = REPO_ROOT / "docs" / "report"
NODE = "gpu-node-1"
GIB_30 = 30 * 1024**3  # GPU memory each rank holds
# GPU -> (NVML utilization %, SM active %, holder): the DDP ranks' GPUs busy, the data run's starved
LAYOUT = {0: (31, 22, ("data", 0)), **{1 + r: (97, 90 - 3 * r, ("ddp", r)) for r in range(4)}}
PICTURES = {  # file -> CSS selector of the element photographed, in the ddp or data report
    "verdict-ddp.png": ("ddp", ".verdict"),
    "verdict-data.png": ("data", ".verdict"),
    "gantt-ddp.png": ("ddp", 'img[alt^="Gantt"]'),
    "phases-ddp.png": ("ddp", 'img[alt^="Seconds per step"]'),
    "step-time-data.png": ("data", 'img[alt^="Step time"]'),
}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stepscope-pictures-"))
    nvml = write_scenario(tmp / "nvml.json", gpus_for_runs(LAYOUT, {}, GIB_30))
    with running_exporter(tmp, fake_nvml_scenario=nvml) as exporter, \
            running_prometheus(tmp, {NODE: exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        demos = {
            ("data", 0): start_demo("data", 0, 1, exporter.url, tmp / "data-0.log", "--steps", "3600",
                                    "--slow-loader", "0.05", "--eval-every", "1200", "--eval-seconds", "12"),
            **start_ddp_demos("ddp", 4, exporter.url, tmp, "--steps", "4000", "--slow-rank", "2",
                              "--extra-step-seconds", "0.03", "--eval-every", "1500", "--eval-seconds", "12"),
        }
        try:
            write_scenario(nvml, gpus_for_runs(LAYOUT, {key: proc.pid for key, proc in demos.items()}, GIB_30))
            for key, proc in demos.items():
                if proc.wait(timeout=600) != 0:
                    sys.exit(f"demo {key} failed: {(tmp / f'{key[0]}-{key[1]}.log').read_text()}")
        finally:
            stop(demos.values())
        wait_for(lambda: len(query(prometheus.url, 'stepscope_training_state{state="idle"} == 1')) == 5, 30)
        time.sleep(3)
        for run in ("ddp", "data"):
            subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", prometheus.url, "--run", run,
                            "--out", str(tmp / run)], check=True)
    OUT.mkdir(parents=True, exist_ok=True)
    with headless_chromium(tmp) as browser:
        for name, (run, selector) in PICTURES.items():
            browser.get((tmp / run / "index.html").as_uri())
            element = browser.find_element("css selector", selector)
            browser.execute_script("arguments[0].scrollIntoView()", element)
            (OUT / name).write_bytes(element.screenshot_as_png)
            print(OUT / name)


if __name__ == "__main__":
    main()
