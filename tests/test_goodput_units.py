"""The report's goodput accounting (stepscope.report.goodput) on hand-made query answers: causes from the
state and loader seconds, stalls from the recorded stall series, the restart gap from the push span, the
headline and the CSV. The end-to-end proof against injected truth is tests/test_goodput_e2e.py."""

import pytest

from stepscope.contract.goodput import DATA_WAIT, LOST_PROGRESS, PRODUCTIVE, REPORT_CAUSES, RESTART_GAP, STALLED
from stepscope.report.goodput import CSV_HEADER, account
from stepscope.report.prometheus import Series


def series(value: float, **labels: str) -> Series:
    return Series(labels, ((0.0, value),))


def totals(**extra: list[Series]) -> dict[str, list[Series]]:
    """Rank 0 on two nodes (it restarted elsewhere): 100 s of train, 30 s of it loading, 10 s setup,
    20 s checkpoint; pushes from t=1000 to t=1200 (200 s held, 70 s no process counted: a restart gap)."""
    answers = {
        "goodput_states": [series(90, rank="0", instance="a", state="train"),
                           series(10, rank="0", instance="b", state="train"),
                           series(10, rank="0", instance="a", state="setup"),
                           series(20, rank="0", instance="b", state="checkpoint")],
        "goodput_loading": [series(30, rank="0", instance="a")],
        "goodput_tokens": [series(4000, rank="0", instance="a")],
        "goodput_steps": [series(700, rank="0", instance="a")],
        "first_push": [series(1000, rank="0", instance="a"), series(1150, rank="0", instance="b")],
        "last_push": [series(1100, rank="0", instance="a"), series(1200, rank="0", instance="b")],
        "energy_joules": [series(72_000)],
    }
    return {**answers, **extra}


def test_causes_come_from_the_hooks_seconds_and_the_rest_of_the_span_is_a_restart_gap() -> None:
    good = account(totals(), [], ([], []), step=1, samples=800, window_start=0)
    assert good.held == 200
    assert good.seconds == {PRODUCTIVE: 70, DATA_WAIT: 30, STALLED: 0, LOST_PROGRESS: 0, "setup": 10, "eval": 0,
                            "checkpoint": 20, "idle": 0, RESTART_GAP: 70}
    assert good.goodput == pytest.approx(0.35)
    assert good.headline() == "goodput 35%: 35% restart gap, 15% data wait, 10% checkpoint, 5% setup"


def test_each_stall_counts_its_last_length_once_and_leaves_productive_time() -> None:
    """Two stalls of rank 0: one recorded at 5, 10, 15 s (then the series pauses), one at 3, 6 s."""
    stalls = [Series({"rank": "0", "instance": "a"},
                     ((10.0, 5.0), (11.0, 10.0), (12.0, 15.0), (40.0, 3.0), (41.0, 6.0)))]
    good = account(totals(), stalls, ([], []), step=1, samples=800, window_start=0)
    assert good.seconds[STALLED] == 21
    assert good.seconds[PRODUCTIVE] == 100 - 21 - 30


def test_a_stall_that_starts_right_after_another_is_a_new_one() -> None:
    stalls = [Series({"rank": "0"}, ((10.0, 5.0), (11.0, 6.0), (12.0, 1.0), (13.0, 2.0)))]
    assert account(totals(), stalls, ([], []), step=1, samples=800, window_start=0).seconds[STALLED] == 8


def test_steps_redone_after_a_restore_are_lost_progress_at_the_productive_time_per_step() -> None:
    """Rank 0 reached global step 500 on node a (started from 0); came back on node b restored from step
    420 (first scraped at 430, 10 steps in), reached 480; restarted again on b from 440: 80 + 40 steps done
    again, of 700 in the window at 0.1 s of productive time each (70 s over 700 steps)."""
    a, b = {"rank": "0", "instance": "a"}, {"rank": "0", "instance": "b"}
    steps = [Series(a, ((10.0, 100.0), (20.0, 500.0), (30.0, 500.0))),
             Series(b, ((25.0, 430.0), (26.0, 480.0), (27.0, 450.0), (28.0, 460.0)))]
    bases = [Series(a, ((10.0, 0.0), (20.0, 0.0), (30.0, 0.0))),
             Series(b, ((25.0, 420.0), (26.0, 420.0), (27.0, 440.0), (28.0, 440.0)))]
    good = account(totals(), [], (steps, bases), step=1, samples=800, window_start=0)
    assert good.seconds[LOST_PROGRESS] == pytest.approx(12.0)
    assert good.seconds[PRODUCTIVE] == pytest.approx(58.0)
    assert good.held == 200


def test_energy_per_kwh_sample_and_token() -> None:
    good = account(totals(), [], ([], []), step=1, samples=800, window_start=0)
    assert good.kwh == pytest.approx(0.02)
    assert good.joules_per_sample == 90
    assert good.joules_per_token == 18
    run = good.csv_rows()[-1]
    assert len(run) == len(CSV_HEADER) and run[0] == "all"
    assert dict(zip(CSV_HEADER, run, strict=True))["joules_per_token"] == 18


def test_a_run_without_gpus_or_tokens_has_no_energy_figures() -> None:
    good = account(totals(energy_joules=[], goodput_tokens=[]), [], ([], []), step=1, samples=800, window_start=0)
    assert good.energy_joules is None and good.kwh is None and good.joules_per_sample is None
    assert good.joules_per_token is None
    assert set(good.seconds) == set(REPORT_CAUSES)


def test_the_hooks_push_the_global_step_once_the_loop_passes_it() -> None:
    """The report's lost progress reads it: a restored run's global step goes back."""
    from stepscope.contract.families import TRAINING_GLOBAL_STEP
    from stepscope.hooks import init

    tracker = init(run="g", push_url="", handle_sigterm=False)
    try:
        tracker.step(samples=8)
        assert TRAINING_GLOBAL_STEP not in tracker.render()
        tracker.step(samples=8, global_step=41)
        tracker.step(samples=8)
        assert f"\n{TRAINING_GLOBAL_STEP} 41\n" in tracker.render()
    finally:
        tracker.close()


def test_a_window_inside_the_run_holds_each_rank_from_the_windows_start_not_its_process_start() -> None:
    """The window starts at 1050, 50 s after rank 0's Tracker started; its states' seconds count inside the window
    only (130 s). Before, the span ran from 1000: 200 s held, and the 50 s before the window a restart gap (70 s)."""
    good = account(totals(), [], ([], []), step=1, samples=800, window_start=1050)
    assert good.held == 150
    assert good.seconds[RESTART_GAP] == 20
