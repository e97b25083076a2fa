"""Watching a running job's record for a cancel request, so its stage learns of it within about a second.

A stage notices a cancel at its next `StageContext.check()` (between decoding steps, training steps, forward
batches, prompts): that reads the context's `stop` event, which the watcher here sets. Without it a stage would
learn of a cancel only when it next reported progress, which a slow step can put minutes away. The cost: one read
of the job's record every WATCH_S while the job runs.
"""
from __future__ import annotations

import logging
import threading

from orchestration.jobs import JobStore

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the job's record is read


class CancelWatch:
    """A daemon thread that reads job `job_id`'s record every `every` seconds and sets `stop` once its cancel was
    requested. `close()` ends it (the run is over)."""

    def __init__(self, jobs: JobStore, job_id: str, stop: threading.Event, every: float = WATCH_S):
        self.jobs, self.job_id, self.stop, self.every = jobs, job_id, stop, every
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"eyas-cancel-watch-{job_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.every) and not self.stop.is_set():
            try:
                if self.jobs.get(self.job_id).cancel_requested:
                    self.stop.set()
            except Exception as e:  # noqa: BLE001 - an unreadable record (a store outage) is read again next time
                log.warning("job %s: could not read its record for a cancel request: %s", self.job_id, e)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10.0)  # a read in progress ends soon; a hung store must not hold the job
