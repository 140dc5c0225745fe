"""A SIGTERM handler that pushes the final state, then lets the signal do what it did before.

Kubernetes and `docker stop` end a training process with SIGTERM, and Python's default action kills
it without running `atexit`: the rank would go on showing `state="train"` until the exporter's TTL.
The handler runs a callback (the tracker's close: state idle, one final push) and then chains:

- a previous Python handler is called with the same arguments (it decides what happens next);
- with the default action before us, and our handler still the one installed (ours or another
  tracker's), the default is restored and the signal raised again: the process dies of SIGTERM as
  it would have without us;
- when a handler installed after ours calls ours as part of its own chain (Lightning composes the
  handlers it finds, and stops training at the end of the batch instead of dying), that handler
  decides: ours pushes and returns.

It is installed only from the main thread (Python delivers signals there; `signal.signal` refuses
other threads) and never over SIG_IGN or a handler set outside Python, which cannot be chained.

While the final push runs, a Python SIGCHLD handler is held back (`HeldSignal`): a SIGTERM sent to the
whole process group (Kubernetes, `docker stop`, Ctrl-C's cousin `kill -- -PGID`) ends the DataLoader's
workers too, and torch's SIGCHLD handler raises "DataLoader worker ... is killed by signal" wherever the
main thread is, inside the final push: it was lost in 2 of 8 tries. The held-back call is made after the
signal went on, where the process still lives (a chained handler that returned).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("stepscope.hooks")


class FinalPushOnSigterm:
    def __init__(self, on_term: Callable[[], None]) -> None:
        self._on_term = on_term
        self._handler = self._handle  # one bound method object, so `is` finds it installed
        self._previous: Callable[[int, FrameType | None], object] | int | None = None

    def install(self) -> bool:
        """Installs the handler; False where it cannot chain (not the main thread, SIG_IGN, foreign)."""
        if threading.current_thread() is not threading.main_thread():
            log.debug("stepscope: not the main thread; no SIGTERM handler, close() pushes the final state")
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous is signal.SIG_IGN:
            return False
        self._previous = previous
        signal.signal(signal.SIGTERM, self._handler)
        return True

    def uninstall(self) -> None:
        """Puts the previous handler back, if ours is still the installed one (else it stays chained)."""
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGTERM) is self._handler
        ):
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        installed = signal.getsignal(signum)  # before on_term, whose close() uninstalls us
        on_top = isinstance(getattr(installed, "__self__", None), FinalPushOnSigterm)
        children = HeldSignal(signal.SIGCHLD)
        try:
            try:
                self._on_term()
            except Exception as exc:  # the signal must go on whatever the final push did
                log.warning("stepscope: final push on SIGTERM failed: %r", exc)
            previous = self._previous
            if callable(previous):
                previous(signum, frame)
            elif on_top:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
        finally:
            children.release()
        children.replay()


class HeldSignal:
    """Holds back the Python handler of `signum` from construction until `release()`: a signal that arrives
    meanwhile is noted, and `replay()` calls the handler with it then. Only a callable handler is held (the
    default action and SIG_IGN are not Python code and raise nothing), and only from the main thread."""

    def __init__(self, signum: int) -> None:
        self._signum = signum
        self._arrived = False
        self._frame: FrameType | None = None  # where it arrived first
        self._handler = signal.getsignal(signum)
        self._held = callable(self._handler) and threading.current_thread() is threading.main_thread()
        if self._held:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self._arrived:
            self._arrived, self._frame = True, frame

    def release(self) -> None:
        """Puts the handler back, if ours is still the installed one (a handler set meanwhile stays)."""
        if self._held and signal.getsignal(self._signum) == self._note:
            signal.signal(self._signum, self._handler)  # type: ignore[arg-type]

    def replay(self) -> None:
        """Calls the handler once for what arrived while held (a signal pending several times is delivered once)."""
        if self._arrived:
            self._handler(self._signum, self._frame)  # type: ignore[operator]
