"""What the hooks accept from the user: the counts of each step, the loader, and the settings."""

import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

import stepscope.hooks as th
from stepscope.hooks.config import Config
from stepscope.hooks.pusher import group_url
from stepscope_testkit.processes import free_port, running_exporter, sample_values, samples, scrape

RUN = {"run": "inputs", "rank": "0"}


def counted(tracker: th.Tracker) -> tuple[object, ...]:
    """Everything step() and micro_batch() count, as the next push would show it."""
    snap = tracker.snapshot()
    return snap.steps, snap.samples, snap.micro_batches, snap.tokens, snap.flops, snap.global_step


def test_a_negative_count_raises_at_the_call_and_the_rank_keeps_pushing(tmp_path: Path) -> None:
    """The exporter refuses a push that holds a negative counter: a count of -50 accepted would keep every
    later push of the rank out, its final idle too. It raises at the call, so the run goes on being seen;
    numpy's scalars stay numbers, counted as the plain ints and floats the exporter reads."""
    with running_exporter(tmp_path) as exporter:
        tracker = th.init(run="inputs", push_url=exporter.url, push_interval=0.1, handle_sigterm=False)
        tracker.step(samples=20)
        with pytest.raises(ValueError, match=r"^samples must be a finite number >= 0, got -50$"):
            tracker.step(samples=-50)
        with pytest.raises(ValueError, match=r"^tokens must be a finite number >= 0, got 1000000"):
            tracker.step(tokens=10**400)  # rendered +Inf: the exporter refused it ("counter must be >= 0, got inf")
        tracker.step(samples=np.int64(20), tokens=np.int32(6), flops=np.float32(2.5), global_step=np.int64(2))
        tracker.close()
        text = scrape(exporter.url)
    assert tracker.pusher.stats.failures == 0, tracker.pusher.stats.last_error
    assert sample_values(text, "stepscope_samples_total", **RUN) == [40]
    assert sample_values(text, "stepscope_steps_total", **RUN) == [2]
    assert sample_values(text, "stepscope_tokens_total", **RUN) == [6]
    assert sample_values(text, "stepscope_model_flops_total", **RUN) == [2.5]
    assert sample_values(text, "stepscope_training_global_step", **RUN) == [2]
    assert sample_values(text, "stepscope_training_state", state="idle", **RUN) == [1]


BAD_COUNTS = [  # (argument, value) for both step() and micro_batch()
    ("samples", -50),
    ("samples", "x"),
    ("samples", None),
    ("samples", True),
    ("samples", torch.tensor(4)),  # would render as "tensor(4)": no exporter takes that push
    ("tokens", -1),
    ("tokens", math.nan),
    ("tokens", math.inf),
    ("flops", -1e12),
    ("flops", -math.inf),
    ("flops", "1e12"),
    ("samples", 10**400),  # an int no float holds: rendered +Inf, which the exporter refuses in every later push
    ("tokens", 10**400),
    ("flops", 10**400),
    ("tokens", np.float64(math.inf)),
]
BAD_STEP_COUNTS = [("micro_batches", -1), ("micro_batches", 1.5j), ("global_step", -1), ("global_step", "7"),
                   ("micro_batches", 10**400), ("global_step", 10**400)]


@pytest.mark.parametrize(
    ("method", "argument", "value"),
    [("step", *case) for case in BAD_COUNTS + BAD_STEP_COUNTS] + [("micro_batch", *case) for case in BAD_COUNTS],
    ids=lambda value: repr(value)[:24],
)
def test_a_count_that_is_no_finite_number_at_least_zero_raises_before_anything_counts(
    method: str, argument: str, value: object
) -> None:
    tracker = th.init(run="inputs", push_url="", handle_sigterm=False, flops_per_sample=10)
    tracker.step(samples=4, tokens=8, global_step=1)
    before = counted(tracker)
    with pytest.raises(ValueError, match=f"^{argument} must be a finite number >= 0, got ") as raised:
        getattr(tracker, method)(**{argument: value})
    assert str(raised.value).endswith(f"got {value!r}")
    assert counted(tracker) == before
    tracker.close()


