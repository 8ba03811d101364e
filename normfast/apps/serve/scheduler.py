"""The fair queue of ``normfast serve``: requests split into small work units, run one unit at a time
on one worker thread, interleaved across requests.

The model is one, so the probes run one at a time; a request that runs whole holds every other for
its whole length (32 texts of 2,000 characters: over a minute on a CPU). Here each request is a
list of work units (a few texts, at most one model window of tokens: :func:`work_units`), and the
worker takes the requests round robin: one unit of the request at the head of the queue, which then
goes to the back. A request that arrives while a long one runs waits for the unit in progress and
one unit of each request ahead of it, never for the whole of any. At most ``max_pending`` requests
wait at once; the next is refused at once (503 with ``Retry-After``), so the queue's memory stays
bounded (each request is within the service's limits on texts and characters).

A unit's rows do not depend on the other units of its request: the relative heat is measured
against the reference fixed with the directions (``Prober.heat_reference``), so a request split into
units answers what the whole request would (to float rounding: padding differs).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from normfast.apps.serve.protocol import RequestError

#: requests that may wait at once (the next is refused with 503)
MAX_PENDING = 64


def work_units(lengths: Sequence[int], budget: int) -> list[range]:
    """Consecutive texts grouped into units of at most ``budget`` tokens together (a longer text is a unit
    of its own); ``lengths``: each text's tokens (as the model reads them: at most its window)."""
    units: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            units.append(range(start, i))
            start, used = i, 0
        used += n
    if lengths:
        units.append(range(start, len(lengths)))
    return units


@dataclass
class Job:
    """One request: its units, the results so far, when it came, its future."""

    units: list[Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    results: list[Any] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)
    busy: float = 0.0  # seconds its own units ran


class FairScheduler:
    """Runs ``run_unit(unit)`` for the units of every submitted request on one worker thread, round robin
    across requests (module docstring). :meth:`submit` returns a future of ``(results, busy, queued)``:
    the units' results in order, the seconds they ran, and the seconds the request waited for others."""

    def __init__(self, run_unit: Callable[[Any], Any], *, max_pending: int = MAX_PENDING):
        if max_pending < 1:
            raise ValueError(f"FairScheduler: max_pending must be at least 1, got {max_pending}")
        self.run_unit = run_unit
        self.max_pending = max_pending
        self._jobs: deque[Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="normfast-serve-worker", daemon=True)
        self._worker.start()

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return len(self._jobs)

    def submit(self, units: Sequence[Any]) -> concurrent.futures.Future:
        """Queue one request's units; a :class:`RequestError` (503) when ``max_pending`` already wait."""
        job = Job(list(units))
        if not job.units:
            job.future.set_result(([], 0.0, 0.0))
            return job.future
        with self._wake:
            if self._closed:
                raise RequestError(503, "the service is stopping; send the request again later")
            if len(self._jobs) >= self.max_pending:
                raise RequestError(
                    503,
                    f"{len(self._jobs)} requests are waiting already (the limit); send it again in a few seconds",
                    {"Retry-After": "5"},
                )
            self._jobs.append(job)
            self._wake.notify()
        return job.future

    def run(self, units: Sequence[Any], timeout: float | None = None) -> tuple[list[Any], float, float]:
        """:meth:`submit` and wait for the result (for callers on a thread of their own)."""
        return self.submit(units).result(timeout)

    def close(self) -> None:
        """Stop the worker after the unit in progress; requests still waiting are refused."""
        with self._wake:
            self._closed = True
            left = list(self._jobs)
            self._jobs.clear()
            self._wake.notify_all()
        for job in left:
            if not job.future.done():
                job.future.set_exception(RequestError(503, "the service stopped before the request ran"))
        if self._worker is not threading.current_thread():
            self._worker.join(timeout=60)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job = self._jobs[0]
            t0 = time.perf_counter()
            try:
                job.results.append(self.run_unit(job.units[len(job.results)]))
            except BaseException as exc:  # noqa: BLE001 - handed to the request that owns the unit
                failed: BaseException | None = exc
            else:
                failed = None
            job.busy += time.perf_counter() - t0
            with self._wake:
                if self._jobs and self._jobs[0] is job:
                    self._jobs.popleft()
                    if failed is None and len(job.results) < len(job.units):
                        self._jobs.append(job)  # round robin: its next unit after one of every other request
            if job.future.done():  # refused by close() while its unit ran
                continue
            if failed is not None:
                job.future.set_exception(failed)
            elif len(job.results) == len(job.units):
                job.future.set_result((job.results, job.busy, time.perf_counter() - job.arrived - job.busy))
