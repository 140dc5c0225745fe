"""A Lightning fit restored from an earlier checkpoint in the same process (`trainer.fit(..., ckpt_path=...)` after a
first fit with the same StepscopeCallback), pushed to a real exporter scraped by a real Prometheus with the shipped
rules, and read by the report: the steps lost are the ones the second fit does again, not those plus the first fit's.
"""

import csv
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings
from stepscope_testkit.processes import REPO_ROOT, running_exporter, sample_values
from tests.support.prometheus import query, running_prometheus, wait_for
from tests.test_hooks_clock import Items, working_module

RUN = "restore-same-process"
FIRST_STEPS = 6  # the first fit's; it saves every 2 steps
RESTORED_FROM = 2  # the checkpoint the second fit restores
SECOND_STEPS = 4  # where the second fit stops: still behind the first's 6, catching up


def recorded(prometheus: str, expr: str) -> float | None:
    found = query(prometheus, expr)
    return float(found[0]["value"][1]) if found else None


def trainer(pl: Any, root: Path, callback: Any, max_steps: int, checkpoints: Any = None) -> Any:
    callbacks = [callback] if checkpoints is None else [callback, checkpoints]
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", enable_progress_bar=False, logger=False,
                      enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0,
                      enable_checkpointing=checkpoints is not None, callbacks=callbacks)


@pytest.fixture(scope="module")
def restored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Fit 1 to step 6 (checkpoints at 2, 4, 6), then fit 2 from the checkpoint at step 2 to step 4: Prometheus
    scrapes throughout; yields its URL and the report's directory."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stepscope.hooks.lightning import StepscopeCallback

    tmp = tmp_path_factory.mktemp("restore")
    with running_exporter(tmp) as exporter, \
            running_prometheus(tmp, {"node-a": exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        assert wait_for(lambda: query(prometheus.url, "up == 1"), 30), "Prometheus does not scrape the exporter"
        callback = StepscopeCallback(run=RUN, push_url=exporter.url, push_interval=0.5, handle_sigterm=False)
        module = working_module(pl)()
        saves = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer(pl, tmp, callback, FIRST_STEPS, saves).fit(module, DataLoader(Items(16, []), batch_size=2))
        reached = f'{recordings.RUN_GLOBAL_STEP_MIN}{{run="{RUN}"}}'
        assert wait_for(lambda: recorded(prometheus.url, reached) == FIRST_STEPS, 20), "fit 1's step not recorded"
        trainer(pl, tmp, callback, SECOND_STEPS).fit(module, DataLoader(Items(16, []), batch_size=2),
                                                     ckpt_path=tmp / "ckpt" / f"step={RESTORED_FROM}.ckpt")
        now = f'{recordings.RANK_GLOBAL_STEP}{{run="{RUN}"}}'
        assert wait_for(lambda: recorded(prometheus.url, now) == SECOND_STEPS, 20), "fit 2's step not recorded"
        time.sleep(2)  # the run rules evaluated on it
        report = tmp / "report"
        result = subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", prometheus.url,
                                 "--run", RUN, "--out", str(report)], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        yield prometheus.url, report


def test_the_rules_record_the_steps_done_again_since_the_checkpoint(restored: tuple[str, Path]) -> None:
    """6 - 2 = 4 steps lost; before the fix 10: the first fit's 6 steps were taken for the second's, so the
    second seemed to start from step 4 - 8 = -4."""
    prometheus, _ = restored
    steps = query(prometheus, f'{families.TRAINING_GLOBAL_STEP}{{run="{RUN}"}}[10m]')
    pushed = [int(float(value)) for series in steps for _, value in series["values"]]
    assert max(pushed) == FIRST_STEPS and pushed[-1] == SECOND_STEPS
    lost = recorded(prometheus, f'{recordings.RUN_STEPS_REDONE}{{run="{RUN}"}}')
    assert lost == FIRST_STEPS - RESTORED_FROM


def test_the_report_counts_the_restore_as_lost_progress(restored: tuple[str, Path]) -> None:
    """The report's lost progress is the productive time of the steps done again: some, where before the fix it
    saw no restore at all (the rank's own step count never went back)."""
    prometheus, report = restored
    with (report / "goodput.csv").open() as rows:
        run = {row["rank"]: row for row in csv.DictReader(rows)}["all"]
    print({key: value for key, value in run.items() if key.endswith("_seconds")})
    scraped = {name: [(round(float(t), 1), value) for series in query(prometheus, f'{name}{{run="{RUN}"}}[10m]')
                      for t, value in series["values"]]
               for name in (families.TRAINING_GLOBAL_STEP, families.TRAINING_GLOBAL_STEP_START, families.STEPS_TOTAL)}
    with (report / "run_summary.csv").open() as rows:
        window = {key: value for key, value in next(csv.DictReader(rows)).items()
                  if key in ("start", "end", "resolution_seconds", "steps")}
    assert float(run["lost_progress_seconds"]) > 0, f"{run}\nwindow {window}\n{scraped}"


def test_a_plain_loop_that_restores_in_its_process_pushes_where_its_steps_count_from() -> None:
    """step(global_step=...) 1..6, then back to 3 (restored from the checkpoint at 2) and 4: the start pushed is 0,
    then 2; the global step less the steps (4 - 8 = -4) is what the rules took before."""
    import stepscope.hooks

    tracker = stepscope.hooks.init(run="plain-restore", push_url="", handle_sigterm=False)
    for global_step in range(1, FIRST_STEPS + 1):
        tracker.step(samples=1, global_step=global_step)
    before = sample_values(tracker.render(), families.TRAINING_GLOBAL_STEP_START)
    for global_step in range(RESTORED_FROM + 1, SECOND_STEPS + 1):
        tracker.step(samples=1, global_step=global_step)
    tracker.close()
    text = tracker.render()
    assert before == [0]
    assert sample_values(text, families.TRAINING_GLOBAL_STEP) == [SECOND_STEPS]
    assert sample_values(text, "stepscope_steps_total") == [FIRST_STEPS + SECOND_STEPS - RESTORED_FROM]
    assert sample_values(text, families.TRAINING_GLOBAL_STEP_START) == [RESTORED_FROM]


def test_a_checkpoint_of_a_fit_that_went_on_from_an_earlier_one_restores_the_runs_global_step(tmp_path: Path) -> None:
    """A new Trainer's fit after a first one goes on from its global step (3 steps, then 4, 5, 6, saving at each); a
    fit restored from that second fit's checkpoint at its own step 1 is at the run's step 4: it pushes 5, and the
    steps lost are 6 - 4 = 2. Before, the restored fit dropped the offset and pushed its trainer's 2 from 1: 5 lost."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stepscope.hooks.lightning import StepscopeCallback

    callback = StepscopeCallback(run="restore-offset", push_url="", handle_sigterm=False)
    module = working_module(pl)()

    def fit(steps: int, checkpoints: Any = None, ckpt_path: Path | None = None) -> None:
        trainer(pl, tmp_path, callback, steps, checkpoints).fit(module, DataLoader(Items(16, []), batch_size=2),
                                                               ckpt_path=ckpt_path)

    fit(3)
    fit(3, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"))
    assert sample_values(callback.tracker.render(), families.TRAINING_GLOBAL_STEP) == [6]
    fit(2, ckpt_path=tmp_path / "ckpt" / "step=1.ckpt")
    text = callback.tracker.render()
    assert sample_values(text, families.TRAINING_GLOBAL_STEP) == [5]
    assert sample_values(text, families.TRAINING_GLOBAL_STEP_START) == [4]