@pytest.mark.parametrize("method", ["step", "micro_batch"])
@pytest.mark.parametrize(("argument", "value"), [("flops", 1e308), ("samples", 10**308), ("tokens", 10**308)])
def test_a_count_that_would_take_the_total_past_what_a_push_holds_raises_and_pushes_go_on(
    tmp_path: Path, method: str, argument: str, value: float
) -> None:
    """Each count was checked alone: step(flops=1e308) twice made a total of inf, and the exporter refused every
    later push of the rank ("counter must be finite"), its final idle too. The call that would pass the largest
    float raises, nothing counted, and the rank's pushes land."""
    with running_exporter(tmp_path) as exporter:
        tracker = th.init(run="inputs", push_url=exporter.url, push_interval=60, handle_sigterm=False)
        getattr(tracker, method)(**{argument: value})
        before = counted(tracker)
        message = re.escape(f"{argument} of {value!r} would take the run's total past 1.798e+308, the largest")
        with pytest.raises(ValueError, match=f"^{message}"):
            getattr(tracker, method)(**{argument: value})
        assert counted(tracker) == before
        tracker.close()
        text = scrape(exporter.url)
    assert tracker.pusher.stats.failures == 0, tracker.pusher.stats.last_error
    assert sample_values(text, "stepscope_training_state", state="idle", **RUN) == [1]


@pytest.mark.parametrize(("argument", "value"), [("micro_batches", 1.5), ("global_step", 2.5),
                                               ("micro_batches", np.float64(0.25))])
def test_a_fraction_of_a_batch_or_of_a_global_step_raises(argument: str, value: object) -> None:
    """micro_batches and global_step count whole things: 1.5 was pushed as 1.5 batches, 2.5 as the trainer's step.
    A whole float is taken as the int it is."""
    tracker = th.init(run="inputs", push_url="", handle_sigterm=False)
    tracker.step(samples=4, global_step=1)
    before = counted(tracker)
    with pytest.raises(ValueError, match=f"^{argument} must be a whole number >= 0, got ") as raised:
        tracker.step(**{argument: value})
    assert str(raised.value).endswith(f"got {value!r}")
    assert counted(tracker) == before
    tracker.step(micro_batches=2.0, global_step=np.float32(3))
    assert counted(tracker) == (2, 4, 3, None, None, 3)
    assert [type(count) for count in counted(tracker)[2::3]] == [int, int]
    tracker.close()


def entered_phases(text: str) -> list[str]:
    """The phases the exporter says the rank is in (stepscope_training_phase_entered_timestamp_seconds)."""
    return [dict(labels)["phase"] for name, labels in samples(text)
            if name == "stepscope_training_phase_entered_timestamp_seconds" and ("run", RUN["run"]) in labels]


def wait_for_pushes(tracker: th.Tracker, count: int = 2) -> None:
    """Until `count` more pushes succeeded: the last of them holds what the training thread did before."""
    target = tracker.pusher.stats.successes + count
    deadline = time.monotonic() + 20
    while tracker.pusher.stats.successes < target:
        assert time.monotonic() < deadline, f"no push: {tracker.pusher.stats.last_error}"
        time.sleep(0.02)


def test_the_loader_phase_is_left_when_the_loader_runs_out(tmp_path: Path) -> None:
    """docs/exporter.md: the entered phase is absent between phases. The next() that finds the loader empty
    loads no batch: it is not observed (one dataloader_next per batch) and leaves the phase."""
    with running_exporter(tmp_path) as exporter:
        tracker = th.init(run="inputs", push_url=exporter.url, push_interval=0.05, handle_sigterm=False)

        def batches() -> Iterator[int]:
            yield 1
            wait_for_pushes(tracker)  # the training thread waits in next(): the exporter shows where
            assert entered_phases(scrape(exporter.url)) == ["dataloader_next"]
            yield 2

        for _ in tracker.loader(batches()):
            tracker.step(samples=1)
        wait_for_pushes(tracker)
        after_the_loader = scrape(exporter.url)
        tracker.close()
        after_close = scrape(exporter.url)
    assert entered_phases(after_the_loader) == []
    assert sample_values(after_the_loader, "stepscope_step_phase_seconds_count", phase="dataloader_next",
                         **RUN) == [2]
    assert entered_phases(after_close) == []
    assert sample_values(after_close, "stepscope_training_state", state="idle", **RUN) == [1]


