"""Run an :class:`~.nvml_collector.NvmlCollector` on a background thread.

Each cycle collects every GPU, then spends the rest of the interval *waiting for XID events*
(``nvmlEventSetWait``), so an XID is published the moment the driver reports it, not at the next
poll. Without XID support the thread simply waits for the interval.
"""

from __future__ import annotations

import logging
import os
import threading

from kvmeter.stats import GpuCollectorStatus

from .nvml_collector import NvmlCollector

__all__ = ["GpuPoller", "INTERVAL_ENV"]

log = logging.getLogger(__name__)

#: environment variable with the default poll interval, seconds
INTERVAL_ENV = "KVMETER_GPU_POLL_INTERVAL_S"


class GpuPoller:
    """Background thread: ``collect()`` every ``interval_s`` seconds, XIDs as they come.

    Args:
        collector: the collector (started here if it was not).
        interval_s: seconds between collections (> 0); default ``$KVMETER_GPU_POLL_INTERVAL_S``,
            else 10 s (a usual Prometheus pace).
    Raises:
        ValueError: if ``interval_s`` is not positive or the variable is not a number.
    """

    def __init__(self, collector: NvmlCollector, interval_s: float | None = None) -> None:
        if interval_s is None:
            raw = os.environ.get(INTERVAL_ENV, "10")
            try:
                interval_s = float(raw)
            except ValueError:
                raise ValueError(f"{INTERVAL_ENV}={raw!r} is not a number") from None
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.collector = collector
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuCollectorStatus:
        """Initialise NVML and, if a GPU is readable, start the thread (no-op if running).

        Without a usable GPU (``no_gpu``, ``error``) it logs one line, publishes the status once
        (so ``kvmeter_gpu_nvml_available`` reads 0) and starts no thread: everything else keeps
        working. Blocks for NVML's initialisation — call it off the event loop.

        Returns:
            The collector's status.
        """
        if self._thread is not None:
            return self.collector.status
        status = self.collector.status if self.collector.started else self.collector.start()
        if status.state != "ok":
            log.info("no GPU: %s (%s); GPU readings are off, everything else runs",
                     status.state, status.reason or "no reason given")
            self.collector.collect()  # publishes the status only
            return status
        self._thread = threading.Thread(target=self._run, name="kvmeter-gpu-poller", daemon=True)
        self._thread.start()
        return status

    @property
    def running(self) -> bool:
        """True while the polling thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to finish, wait for it, and close NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.collector.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.collector.collect()
                if self.collector.status.xid_events_supported:
                    # the event wait is the pause between collections; it returns early on an XID
                    waited_ms = 0
                    step_ms = 500  # re-check the stop flag twice a second
                    while waited_ms < self.interval_s * 1000 and not self._stop.is_set():
                        self.collector.poll_xid(timeout_ms=step_ms)
                        waited_ms += step_ms
                else:
                    self._stop.wait(self.interval_s)
            except Exception:  # noqa: BLE001 — the poller must outlive a bad reading
                log.exception("GPU collection failed; retrying next interval")
                self._stop.wait(self.interval_s)
