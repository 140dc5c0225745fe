"""The Tracker: phases, step boundaries and state of one training process, plus its pusher.

Use one Tracker per process, from the training thread only (histograms have a single writer; see
`timing`). The pusher thread only reads, through `snapshot()`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import numbers
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from time import perf_counter_ns, time
from typing import Any

import psutil

from stepscope.contract.training import (
    CHECKPOINT_STATE,
    EVAL_STATE,
    IDLE_STATE,
    SETUP_STATE,
    STATES,
    TRAIN_STATE,
)
from stepscope.hooks.config import Config, validate_phase_name
from stepscope.hooks.cuda import CudaPhase, CudaTimer, SyncCudaPhase
from stepscope.hooks.cuda_memory import read_allocator
from stepscope.hooks.flops import count_flops
from stepscope.hooks.limits import DEFAULT_WARMUP_STEPS, Limits, measure
from stepscope.hooks.profiling import TraceSettings, TraceTaker
from stepscope.hooks.pusher import Pusher, group_url, push_target
from stepscope.hooks.render import Snapshot, render
from stepscope.hooks.run_bounds import STEP_HISTOGRAM, RunBounds, run_store
from stepscope.hooks.signals import FinalPushOnSigterm
from stepscope.hooks.timing import NULL_PHASE, Histogram, HostPhase, NullPhase

log = logging.getLogger("stepscope.hooks")

Phase = HostPhase | CudaPhase | SyncCudaPhase | NullPhase
BoundaryHook = Callable[[int], None]  # called at each step boundary with the step's duration in ns
_PLAIN = (int, float)  # counts of these types pass step()'s cheap test; any other goes through _counts
# The largest count: the exposition writes counts as floats, and a Python int above the largest finite float
# (step(tokens=10**400)) renders as +Inf, which the exporter refuses in every later push. As an int for ints
# (compared with ints: the cheap test's int counts are checked through their sum, one comparison), as a float
# for floats (a NaN or an infinity fails it; an int compares with it exactly).
_MAX_COUNT = int(sys.float_info.max)
_MAX_FLOAT = sys.float_info.max
_OPTIONAL_COUNTS = frozenset({"flops", "global_step"})  # None: not given
_WHOLE_COUNTS = frozenset({"micro_batches", "global_step"})  # a fraction of either is a caller's bug
_OUTSIDE_TRAIN = frozenset({EVAL_STATE, CHECKPOINT_STATE})  # what the loop leaves train for, and comes back
GroupKey = tuple[str, str, int]  # where a tracker pushes: (push_target of its push URL, run, rank)
# The trackers of this process that push, by where. Weak: an open tracker is held by its atexit close anyway,
# and a closed one the user dropped is not kept for this.
_pushing: weakref.WeakValueDictionary[GroupKey, Tracker] = weakref.WeakValueDictionary()


def _group_key(config: Config) -> GroupKey:
    return push_target(config.push_url), config.run, config.rank


def check_unclaimed(config: Config, mine: Tracker | None = None) -> None:
    """ValueError when a tracker of this process other than `mine` is open and pushes config's run and rank:
    both would replace the exporter's group at each push, its steps read as 40, 0, 40 (counter resets) and the
    last to close would win."""
    other = _pushing.get(_group_key(config))
    if config.push_url and other is not None and other is not mine and not other.closed:
        raise ValueError(f"a tracker of this process already pushes run {config.run!r} rank {config.rank}: pass it "
                         "to the framework callback (tracker=...) or close() it before starting another")


def _cuda_module() -> Any | None:
    """torch.cuda when torch is already imported and sees a GPU; never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:
        return None


def _not_compiling() -> bool:
    return False


def _dynamo_check() -> Callable[[], bool]:
    """torch.compiler.is_dynamo_compiling where torch is already imported, else a function that says False.

    Eager, it returns False; while torch.compile traces a function, dynamo folds it to True. Never imports torch.
    """
    torch = sys.modules.get("torch")
    check = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None)
    return check if callable(check) else _not_compiling


@functools.cache
def _start_time(pid: int) -> str | None:
    """The process's creation time in Unix seconds, None where psutil cannot read it.

    It lets the exporter find this process when it sees another pid namespace: psutil derives it from
    boot time and the start ticks in /proc/<pid>/stat, which are the same seen from either namespace.
    """
    try:
        return f"{psutil.Process(pid).create_time():.3f}"
    except (psutil.Error, OSError):
        return None