# Per environment variable the hooks read: a bad text for it, then the same setting as an argument with the
# value that text stands for, and other settings either needs (rank against world size). The message shows
# the text as set, or what is wrong with it where that says more (SHOWN).
BAD_SETTINGS = [
    ("STEPSCOPE_RUN", "r" * 129, "run", "r" * 129, {}),
    ("STEPSCOPE_RUN", "resnet\ta", "run", "resnet\ta", {}),
    ("STEPSCOPE_RUN", "resnet-a\n", "run", "resnet-a\n", {}),
    ("STEPSCOPE_PUSH_URL", "localhost:9847", "push_url", "localhost:9847", {}),
    ("STEPSCOPE_PUSH_URL", "http://fd00::5", "push_url", "http://fd00::5", {}),  # no port: brackets needed
    # pushed to http://127.0.0.1:9847?x=1/metrics/job/..., the exporter's `/`: 405 at every push of the run
    ("STEPSCOPE_PUSH_URL", "http://127.0.0.1:9847?x=1", "push_url", "http://127.0.0.1:9847?x=1", {}),
    ("STEPSCOPE_PUSH_URL", "http://127.0.0.1:9847/#top", "push_url", "http://127.0.0.1:9847/#top", {}),
    # the scrape URL: pushed to /metrics/metrics/job/..., 404 at every push of the run
    ("STEPSCOPE_PUSH_URL", "http://127.0.0.1:9847/metrics", "push_url", "http://127.0.0.1:9847/metrics", {}),
    ("STEPSCOPE_PUSH_URL", "http://127.0.0.1:9847/metrics/job/stepscope", "push_url",
     "http://127.0.0.1:9847/metrics/job/stepscope", {}),
    ("STEPSCOPE_PUSH_TOKEN", "s3cr\u20act", "push_token", "s3cr\u20act", {}),
    ("STEPSCOPE_PUSH_INTERVAL", "0", "push_interval", 0.0, {}),
    ("STEPSCOPE_PUSH_INTERVAL", "nan", "push_interval", math.nan, {}),
    ("STEPSCOPE_PUSH_INTERVAL", "1e-9", "push_interval", 1e-9, {}),  # pushed flat out, a core at it
    ("STEPSCOPE_PUSH_INTERVAL", "1e10", "push_interval", 1e10, {}),  # killed the pusher thread (OverflowError)
    ("STEPSCOPE_BUCKETS", "0.5,0.1", "buckets", (0.5, 0.1), {}),
    ("STEPSCOPE_PHASE_BUCKETS", "maybe", "phase_buckets", "maybe", {}),
    ("STEPSCOPE_SHARE_BOUNDS", "maybe", "share_bounds", "maybe", {}),
    ("STEPSCOPE_TRACE_MAX_BYTES", "10", "trace_max_bytes", 10, {}),
    ("STEPSCOPE_TRACE_KEEP", "0", "trace_keep", 0, {}),
    ("STEPSCOPE_FLOPS_DTYPE", "int8", "flops_dtype", "int8", {}),
    ("STEPSCOPE_PEAK_FLOPS", "-1", "peak_flops", -1.0, {}),
    ("RANK", "4", "rank", 4, {"WORLD_SIZE": "4"}),
    ("LOCAL_RANK", "-1", "local_rank", -1, {}),
    ("WORLD_SIZE", "0", "world_size", 0, {}),
]
# Any text that is not blank is a usable directory path (a blank one is unset): the trace writer names the
# variable when it cannot write there (stepscope.hooks.profiling).
NO_BAD_TEXT = {"STEPSCOPE_TRACE_DIR"}
SHOWN = {("STEPSCOPE_RUN", "r" * 129): "got 129", ("STEPSCOPE_PUSH_TOKEN", "s3cr\u20act"): "U+20AC",
         ("STEPSCOPE_BUCKETS", "0.5,0.1"): "got 0.5 then 0.1",
         ("RANK", "4"): "RANK 4 must be smaller than WORLD_SIZE 4"}


def test_the_settings_cover_every_variable_the_hooks_read() -> None:
    """Every STEPSCOPE_* variable the settings read, and torchrun's, has its case (a new one needs one)."""
    read = set(re.findall(r"\bSTEPSCOPE_[A-Z_]+\b", Path(th.__file__).with_name("config.py").read_text()))
    assert {case[0] for case in BAD_SETTINGS} | NO_BAD_TEXT == read | {"RANK", "LOCAL_RANK", "WORLD_SIZE"}


@pytest.mark.parametrize(("variable", "text", "argument", "value", "other_env"), BAD_SETTINGS,
                         ids=[f"{case[0]}={case[1][:12]}" for case in BAD_SETTINGS])
