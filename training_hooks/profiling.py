"""PyTorch profiler traces on request: asked for through the node's exporter, taken at step boundaries.

The nearest peer is Meta's Dynolog: a host daemon that Kineto registers with over IPC when the process
starts with KINETO_USE_DAEMON set, and that triggers a trace of a duration or of N iterations
(`dyno gputrace`). Ours needs no daemon, no IPC and no variable set before start-up: the request
travels the way the step timings already do. What Dynolog users trip over and this avoids: traces
without step annotations (Kineto's on-demand traces lack `ProfilerStep#N`, which HTA and TensorBoard
need), and requests that match no process or write no file without saying why (here the command
waits for the trace and names the reason when there is none).

Protocol, carried by the pusher (a stock Pushgateway ignores both headers):

- every push sends `Stepscope-Profile: <JSON>`: whether this rank can take a trace (`ready`, `running`,
  or `unavailable` with a reason) and the outcome of its last request (done: path, size, steps; failed:
  reason). It repeats on every push, so a lost push loses nothing;
- while a request for the rank waits, the exporter answers its pushes with
  `Stepscope-Profile-Request: {"id": ..., "steps": N}` until a push shows the rank took it;
- once the request is cancelled (stepscope-profile's Ctrl-C), the exporter answers with
  `Stepscope-Profile-Cancel: <id>` until a push reports it ended: the training thread stops the profiler
  at its next step boundary and throws the recording away (no file), and the outcome says `cancelled`.
  Hooks say they understand it with `"v": 2` in their status; to hooks of version 1 the exporter sends
  none, and their trace runs its steps.

Cost: none while no trace is requested: no profiler object exists, and `Tracker.step` makes the one
test it made before (its boundary hook, which an armed request joins; benchmarks/results/profile.md).
A request arms the tracker from the pusher thread; the training thread starts `torch.profiler` at its
next step boundary (CPU activities, plus CUDA when this process initialised CUDA; shapes, stacks and
memory off) with one warm-up step and N recorded steps (`schedule(wait=0, warmup=1, active=N)`: the
trace holds `ProfilerStep#` annotations for exactly N steps), stops it when the schedule says the
trace is ready, and a writer thread exports the Chrome trace, gzips it under a size cap into the trace
directory and deletes the rank's older traces beyond a count. One trace at a time: a rank that is
tracing takes no second request.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from stepscope.contract import json_text

log = logging.getLogger("stepscope.hooks")

STATUS_HEADER = "Stepscope-Profile"
REQUEST_HEADER = "Stepscope-Profile-Request"
CANCEL_HEADER = "Stepscope-Profile-Cancel"
PROTOCOL_VERSION = 2  # 2: takes CANCEL_HEADER
MAX_TRACE_STEPS = 1000
WARMUP_STEPS = 1
TRACE_SUFFIX = ".pt.trace.json.gz"  # what TensorBoard's profiler plugin and Perfetto recognise
WRITER_JOIN_SECONDS = 10.0  # close() waits this long for a trace being written (SIGTERM has a grace period)
CLOSE_LOCK_SECONDS = 1.0  # close() from a signal handler may interrupt the holder: never wait forever
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
MAX_RUN_CHARS = 64  # of a run's name in its traces' file names
TRACE_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
_TRACE_FILE_TAIL = re.compile(r"\d{8}T\d{6}Z-[A-Za-z0-9_-]{1,8}" + re.escape(TRACE_SUFFIX))  # after the prefix

Arm = Callable[[Callable[[int], None] | None], None]


@dataclass(frozen=True)
class TraceRequest:
    id: str
    steps: int


@dataclass(frozen=True)
class TraceOutcome:
    """What came of one request: a trace file (ok) or the reason there is none."""

    id: str
    ok: bool
    requested_steps: int
    steps: int = 0  # steps the trace holds
    path: str = ""
    size: int = 0  # bytes, gzipped
    time: float = 0.0  # Unix time it was written (or failed)
    reason: str = ""
    cancelled: bool = False  # ended by CANCEL_HEADER: no file, on purpose


@dataclass(frozen=True)
class TraceSettings:
    directory: str
    max_bytes: int
    keep: int


class TraceTooLarge(Exception):
    """The gzipped trace passed the size cap; nothing was kept."""


def parse_request(raw: str) -> TraceRequest:
    """The exporter's `Stepscope-Profile-Request` value; ValueError names what is wrong."""
    try:
        data = json_text.loads(raw)
        request_id, steps = data["id"], data["steps"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{REQUEST_HEADER} is not a JSON object with id and steps: {raw[:120]!r} ({exc})") from None
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise ValueError(f"{REQUEST_HEADER} has a bad id: {request_id!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_TRACE_STEPS:
        raise ValueError(f"{REQUEST_HEADER} asks for {steps!r} steps; 1 to {MAX_TRACE_STEPS} are allowed")
    return TraceRequest(request_id, steps)


def profiler_unavailable() -> str:
    """Why this process cannot take a trace ("" when it can); never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not imported in this process"
    if getattr(torch, "profiler", None) is None:
        return "this torch has no torch.profiler"
    try:
        if not torch.autograd.kineto_available():
            return "this torch build has no Kineto profiler (torch.autograd.kineto_available() is False)"
    except Exception as exc:
        return f"cannot ask torch whether its profiler works: {exc!r}"
    if _other_session(torch):
        return "another torch.profiler session is recording in this process; ask again when it ends"
    return ""


def _other_session(torch: Any) -> bool:
    """Whether a torch.profiler session records now (Kineto allows one per process; starting a second
    would end the first). torch keeps the flag in a module global; absent in other versions."""
    return bool(getattr(getattr(torch.autograd, "profiler", None), "_is_profiler_enabled", False))


def trace_file_prefix(run: str, rank: int) -> str:
    """`<run>-rank<k>-`: every trace of this run and rank starts so (pruning counts these). A run whose name is
    not a safe file name of at most MAX_RUN_CHARS gets the CRC-32 of its name after what is kept of it: runs of
    a sweep whose long names differ after that, or names that differ only where '_' replaces, shared one prefix
    in a node's trace directory, and each run's pruning deleted the other's traces."""
    safe = _UNSAFE_FILE_CHARS.sub("_", run)
    if safe != run or len(run) > MAX_RUN_CHARS:
        safe = f"{safe[:MAX_RUN_CHARS - 9]}-{zlib.crc32(run.encode()):08x}"
    return f"{safe}-rank{rank}-"


def trace_file_name(prefix: str, request_id: str) -> str:
    """`<prefix><UTC time>-<id>.pt.trace.json.gz`, the name of a trace written now (what `prune` counts)."""
    return f"{prefix}{time.strftime(TRACE_TIME_FORMAT, time.gmtime())}-{request_id[:8]}{TRACE_SUFFIX}"


def gzip_capped(source: Path, target: Path, max_bytes: int) -> int:
    """Gzips `source` into `target` (written whole or not at all); the compressed size.

    Raises TraceTooLarge as soon as the compressed output passes max_bytes.
    """
    partial = target.with_name(target.name + ".part")
    try:
        with open(source, "rb") as src, open(partial, "wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                if raw.tell() > max_bytes:
                    raise TraceTooLarge(f"over {max_bytes} bytes gzipped")
        size = partial.stat().st_size
        if size > max_bytes:  # the compressor's buffer held the excess until the end
            raise TraceTooLarge(f"over {max_bytes} bytes gzipped")
        os.replace(partial, target)
        return size
    finally:
        partial.unlink(missing_ok=True)


def prune(directory: Path, prefix: str, keep: int) -> list[Path]:
    """Deletes all but the `keep` newest traces named `<prefix><UTC time>-<id>` in directory; the deleted paths.
    Only that shape: `<prefix>*` of run `a`, rank 1 (`a-rank1-*`) took in the traces of run `a-rank1`, rank 0."""
    traces = sorted((path for path in directory.glob(f"{glob_escape(prefix)}*{TRACE_SUFFIX}")
                     if _TRACE_FILE_TAIL.fullmatch(path.name[len(prefix):])), key=_mtime)
    doomed = traces[:-keep] if keep else traces
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _free_space(directory: Path) -> str:
    """'12 KiB free there', for a reason that has to guess why a write failed."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "its free space unknown"
    return f"{free // 1024} KiB free there"


def _uses_cuda(torch: Any) -> bool:
    """Whether this process initialised CUDA (then the trace records GPU kernels too)."""
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


class TraceTaker:
    """One rank's on-demand traces: takes requests from push answers, reports in push headers.

    Thread use: `headers` and `on_answer` run in the pusher thread, `boundary` in the training thread
    (the tracker calls it at a step boundary while armed), the export in a writer thread. One lock
    orders them; the hot path never takes it while no trace is requested. `arm(boundary)` makes the
    tracker call `boundary` at every step, `arm(None)` stops that.
    """

    def __init__(self, run: str, rank: int, settings: TraceSettings, arm: Arm) -> None:
        self._run = run
        self._rank = rank
        self._settings = settings
        self._arm = arm
        self._lock = threading.Lock()
        self._request: TraceRequest | None = None  # taken and not finished (armed, recording or writing)
        self._profiler: Any = None  # torch.profiler.profile while recording
        self._trace_ready = False  # set by the profiler when its schedule ends
        self._cancelled = False  # the exporter said to stop the running request: done at the next boundary
        self._boundaries = 0  # step boundaries since the profiler started
        self._writer: threading.Thread | None = None
        self._last: TraceOutcome | None = None
        self._last_trace: TraceOutcome | None = None  # the latest trace written: the published one
        self._seen: deque[str] = deque(maxlen=64)  # request ids taken, so a repeated answer is ignored
        self._closed = False
        self._warned = ""

    # -- pusher thread ----------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        """The `Stepscope-Profile` header for the next push."""
        return {STATUS_HEADER: json.dumps(self.status(), separators=(",", ":"))}

    def status(self) -> dict[str, Any]:
        with self._lock:
            request, last, boundaries, recording = self._request, self._last, self._boundaries, self._profiler
        status: dict[str, Any] = {"v": PROTOCOL_VERSION}
        if request is not None:
            done = max(0, min(boundaries - WARMUP_STEPS, request.steps)) if recording is not None else 0
            status.update(state="running", id=request.id, steps=request.steps, done_steps=done)
        elif reason := profiler_unavailable():
            status.update(state="unavailable", reason=reason)
        else:
            status.update(state="ready")
        if last is not None:
            status["last"] = asdict(last)
        return status

    def on_answer(self, headers: Mapping[str, str]) -> None:
        """Takes the request an exporter's answer carries, if any (the headers of a 2xx push answer), or the
        cancellation of the one being taken."""
        cancel = headers.get(CANCEL_HEADER)
        if cancel:
            self._cancel(cancel.strip())
        raw = headers.get(REQUEST_HEADER)
        if not raw:
            return
        try:
            request = parse_request(raw)
        except ValueError as exc:
            if self._warned != str(exc):
                log.warning("stepscope: ignoring a profile request: %s", exc)
                self._warned = str(exc)
            return
        with self._lock:
            if self._closed or request.id in self._seen or self._request is not None:
                return  # one at a time: the exporter sends no second request to a rank that is tracing
            self._seen.append(request.id)
            reason = profiler_unavailable() or self._directory_problem()
            if reason:
                self._last = TraceOutcome(request.id, False, request.steps, time=time.time(), reason=reason)
                log.warning("stepscope: cannot take the requested profiler trace: %s", reason)
                return
            self._request = request
            self._trace_ready = False
            self._cancelled = False
            self._boundaries = 0
            self._arm(self.boundary)
        log.info("stepscope: profiler trace of %d steps requested; it starts at the next step", request.steps)

    def _cancel(self, request_id: str) -> None:
        """Stops the request `request_id` if this rank is taking it: one not started yet ends here, a recording
        at the training thread's next step boundary (the profiler belongs to that thread); one being written
        is whole already and is left to finish."""
        with self._lock:
            request = self._request
            if request is None or request.id != request_id or self._writer is not None or self._cancelled:
                return
            if self._profiler is None:
                self._end_cancelled(request)
                return
            self._cancelled = True
        log.info("stepscope: profiler trace %s cancelled; it stops at the next step", request_id)

    def published(self) -> TraceOutcome | None:
        """The latest trace written (what the push body publishes), None before the first."""
        return self._last_trace

    # -- training thread --------------------------------------------------------------------------

    def boundary(self, step_ns: int = 0) -> None:
        """At a step boundary while armed (`step_ns`, the step's duration, is not needed): starts the
        profiler, or steps it and finishes when the schedule says the trace is ready."""
        with self._lock:
            request = self._request
            if request is None or self._writer is not None:  # finished meanwhile
                self._arm(None)
                return
            if self._cancelled:
                self._end_cancelled(request)
                return
            if self._profiler is None:
                self._start(request)
                return
            self._boundaries += 1
            try:
                self._profiler.step()  # calls _ready when the schedule's last recorded step ends
            except Exception as exc:
                self._fail(request, f"torch.profiler failed during the trace: {exc!r}")
                return
            if self._trace_ready:
                self._finish(request, request.steps, "")

    def reopen(self) -> None:
        """At tracker reopen (the next fit of a framework callback): requests are taken again."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """At tracker close: a trace being recorded is cut short and written with the steps it has."""
        if not self._lock.acquire(timeout=CLOSE_LOCK_SECONDS):  # a signal handler interrupted the holder
            return
        try:
            self._closed = True
            request = self._request
            if request is not None and self._cancelled and self._writer is None:
                self._end_cancelled(request)
            elif request is not None and self._profiler is not None and self._writer is None:
                steps = max(0, self._boundaries - WARMUP_STEPS + 1)  # the step in progress is recorded too
                if self._trace_ready or steps > 0:
                    self._finish(request, min(steps, request.steps),
                                 f"training ended after {steps} of {request.steps} steps")
                else:
                    self._fail(request, "training ended before the trace recorded a step")
            writer = self._writer
        finally:
            self._lock.release()
        if writer is not None:
            writer.join(WRITER_JOIN_SECONDS)

    def _start(self, request: TraceRequest) -> None:
        import torch.profiler as tp  # torch is imported: profiler_unavailable() said so

        if _other_session(sys.modules["torch"]):  # started since the request came: leave it alone
            self._fail(request, "another torch.profiler session is recording in this process")
            return
        activities = [tp.ProfilerActivity.CPU]
        if _uses_cuda(sys.modules["torch"]) and tp.ProfilerActivity.CUDA in tp.supported_activities():
            activities.append(tp.ProfilerActivity.CUDA)
        try:
            profiler = tp.profile(
                activities=activities, record_shapes=False, with_stack=False, profile_memory=False,
                schedule=tp.schedule(wait=0, warmup=WARMUP_STEPS, active=request.steps, repeat=1),
                on_trace_ready=self._ready,
            )
            profiler.start()
        except Exception as exc:  # e.g. another profiler is already running in this process
            self._fail(request, f"torch.profiler could not start: {exc}")
            return
        self._profiler = profiler

    def _ready(self, profiler: Any) -> None:
        self._trace_ready = True

    def _finish(self, request: TraceRequest, steps: int, note: str) -> None:
        """Stops recording (lock held) and hands the profiler to a writer thread."""
        profiler, self._profiler = self._profiler, None
        self._arm(None)
        try:
            profiler.stop()
        except Exception as exc:
            self._fail(request, f"torch.profiler failed to stop: {exc!r}")
            return
        self._writer = threading.Thread(target=self._write, args=(profiler, request, steps, note),
                                        name="stepscope-trace-writer", daemon=True)
        self._writer.start()

    def _end_cancelled(self, request: TraceRequest) -> None:
        """Ends a cancelled request (lock held): the profiler stopped and its recording dropped unwritten."""
        recorded = max(0, min(self._boundaries - WARMUP_STEPS, request.steps)) if self._profiler is not None else 0
        if self._profiler is not None:
            with contextlib.suppress(Exception):  # nothing of it is kept: an error stopping it changes nothing
                self._profiler.stop()
            self._profiler = None
        self._arm(None)
        self._cancelled = False
        self._request = None
        reason = f"cancelled after {recorded} of {request.steps} steps; no trace written"
        self._last = TraceOutcome(request.id, False, request.steps, steps=recorded, time=time.time(), reason=reason,
                                  cancelled=True)
        log.info("stepscope: profiler trace %s %s", request.id, reason)

    def _fail(self, request: TraceRequest, reason: str) -> None:
        """Ends the request without a trace (lock held)."""
        log.warning("stepscope: profiler trace %s failed: %s", request.id, reason)
        if self._profiler is not None:
            with contextlib.suppress(Exception):  # failing already; the reason is the first error
                self._profiler.stop()
            self._profiler = None
        self._arm(None)
        self._last = TraceOutcome(request.id, False, request.steps, time=time.time(), reason=reason)
        self._request = None

    # -- writer thread ----------------------------------------------------------------------------

    def _write(self, profiler: Any, request: TraceRequest, steps: int, note: str) -> None:
        outcome = self._export(profiler, request, steps, note)
        with self._lock:
            self._last = outcome
            if outcome.ok:
                self._last_trace = outcome
            self._request = None
            self._writer = None
        if outcome.ok:
            log.info("stepscope: profiler trace of %d steps written to %s (%d bytes)", steps, outcome.path,
                     outcome.size)
        else:
            log.warning("stepscope: profiler trace %s failed: %s", request.id, outcome.reason)

    def _export(self, profiler: Any, request: TraceRequest, steps: int, note: str) -> TraceOutcome:
        directory = Path(self._settings.directory)
        prefix = trace_file_prefix(self._run, self._rank)
        target = directory / trace_file_name(prefix, request.id)
        raw = target.with_name(f".{target.name}.json")
        failed = TraceOutcome(request.id, False, request.steps, steps=steps, time=time.time())
        try:
            profiler.export_chrome_trace(str(raw))
            if not raw.exists():  # Kineto logs its write error and returns without raising
                raise OSError(f"torch.profiler could not write the trace file ({_free_space(directory)}: is the disk "
                              "full?)")
            size = gzip_capped(raw, target, self._settings.max_bytes)
        except TraceTooLarge as exc:
            return replace(failed, reason=f"the trace of {steps} steps is {exc}, the cap (STEPSCOPE_TRACE_MAX_BYTES): "
                                           "ask for fewer steps")
        except Exception as exc:
            return replace(failed, reason=f"could not write the trace to {directory}: {exc}")
        finally:
            raw.unlink(missing_ok=True)
            raw.with_name(raw.name + ".tmp").unlink(missing_ok=True)  # Kineto writes there first
        prune(directory, prefix, self._settings.keep)
        return TraceOutcome(request.id, True, request.steps, steps=steps, path=str(target), size=size,
                            time=time.time(), reason=note)

    def _directory_problem(self) -> str:
        directory = self._settings.directory
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            return f"cannot create the trace directory {directory} (STEPSCOPE_TRACE_DIR): {exc.strerror or exc}"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"cannot write to the trace directory {directory} (STEPSCOPE_TRACE_DIR): permission denied"
        return ""