@functools.cache
def _pid_namespace(pid: int) -> str | None:
    """The inode of this process's pid namespace, None off Linux; cached per pid, which a fork changes.

    Two pods' training processes are both pid 1 in their own namespaces, and started together they share
    the start time to the clock tick: the exporter tells them apart by this.
    """
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def _counts(**counts: Any) -> tuple[Any, ...]:
    """The counts passed to `step()` or `micro_batch()`, in order, as plain ints or floats (numpy's scalars
    too); ValueError naming the first that is not a finite number >= 0 (flops and global_step may be None), or
    not a whole one for micro_batches and global_step (2.0 is taken as 2; 1.5 was pushed as 1.5 batches).

    The exporter refuses a whole push that holds a negative or non-finite counter, so one bad count would
    keep every later push of the rank (its final `idle` too) out: the call that passes it fails instead,
    before anything is counted. Called only when the callers' one cheap test of plain ints and floats fails.
    """
    plain_counts = []
    for name, value in counts.items():
        if value is None and name in _OPTIONAL_COUNTS:
            plain_counts.append(None)
            continue
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            plain = int(value) if isinstance(value, numbers.Integral) else float(value)
            if 0 <= plain <= _MAX_FLOAT:  # False for a NaN, an infinity and an int no float holds
                if name in _WHOLE_COUNTS and plain != int(plain):
                    raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
                plain_counts.append(int(plain) if name in _WHOLE_COUNTS else plain)
                continue
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return tuple(plain_counts)