def test_a_bad_setting_is_named_as_the_user_set_it(
    variable: str, text: str, argument: str, value: object, other_env: dict[str, str]
) -> None:
    """docs/hooks.md: bad settings raise ValueError with the variable's name. A value from the environment
    names the variable and shows its text; the same value passed to th.init names the argument."""
    with pytest.raises(ValueError) as from_env:
        Config.resolve(env={"STEPSCOPE_RUN": "r", **other_env, variable: text})
    message = str(from_env.value)
    assert message.startswith(f"{variable} "), message
    assert SHOWN.get((variable, text), f"got {text!r}") in message, message
    arguments = {key.lower(): int(raw) for key, raw in other_env.items()}
    with pytest.raises(ValueError) as from_argument:
        Config.resolve(env={"STEPSCOPE_RUN": "r"}, **arguments, **{argument: value})
    assert str(from_argument.value).startswith(f"{argument} "), str(from_argument.value)
    assert variable not in str(from_argument.value)


def test_a_second_open_tracker_for_the_same_rank_is_refused_and_the_first_keeps_its_steps(tmp_path: Path) -> None:
    """Two trackers pushing one run and rank replace each other's group at every push: the exporter read the
    steps 5, 10, ... 29, then 0, and after both closed 0 of 40. The second `init` raises while the first is
    open; another rank, or the same once the first is closed, starts."""
    with running_exporter(tmp_path) as exporter:
        first = th.init(run="twice", push_url=exporter.url, push_interval=0.1, handle_sigterm=False)
        for _ in range(40):
            first.step(samples=1)
        with pytest.raises(ValueError, match=r"^a tracker of this process already pushes run 'twice' rank 0: "):
            th.init(run="twice", push_url=exporter.url, push_interval=0.1, handle_sigterm=False)
        other_rank = th.init(run="twice", rank=1, world_size=2, push_url=exporter.url, handle_sigterm=False)
        other_rank.close()
        first.close()
        steps = sample_values(scrape(exporter.url), "stepscope_steps_total", run="twice", rank="0")
        th.init(run="twice", push_url=exporter.url, handle_sigterm=False).close()  # the first is closed
    assert steps == [40]


@pytest.mark.parametrize("spelling", ["http://localhost:{port}", "http://127.0.0.1:{port}/.", "http://LocalHost:{port}/",
                                      "http://[::1]:{port}", "http://0.0.0.0:{port}//"])
def test_another_spelling_of_the_same_exporter_is_the_same_rank(tmp_path: Path, spelling: str) -> None:
    """The check keyed on the push URL as written: http://localhost:P and http://127.0.0.1:P/. both got past it, and
    the second tracker's pushes replaced the first's steps at the exporter. Every name of this machine is one."""
    with running_exporter(tmp_path) as exporter:
        first = th.init(run="spelled", push_url=exporter.url, push_interval=60, handle_sigterm=False)
        first.step(samples=1)
        port = exporter.url.rsplit(":", 1)[1]
        with pytest.raises(ValueError, match=r"^a tracker of this process already pushes run 'spelled' rank 0: "):
            th.init(run="spelled", push_url=spelling.format(port=port), push_interval=60, handle_sigterm=False)
        elsewhere = th.init(run="spelled", push_url=f"http://localhost:{free_port()}", push_interval=60,
                            handle_sigterm=False)  # another port is another exporter
        elsewhere.close()
        first.close()
        assert sample_values(scrape(exporter.url), "stepscope_steps_total", run="spelled", rank="0") == [1]


# Run names at the edges of what a path carries and what the exporter takes: a backslash, non-ASCII,
# a `/`, the base64 marker, URL escapes and dot segments; then tabs, newlines, control characters, the
# Unicode separators that are not printable, and quotes (Grafana's dashboards cannot select such a run).
STORED_RUN_NAMES = ["back\\slash", "h\u00e9llo w\u00f6rld", "emoji\U0001f680", "a/b", "=",
                    "run@base64", "percent%2F", ".", "..", "x" * 128]
REFUSED_RUN_NAMES = ["tab\there", "line\nbreak", "trail\n", "ctl\x01", "del\x7f", "nbsp\xa0x", "ls\u2028x", 'a"b',
                     "it's"]


