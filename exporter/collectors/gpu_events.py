"""XID critical errors from an NVML event set, counted on a daemon thread.

XIDs are events, not readings: the driver reports each one once, so a thread blocks on the event
set and the GPU collector publishes the counts accumulated so far.
"""

import ctypes
import logging
import threading
import time
from types import ModuleType
from typing import Any

from stepscope.exporter.thread_cpu import collector_thread_name

log = logging.getLogger(__name__)

WAIT_TIMEOUT_MS = 1000  # bounds how long close() waits for the thread


class XidWatcher:
    """Counts XIDs per (gpu index, uuid, xid) and remembers when each last fired."""

    def __init__(self, nvml: ModuleType, event_set: Any, gpus: list[tuple[str, str, Any]]) -> None:
        self._nvml = nvml
        self._event_set = event_set
        self._by_handle = {_handle_key(handle): (index, uuid) for index, uuid, handle in gpus}
        self._by_uuid = {uuid: (index, uuid) for index, uuid, _ in gpus}
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str, str], tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=collector_thread_name("gpu", "xid-events"),
                                        daemon=True)

    @classmethod
    def start(cls, nvml: ModuleType, gpus: list[tuple[str, str, Any]]) -> "XidWatcher | None":
        """Registers (index, uuid, handle) GPUs for XID events; None when no GPU supports them."""
        if not gpus:
            return None
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML event set unavailable (%s): no XID metrics", exc)
            return None
        watcher = cls(nvml, event_set, [])
        if not [gpu for gpu in gpus if watcher.watch(*gpu)]:
            nvml.nvmlEventSetFree(event_set)
            return None
        watcher._thread.start()
        return watcher

    def watch(self, index: str, uuid: str, handle: Any) -> bool:
        """Registers one more GPU on the running set: a GPU that answered only after start (lost then, or
        listed later) had no XIDs counted before. False (logged) when it does not support XID events."""
        key = _handle_key(handle)
        if key in self._by_handle:  # identified again after a failed identification: registered already
            return True
        try:
            self._nvml.nvmlDeviceRegisterEvents(handle, self._nvml.nvmlEventTypeXidCriticalError, self._event_set)
        except self._nvml.NVMLError as exc:
            log.warning("GPU %s: XID events unavailable (%s): no XID metrics for it", index, exc)
            return False
        with self._lock:  # the event thread reads these maps (single lookups) while this adds to them
            self._by_handle[key] = (index, uuid)
            self._by_uuid[uuid] = (index, uuid)
        return True

    def seen(self) -> list[tuple[tuple[str, str, str], int, float]]:
        """[((gpu, uuid, xid), count, last seen unix time)] accumulated since start."""
        with self._lock:
            return [(key, count, last) for key, (count, last) in self._seen.items()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT_TIMEOUT_MS / 1000 + 2)
        if not self._thread.is_alive():  # never free a set a wedged wait still uses
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            except self._nvml.NVMLError:
                log.debug("freeing the NVML event set failed", exc_info=True)

    def _run(self) -> None:
        nvml = self._nvml
        failing = False
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, WAIT_TIMEOUT_MS)
            except nvml.NVMLError_Timeout:
                continue
            except nvml.NVMLError as exc:
                if not failing:
                    log.warning("waiting for NVML XID events failed (%s); retrying every second", exc)
                    failing = True
                self._stop.wait(1.0)
                continue
            if failing:
                log.info("waiting for NVML XID events works again")
                failing = False
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                self._record(data.device, str(data.eventData))

    def _record(self, device: Any, xid: str) -> None:
        """Attributes the event by its handle: asking a GPU that fell off the bus for its UUID fails."""
        identity = self._by_handle.get(_handle_key(device))
        if identity is None:
            try:
                uuid = self._nvml.nvmlDeviceGetUUID(device)
                identity = self._by_uuid.get(uuid, ("", uuid))
            except self._nvml.NVMLError:
                identity = ("", "")
        key = (*identity, xid)
        with self._lock:
            count, _ = self._seen.get(key, (0, 0.0))
            self._seen[key] = (count + 1, time.time())


def _handle_key(handle: Any) -> Any:
    """The address behind a real NVML handle (ctypes pointers never compare equal by value)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except ctypes.ArgumentError:  # not a ctypes pointer: the handle is its own key
        return handle