class _StateScope:
    """Returned by `Tracker.state`: `with tracker.state("eval"):` restores the previous state on exit.

    While a `with` block of eval or checkpoint is open the loop is outside training on purpose, so a `tracker.loader()`
    started in it is that state's (a validation set's), not the training loader (`Tracker.loader`)."""

    __slots__ = ("_outside", "_previous", "_tracker")

    def __init__(self, tracker: Tracker, previous: str, outside: bool) -> None:
        self._tracker = tracker
        self._previous = previous
        self._outside = outside

    def __enter__(self) -> _StateScope:
        if self._outside:
            self._tracker._outside_scopes += 1
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Goes back to the previous state, unless the tracker was closed meanwhile (SIGTERM in an eval, whose earlier
        handler exits): it stays idle. Going back to train there warned that the loop trained after close()."""
        if self._outside:
            self._tracker._outside_scopes -= 1
        if not self._tracker.closed:
            self._tracker.state(self._previous)


class Tracker:
    def __init__(self, config: Config, store: object | None = None) -> None:
        """`store`: a torch.distributed Store the run's ranks share, for agreeing on step-time bounds
        (stepscope.hooks.run_bounds); by default the default process group's, once there is one."""
        self.config = config
        self._pid = os.getpid()
        self._histograms: dict[str, Histogram] = {}
        # Copy-on-write tuple of (name, timing, histogram): the pusher iterates it while the training
        # thread may add a phase. timing says what the histogram holds: host, cuda_event or cuda_sync.
        self._phase_order: tuple[tuple[str, str, Histogram], ...] = ()
        self._timing: dict[str, str] = {}
        self._host: dict[str, Phase] = {}
        self._gpu: dict[str, Phase] = {}
        # What phase() looks names up in: the phases themselves in train (and setup, idle); in eval and checkpoint a
        # copy where only the phases open when the loop left train are themselves (_time_phases_entered).
        self._host_lookup = self._host
        self._gpu_lookup = self._gpu
        self._warned_limit = False
        self._dynamo_compiling = _dynamo_check()  # looked up again at each new phase: torch may come after init
        self._compiled_phase = ""  # a phase that torch.compile traced, which then times nothing (warned once)
        self._warned_compiled = False
        self._run_bounds = self._agree_on_bounds(store)
        self._step_hist = self._new_histogram(STEP_HISTOGRAM, buckets=True)
        self._steps = 0
        self._samples = 0
        self._micro_batches = 0
        self._tokens = 0
        self._global_step: int | None = None  # the trainer's, once step() is given it
        # The global step this process's steps count from (pushed with it): where the last step back of the global
        # step (a restore, in this process too) started, else its global step less its steps; and the steps
        # counted before that restore. The rules and the report took it as global step less steps, which after a
        # restore in the same process (the steps counter goes on) counted the fits before in the steps done again.
        self._global_step_start: int | None = None
        self._steps_before_restore = 0
        self._flops: float = 0  # model FLOPs done (an int while every addend is)
        self._flops_per_step = config.flops_per_step
        self._flops_per_sample = config.flops_per_sample
        self._counts_flops = bool(self._flops_per_step or self._flops_per_sample)
        self._boundary = perf_counter_ns()
        # How long after the step clock's start the last micro-batch of the step under way was counted (0: none): the
        # rank's last progress, pushed as its last step's time, so that a step of many micro-batches (gradient
        # accumulation) longer than the stall alert's floor does not read as a stall while its micro-batches go on.
        self._micro_batch_ns = 0
        # When the loop left train for eval or a checkpoint with a step under way (None: it did not, or a
        # setup/idle since ended it): re-entering train moves the step clock on by the time spent outside.
        self._left_train: int | None = None
        self._outside_scopes = 0  # open `with tracker.state(...)` blocks of eval or checkpoint (_StateScope)
        self._state = SETUP_STATE
        # Time per state: nanoseconds of the states left, and when the current one began. The pusher reads
        # them under the lock, so each state's total only grows from push to push (a counter).
        self._state_ns = dict.fromkeys(STATES, 0)
        self._state_since = self._boundary
        self._state_lock = threading.Lock()
        self._cuda_timer: CudaTimer | None = None
        # The trace taker's boundary call while a profiler trace is requested or recording (profiling).
        self._tracing: BoundaryHook | None = None
        # What step() calls with the step's duration: the CUDA timer's step_done once GPU phases exist,
        # the trace taker's boundary while armed, both, or None. One test on the hot path, as before
        # on-demand traces existed (benchmarks/results/profile.md); set by _update_boundary_hook only.
        self._at_boundary: BoundaryHook | None = None
        self._boundary_lock = threading.Lock()  # the pusher thread arms, the training thread adds CUDA
        self._limits: Limits | None = None
        self._closed = False
        self._warned_closed = False  # a loop trained on after close() was told so, once per close
        self.pusher: Pusher | None = None
        self.traces: TraceTaker | None = None
        if config.push_url:
            settings = TraceSettings(config.trace_dir, config.trace_max_bytes, config.trace_keep)
            self.traces = TraceTaker(config.run, config.rank, settings, self._arm_tracing)
            _pushing[_group_key(config)] = self
        self._sigterm = FinalPushOnSigterm(self.close)
        self._start_reporting()
        self._log_run()

    def _log_run(self) -> None:
        """One line (INFO) saying which run this process is and how to name it: a name the hooks chose (the script's,
        the notebook's) is the one the dashboards list, and another process of the node pushing it is refused."""
        config = self.config
        named = config.from_env.get("run", ("run=",))[0]
        how = f"the run ({named}) is" if named in ("run=", "STEPSCOPE_RUN") else f"{named} is"
        pushing = f"pushing every {config.push_interval:g} s" if config.push_url else "not pushing"
        log.info("stepscope: %s %r; rank %d of %d, %s", how, config.run, config.rank, config.world_size, pushing)

    def _start_reporting(self) -> None:
        """Starts pushing (and agreeing on bounds), and the final push at exit and on SIGTERM."""
        config = self.config
        if self.traces is not None:  # it pushes (a push URL is set)
            self.pusher = Pusher(
                group_url(config.push_url, config.run, config.rank), self.render, config.push_interval,
                token=config.push_token, timeout=config.push_timeout, max_backoff=config.max_backoff,
                headers=self._push_headers, on_answer=self._on_push_answer,
            )
            self.pusher.start()
        if self._run_bounds is not None:
            self._run_bounds.start()
        atexit.register(self.close)
        if config.handle_sigterm:
            self._sigterm.install()

    def _push_headers(self) -> dict[str, str]:
        """What a push says besides its body: the profiler's status and, without a store, the bounds wanted."""
        traces = self.traces.headers() if self.traces is not None else {}
        return {**traces, **(self._run_bounds.headers() if self._run_bounds is not None else {})}

    def _on_push_answer(self, headers: Mapping[str, str]) -> None:
        """Hands a push's answer to the profiler and to the bounds agreement."""
        if self.traces is not None:
            self.traces.on_answer(headers)
        if self._run_bounds is not None:
            self._run_bounds.on_answer(headers)

    # -- hot path ---------------------------------------------------------------------------------

    def phase(self, name: str, cuda: bool = False) -> Phase:
        """The reusable timer for `name`: `with tracker.phase("forward", cuda=True): ...`.

        cuda=True times with CUDA events when torch.cuda is available (host wall time otherwise).
        """
        if self._dynamo_compiling():  # inside a function that torch.compile traces; eager, one call
            return self._traced_phase(name)
        found = (self._gpu_lookup if cuda else self._host_lookup).get(name)
        return found if found is not None else self._new_phase(name, cuda)

    def _traced_phase(self, name: str) -> Any:
        """What `phase()` gives code that torch.compile traces: a phase that times nothing, noted for one warning.

        A timed phase there is a clock that dynamo cannot trace (time.perf_counter_ns), and a graph break inside a
        `with` block makes dynamo run the whole function eagerly: a compiled training step with its phases inside
        compiled no graph at all (1 graph without them), silently as slow as eager. Its time is the step's still.
        """
        self._compiled_phase = name
        return contextlib.nullcontext()  # made inside the traced code: the one kind dynamo enters and breaks in

    def step(self, samples: int = 0, micro_batches: int = 1, tokens: int = 0, flops: float | None = None,
             global_step: int | None = None) -> None:
        """Marks a step boundary: observes the whole step's wall time, counts the step, its samples and tokens.

        A step is one optimizer step. `micro_batches` is how many batches it fed the model (more than 1
        under gradient accumulation; `micro_batch()` counts them one by one instead). The first step in
        state setup means the loop trains (state train); when it began is unknown (setup time would be
        in it), so its time is not observed. `flops` are the model FLOPs the step did; None counts the stated
        ones (flops_per_step, plus flops_per_sample for each of `samples`). `global_step`, the trainer's step
        count after this step (the framework callbacks pass it), is pushed as is: a restarted run that
        restores a checkpoint steps back (a process that restores one again too), and the report counts the steps
        it redoes as lost progress.
        Every count must be a finite number >= 0: anything else raises ValueError, and nothing is counted.
        """
        if not (type(samples) is int and samples >= 0 and type(tokens) is int and tokens >= 0
                and type(micro_batches) is int and micro_batches >= 0
                and self._samples + samples + self._tokens + tokens + self._micro_batches + micro_batches <= _MAX_COUNT
                and (flops is None or (type(flops) in _PLAIN and flops >= 0 and self._flops + flops <= _MAX_FLOAT))
                and (global_step is None or (type(global_step) is int and 0 <= global_step <= _MAX_COUNT))):  # cheap
            samples, micro_batches, tokens, flops, global_step = _counts(
                samples=samples, micro_batches=micro_batches, tokens=tokens, flops=flops, global_step=global_step)
            self._check_totals(samples=samples, micro_batches=micro_batches, tokens=tokens, flops=flops or 0)
        if flops is None and self._counts_flops:  # a run that states no FLOPs pays one test
            flops = self._flops_per_step + samples * self._flops_per_sample
            if not self._flops + flops <= _MAX_FLOAT:
                self._check_totals(flops=flops)
        now = perf_counter_ns()
        duration = now - self._boundary
        if self._state != TRAIN_STATE:  # the one test made here before: train pays no more
            if self._state == SETUP_STATE:
                self._switch_state(TRAIN_STATE, now)
            elif self._left_train is not None:  # a step() inside eval: its train time, and the next begins now
                self._step_hist.observe_ns(self._left_train - self._boundary)
                self._left_train = now
            elif self._closed:
                self._warn_closed()
        else:
            self._step_hist.observe_ns(duration)
        self._micro_batch_ns = 0  # before the boundary moves: a push in between reads the earlier progress
        self._boundary = now
        self._steps += 1
        self._samples += samples
        self._micro_batches += micro_batches
        self._tokens += tokens
        if flops is not None:
            self._flops += flops
        if global_step is not None:
            self._count_global_step(global_step)
        at_boundary = self._at_boundary
        if at_boundary is not None:  # resolves GPU timings and picks the next timed step; starts, steps or
            at_boundary(duration)  # ends a requested profiler trace

    def _count_global_step(self, global_step: int) -> None:
        """Takes the global step after the step just counted; one that does not move on from the last is a restore
        (from a checkpoint at the step before it): the steps from there count from it."""
        if self._global_step is not None and global_step <= self._global_step:
            self._steps_before_restore = self._steps - 1
        self._global_step = global_step
        self._global_step_start = global_step - (self._steps - self._steps_before_restore)

    def micro_batch(self, samples: int = 0, tokens: int = 0, flops: float | None = None) -> None:
        """Counts one batch fed to the model, its samples and tokens, inside a step that goes on (gradient
        accumulation): the step itself is counted by the `step()` that ends it. `flops` as in `step()`, but
        None counts only flops_per_sample (flops_per_step is the whole step's, counted by `step()`)."""
        if not (type(samples) is int and samples >= 0 and type(tokens) is int and tokens >= 0
                and self._samples + samples + self._tokens + tokens + self._micro_batches < _MAX_COUNT
                and (flops is None or (type(flops) in _PLAIN and flops >= 0 and self._flops + flops <= _MAX_FLOAT))):
            samples, tokens, flops = _counts(samples=samples, tokens=tokens, flops=flops)  # as in step()
            self._check_totals(samples=samples, micro_batches=1, tokens=tokens, flops=flops or 0)
        if flops is None:
            flops = samples * self._flops_per_sample
            if flops and not self._flops + flops <= _MAX_FLOAT:
                self._check_totals(flops=flops)
        self._micro_batch_ns = perf_counter_ns() - self._boundary
        self._micro_batches += 1
        self._samples += samples
        self._tokens += tokens
        self._flops += flops

    def _check_totals(self, **counts: int | float) -> None:
        """ValueError naming the first of `counts` (this call's) that would take the run's total past the largest
        number a push holds: rendered +Inf, it kept every later push of the rank out (step(flops=1e308) twice).
        Called where the callers' cheap test fails: their one test of the sum may fail where no total does."""
        for name, count in counts.items():
            if not getattr(self, f"_{name}") + count <= _MAX_FLOAT:
                raise ValueError(f"{name} of {count!r} would take the run's total past {_MAX_FLOAT:.4g}, the largest "
                                 "a push can hold; nothing counted")

    def loader(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yields from the training loader `iterable`, timing each `next()` as the dataloader_next phase.

        Sets state "train": from setup that starts the step clock, so the first step does not include setup
        time. Already in train (a loop calling loader() every epoch) the clock goes on, so the epoch's end and
        the next epoch's `iter()` are in the step that holds them; restarting it there dropped them (0.77 s of
        step time for 1.40 s of truth with 0.3 s of work at each epoch's end). That `iter()` (non-persistent
        workers start, a sampler shuffles) is loading: timed with the epoch's first `next()`, as one batch's.

        Inside a `with tracker.state("eval")` (or "checkpoint") block the loader is that state's, a validation set's:
        it yields untimed and the state stays. Before, it set train there: the eval's time went into the next step
        and its fetches into dataloader_next (a loading share of 87% for about 33%: the run read data-bound).
        """
        if self._outside_scopes and self._state in _OUTSIDE_TRAIN:
            yield from iterable
            return
        in_train = self._state == TRAIN_STATE
        if in_train:
            self.phase("dataloader_next").start()
        try:
            iterator = iter(iterable)
        except BaseException:
            self.phase("dataloader_next").leave()
            raise
        self.state(TRAIN_STATE)
        phase = self.phase("dataloader_next")  # taken in train: from eval or a checkpoint phase() times nothing
        while True:
            if in_train:  # the first next() goes on from the iter()
                in_train = False
            else:
                phase.start()
            try:
                item = next(iterator)
            except StopIteration:  # the loader's end loaded no batch: the phase is left, not observed
                phase.leave()
                return
            except BaseException:  # nor did its error (a corrupt sample, Ctrl-C): not where the rank is after it
                phase.leave()
                raise
            phase.end()
            yield item

    # -- slow path --------------------------------------------------------------------------------

    def measure_limits(
        self, loader: Iterable[Any], train_step: Callable[[Any], object], batches: int = 50, *,
        warmup_steps: int = DEFAULT_WARMUP_STEPS, device: Any = None, samples_per_batch: int | None = None,
    ) -> Limits:
        """The loader limit and the compute limit in samples per second, pushed as gauges from now on.

        Loader limit: batches drawn from a fresh iterator of `loader` and discarded. Compute limit:
        `train_step(batch)` on its first batch again and again (moved to `device` once when given),
        synchronized at the end when the process uses CUDA. Run it before training or at a checkpoint:
        the step really runs, so it updates the model; its time is no step's. Called in train it runs in eval
        (`_measuring`), so its time is no training's either. Pass a step without tracker calls. See
        `stepscope.hooks.limits.measure` for the warm-up and the errors it raises (ValueError).
        """
        with self._measuring():
            limits = measure(loader, train_step, batches, warmup_steps=warmup_steps, device=device,
                             samples_per_batch=samples_per_batch, cuda=_cuda_module())
        self._limits = limits
        log.info("stepscope: %s", limits)
        return limits

    def measure_flops(self, train_step: Callable[..., object], *args: Any, **kwargs: Any) -> int:
        """Runs `train_step(*args, **kwargs)` once under torch's FLOP counter and counts what it counted
        as the model FLOPs of every step from now on (flops_per_step); returns it.

        Pass what one optimizer step computes: the forward and backward of all its micro-batches (the
        optimizer's own FLOPs are left out by convention). The step really runs, so pass one without
        tracker calls, and zero the gradients after it; its time is not a step.
        """
        with self._measuring():
            flops = count_flops(train_step, *args, **kwargs)
        self._flops_per_step = flops
        self._counts_flops = True
        log.info("stepscope: %d FLOPs per step (torch.utils.flop_counter)", flops)
        return flops

    def _measuring(self) -> _StateScope | contextlib.nullcontext[None]:
        """Where measure_limits and measure_flops run: called in train, in state eval until they return. Their
        time is then no step's (the step under way keeps its part, as across an eval) and no training's: counted
        as train, a measure of minutes was productive time in the goodput and a step that never came, paged as
        a stalled run once it outlasted 5 steps."""
        return self.state(EVAL_STATE) if self._state == TRAIN_STATE else contextlib.nullcontext()

    def _arm_tracing(self, boundary: BoundaryHook | None) -> None:
        self._tracing = boundary
        self._update_boundary_hook()

    def _update_boundary_hook(self) -> None:
        with self._boundary_lock:
            timer, tracing = self._cuda_timer, self._tracing
            if tracing is None or timer is None:
                self._at_boundary = tracing or (timer.step_done if timer is not None else None)
                return
            step_done = timer.step_done

            def both(duration: int) -> None:
                step_done(duration)
                tracing(duration)

            self._at_boundary = both

    def state(self, name: str) -> _StateScope:
        """Sets the training state (setup, train, eval, checkpoint, idle).

        Time outside "train" is no step's: leaving train notes when, and re-entering it moves the step clock
        on by the time spent outside, so the step under way keeps the part it did before (an eval or a
        checkpoint can come mid-step: Lightning's val_check_interval inside an accumulation, or after an
        epoch's last step, before the next epoch's first). Restarting the clock instead dropped that part:
        0.60 s of step time for 0.86 s of truth, a loading share of 70% for 48%. Entering train from setup
        or idle (no step under way) starts the clock now.
        """
        if name not in STATES:
            raise ValueError(f"unknown training state {name!r}; known: {', '.join(STATES)}")
        previous = self._state
        if name != previous:
            now = perf_counter_ns()
            if name == TRAIN_STATE:
                if self._closed:
                    self._warn_closed()
                left = self._left_train
                if left is None:  # no step under way: none of its micro-batches either
                    self._micro_batch_ns = 0
                self._boundary = now if left is None else self._boundary + (now - left)
                self._left_train = None
            elif name in (SETUP_STATE, IDLE_STATE):
                self._left_train = None
                if name == IDLE_STATE:
                    self._leave_phases()
            elif previous == TRAIN_STATE:
                self._left_train = now
            self._switch_state(name, now)
            self._time_phases_entered(outside_train=name in _OUTSIDE_TRAIN)
        return _StateScope(self, previous, name in _OUTSIDE_TRAIN)

    def _time_phases_entered(self, outside_train: bool) -> None:
        """What phase() returns from now on. In eval and checkpoint a phase entered there is no step's: NULL_PHASE,
        but a phase entered in train and still open is itself, so that its end observes it (a callback's save before
        the step's end). Before, a helper timing `forward` that the train and the eval loops share counted the eval's
        forwards in the steps' phases: forward 0.612 s in 30 for a step sum of 0.203 s (3 times the step). The lookup
        phase() makes is the same dict lookup in every state: train pays nothing for this."""
        if not outside_train:
            self._host_lookup, self._gpu_lookup = self._host, self._gpu
            return
        self._host_lookup = {name: phase if phase.is_open else NULL_PHASE for name, phase in self._host.items()}
        self._gpu_lookup = {name: phase if phase.is_open else NULL_PHASE for name, phase in self._gpu.items()}

    def _leave_phases(self) -> None:
        """Leaves every open phase without observing it: an idle rank (closed, or its fit ended by an exception
        or Ctrl-C inside a phase) is in none. Before, the last push of a closed rank still named the phase the
        exception left open (phase_entered{phase="forward"} with state idle)."""
        for phase in (*self._host.values(), *self._gpu.values()):
            phase.leave()

    def _warn_closed(self) -> None:
        """Says once per close() that the loop trains on a closed tracker, whose steps no push carries any more (a
        notebook's training cell run again after its close()): its second run's 20 steps were counted and never
        pushed, the exporter showing the rank idle with the first run's 20, and nothing said so."""
        if self._warned_closed or os.getpid() != self._pid:  # a forked worker's copy is closed for good
            return
        self._warned_closed = True
        log.warning("stepscope: run %r rank %d trains after close(): its steps are not pushed; call tracker.reopen() "
                    "to push them (the counts go on), or use a new tracker", self.config.run, self.config.rank)

    def _switch_state(self, name: str, now: int) -> None:
        """Adds the time since the current state began to its total, then enters `name`."""
        with self._state_lock:
            self._state_ns[self._state] += now - self._state_since
            self._state_since = now
            self._state = name

    def _state_seconds(self) -> dict[str, float]:
        """Seconds per state so far, the current state's running span included."""
        with self._state_lock:
            totals = dict(self._state_ns)
            totals[self._state] += perf_counter_ns() - self._state_since
        return {state: ns / 1e9 for state, ns in totals.items()}

    @property
    def current_state(self) -> str:
        return self._state

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def global_step(self) -> int | None:
        """The global step the last step() passed (None before one did)."""
        return self._global_step

    def global_step_offset(self, start: int) -> int:
        """What a framework callback adds to its trainer's global step in a fit that starts at step `start`: the
        global step the tracker's last fit reached where this one starts from 0 (a new Trainer, or `train()`
        again, nothing restored), so that the run's global step goes on rather than back; the rules read a step
        back as a restore (a new Trainer's 30 steps after 30 read as 30 steps lost). 0 for a first fit, and for
        one restored from a checkpoint: a step back there is a restore."""
        return (self._global_step or 0) if start == 0 else 0

    @property
    def flops_stated(self) -> bool:
        """Whether the user states the model FLOPs (flops_per_step/sample, measure_flops): the framework
        callbacks then leave theirs out."""
        return self._counts_flops

    @property
    def gpu_sample_every(self) -> int | None:
        """k: CUDA events time about one step in k (chosen from measured costs); None without them."""
        return self._cuda_timer.sample_every if self._cuda_timer is not None else None

    def _new_phase(self, name: str, cuda: bool) -> Phase:
        validate_phase_name(name)
        self._dynamo_compiling = _dynamo_check()
        if self._state in _OUTSIDE_TRAIN:  # no step's (_time_phases_entered): made once the loop trains
            return NULL_PHASE
        cuda_module = _cuda_module() if cuda else None
        timing = "host" if cuda_module is None else "cuda_sync" if self.config.sync else "cuda_event"
        hist = self._histogram(name, timing)
        if hist is None:
            return NULL_PHASE
        phase: Phase
        if cuda_module is None:
            phase = self._host.get(name) or HostPhase(name, hist)
        elif self.config.sync:
            phase = SyncCudaPhase(name, hist, cuda_module)
        else:
            if self._cuda_timer is None:
                self._cuda_timer = CudaTimer(cuda_module)
                self._update_boundary_hook()
            phase = CudaPhase(name, hist, self._cuda_timer)
        (self._gpu if cuda else self._host)[name] = phase
        return phase

    def _histogram(self, name: str, timing: str) -> Histogram | None:
        """The phase's histogram, made on first use; None over the phase limit (warned once)."""
        hist = self._histograms.get(name)
        if hist is not None:
            if self._timing[name] != timing:
                log.warning("stepscope: phase %r is timed as %s and as %s; its histogram (labelled %s) mixes "
                            "both", name, self._timing[name], timing, self._timing[name])
            return hist
        if len(self._histograms) >= self.config.max_phases:
            if not self._warned_limit:
                log.warning("stepscope: more than %d distinct phases; not timing %r and further new ones",
                            self.config.max_phases, name)
                self._warned_limit = True
            return None
        hist = self._histograms[name] = self._new_histogram(f"phase:{name}", buckets=self.config.phase_buckets)
        self._timing[name] = timing
        self._phase_order = (*self._phase_order, (name, timing, hist))
        return hist

    def _agree_on_bounds(self, store: object | None) -> RunBounds | None:
        """Started when the run has several ranks whose buckets follow their steps (and the user left it on)."""
        cfg = self.config
        if cfg.buckets is not None or cfg.world_size == 1 or not cfg.share_bounds:
            return None
        return RunBounds(run_store(cfg.run, store), cfg.push_interval)  # started with the pusher

    def agree_on_bounds(self) -> None:
        """One round of the bounds agreement now; its thread does one every push interval. For a caller
        that must know its bounds are out and the run's read before the next snapshot."""
        if self._run_bounds is not None:
            self._run_bounds.exchange()

    def _new_histogram(self, key: str, buckets: bool) -> Histogram:
        """Buckets that follow the run unless the user fixed them; without buckets, _sum and _count only."""
        if not buckets:
            return Histogram(())
        if self.config.buckets is None:
            return Histogram.following(self._run_bounds.histogram(key) if self._run_bounds else None)
        return Histogram(self.config.buckets)

    def snapshot(self) -> Snapshot:
        """A consistent-enough copy for rendering; safe to call from the pusher thread."""
        cfg = self.config
        pid = os.getpid()
        info = {"local_rank": str(cfg.local_rank), "world_size": str(cfg.world_size), "pid": str(pid),
                "framework": cfg.framework}
        start_time, namespace = _start_time(pid), _pid_namespace(pid)
        if start_time is not None:
            info["start_time"] = start_time
        if namespace is not None:
            info["pid_namespace"] = namespace
        last_step, open_phase = self._progress()
        step = self._step_hist.snapshot()
        self._warn_compiled_phase()
        return Snapshot(
            # Pushed from the push that first holds the step histogram (held back until its first step): pushed from
            # each phase's first entry, a phase histogram held a long first step's seconds one push before the step
            # histogram existed, so the rules' per-step phase seconds (a phase's rate over the steps' rate) counted
            # that step in the phases' rate windows and not in the steps' for a minute: an 80 s first step then
            # 100 ms steps of 60 ms forward read forward 0.37, 0.25, 0.20 s per step, above the whole step.
            phases=[] if step.held_back else [(name, timing, hist.snapshot())
                                              for name, timing, hist in self._phase_order],
            step=step,
            steps=self._steps,
            samples=self._samples,
            micro_batches=self._micro_batches,
            tokens=self._tokens or None,
            global_step=self._global_step,
            global_step_start=self._global_step_start,
            flops=self._flops if self._flops or self._counts_flops else None,
            flops_dtype=self.config.flops_dtype,
            peak_flops=self.config.peak_flops,
            state=self._state,
            state_seconds=self._state_seconds(),
            info=info,
            limits=self._limits,
            trace=self.traces.published() if self.traces is not None else None,
            last_step_time=last_step,
            open_phase=open_phase,
            allocator=read_allocator(_cuda_module()),
        )

    def _warn_compiled_phase(self) -> None:
        """Says once, from the pusher thread, that a phase sits inside a torch.compile'd function (`_traced_phase`)."""
        if self._compiled_phase and not self._warned_compiled:
            self._warned_compiled = True
            log.warning("stepscope: phase %r is inside a function that torch.compile compiles, where it cannot time "
                        "(a timed one would make torch.compile run that function uncompiled): it times nothing; "
                        "time around the compiled call instead (docs/hooks.md)", self._compiled_phase)

    def _progress(self) -> tuple[float | None, tuple[str, float] | None]:
        """When the last step ended, or the last micro-batch of the step under way was counted (Unix seconds; None
        before the first step), moved on by the time spent outside train since, and the phase entered last and not
        left, with when it was entered: what names a rank that stopped stepping. Read from what the training thread
        stores anyway (the step clock and its last micro-batch, each host phase's start)."""
        perf_now, unix_now = perf_counter_ns(), time()

        def unix(perf_ns: int) -> float:
            return unix_now - (perf_now - perf_ns) / 1e9

        last_step = unix(self._boundary + self._micro_batch_ns) if self._steps else None
        phases = (*self._host.values(), *self._gpu.values())  # cuda=True without CUDA times on the host too
        started = [(getattr(phase, "_start", 0), phase.name) for phase in phases]
        entered, name = max(started, default=(0, ""))
        return last_step, ((name, unix(entered)) if entered else None)

    def render(self) -> str:
        return render(self.snapshot())

    @property
    def closed(self) -> bool:
        """Whether `close()` ran in this process (a forked data-loader worker's copy counts as closed)."""
        return self._closed or os.getpid() != self._pid

    def close(self) -> None:
        """Resolves outstanding GPU timings, leaves every open phase, sets state idle and pushes one final time.
        Idempotent.

        Runs at exit, and on SIGTERM before the signal goes on to its previous handler (`signals`).
        """
        if self._closed or os.getpid() != self._pid:  # a forked data-loader worker owns nothing here
            return
        self._closed = True
        atexit.unregister(self.close)
        self._sigterm.uninstall()
        if self._cuda_timer is not None:
            try:
                self._cuda_timer.resolve(block=True)
            except Exception as exc:  # a dead CUDA context at exit must not hide the final push
                log.warning("stepscope: could not resolve pending CUDA timings: %r", exc)
        if self.traces is not None:
            self.traces.close()  # a trace being recorded is written with the steps it has
        self._leave_phases()
        self._left_train = None
        self._switch_state(IDLE_STATE, perf_counter_ns())
        self._time_phases_entered(outside_train=False)
        if self._run_bounds is not None:
            self._run_bounds.stop()
        if self.pusher is not None:
            self.pusher.stop()

    def reopen(self) -> None:
        """Takes a closed tracker up again, its counts where close() left them: the framework callbacks' next fit
        (`trainer.fit()` again, `Trainer.train()` again) in the same process is more of the same run. A new
        tracker there counted from 0 under the same run, rank and pid: Prometheus read a counter reset, the
        report estimated the steps across it (56.07 of 60) and took the 8 s between the fits for a restart gap,
        the rules for a new attempt. The time since close() counts as idle; pushing starts again, and the final
        push at exit and on SIGTERM. Nothing to do while open, or in another process (a forked worker's copy).
        ValueError while another open tracker of this process pushes the same run and rank.
        """
        if not self._closed or os.getpid() != self._pid:
            return
        check_unclaimed(self.config, self)
        if self.traces is not None:
            self.traces.reopen()
            _pushing[_group_key(self.config)] = self
        self._closed = False
        self._warned_closed = False
        self._start_reporting()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()