def test_init_takes_exactly_the_run_names_the_exporter_stores(tmp_path: Path) -> None:
    """A run name init accepted and the exporter refused at every push: "." and ".." went out as dot segments
    (`/metrics/job/stepscope/rank/0` once normalised, 404), a tab or a newline as text the exporter calls not
    printable (400). Now the dot segments go base64-encoded and are stored as they are; the others raise at
    init, naming the setting and the text, and the exporter refuses each of them too."""
    with running_exporter(tmp_path) as exporter:
        for run in STORED_RUN_NAMES:
            tracker = th.init(run=run, push_url=exporter.url, push_interval=60, handle_sigterm=False)
            tracker.step(samples=1)
            tracker.close()
            assert tracker.pusher.stats.failures == 0, (run, tracker.pusher.stats.last_error)
            assert sample_values(scrape(exporter.url), "stepscope_steps_total", run=run, rank="0") == [1], run
        for run in REFUSED_RUN_NAMES:
            with pytest.raises(ValueError, match=r"^run must be non-empty printable text") as raised:
                th.init(run=run, push_url=exporter.url, handle_sigterm=False)
            assert str(raised.value).endswith(f"got {run!r}")
            refused = requests.put(group_url(exporter.url, run, 0), data=b"", timeout=10)
            assert (refused.status_code, "must be non-empty printable text" in refused.text) == (400, True), run
        older_hooks = th.Tracker(Config.resolve(env={}, run="lead", push_url=""))  # init refuses " lead" now
        older_hooks.step(samples=1)
        stored = requests.put(group_url(exporter.url, " lead", 0), data=older_hooks.render(), timeout=10)
        older_hooks.close()
        assert stored.status_code < 300, stored.text
        assert sample_values(scrape(exporter.url), "stepscope_steps_total", run=" lead", rank="0") == [1]


@pytest.mark.parametrize("argument", ["rank", "local_rank", "world_size", "push_interval", "max_phases"])
def test_a_bool_is_no_count_of_ranks_or_seconds(argument: str) -> None:
    """True is an int to Python: th.init(rank=True, world_size=2) was taken and every push of the run went to
    .../rank/True, which the exporter refuses (400: 0 of 2 pushes taken); push_interval=True pushed every second."""
    others = {"world_size": 2} if argument == "rank" else {}
    with pytest.raises(ValueError) as refused:
        Config.resolve(env={"STEPSCOPE_RUN": "r"}, **others, **{argument: True})
    assert str(refused.value).startswith(f"{argument} must be"), str(refused.value)
    assert str(refused.value).endswith("got True"), str(refused.value)


@pytest.mark.parametrize(("variable", "text"), [
    ("RANK", "1_0"), ("RANK", "\u0661"), ("RANK", "+1"), ("LOCAL_RANK", "\u0662"), ("WORLD_SIZE", "1_6"),
    ("STEPSCOPE_TRACE_KEEP", "1_0"), ("STEPSCOPE_PUSH_INTERVAL", "1_0"), ("STEPSCOPE_PUSH_INTERVAL", "\u0665"),
    ("STEPSCOPE_BUCKETS", "0.1,1_0"), ("STEPSCOPE_PEAK_FLOPS", "1_000e12"),
])
def test_a_number_not_written_in_ascii_is_refused_naming_the_variable(variable: str, text: str) -> None:
    """int() and float() read `RANK=1_0` as rank 10, an Arabic-Indic one (U+0661) as rank 1 and `+1` as 1: a rank
    pushed as another one. Only ASCII numbers are taken (blanks around them are; a blank one is unset)."""
    with pytest.raises(ValueError, match=rf"^{variable} must be .*, got {re.escape(repr(text))}$"):
        Config.resolve(env={"STEPSCOPE_RUN": "r", "RANK": "0", "WORLD_SIZE": "32", variable: text})
    spaced = Config.resolve(env={"STEPSCOPE_RUN": "r", "RANK": " 3 ", "WORLD_SIZE": "4\n"})
    assert (spaced.rank, spaced.world_size) == (3, 4)


@pytest.mark.parametrize("run", ["trail ", " lead", "  both  "])
def test_a_run_name_with_blanks_at_its_ends_is_refused_at_init(run: str) -> None:
    """`trail ` and `trail` were two runs that Grafana's run list shows alike, each with half of the steps. init
    refuses such a name, from the environment or an argument; the exporter still stores what older hooks push."""
    with pytest.raises(ValueError, match=r"^STEPSCOPE_RUN must be a name without blanks at its start or end"):
        Config.resolve(env={"STEPSCOPE_RUN": run})
    with pytest.raises(ValueError, match=rf"^run must be a name without blanks .*, got {re.escape(repr(run))}$"):
        Config.resolve(env={}, run=run)
