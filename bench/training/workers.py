"""Checkpoints probed after training, in one worker process per core (:func:`probe_checkpoints`)."""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm.auto import tqdm

from bench.training.checkpoints import CheckpointLaw
from bench.training.storage import CheckpointSnapshots

_JOB: dict[str, Any] = {}  # what a forked probe worker needs (set before the pool forks)


def _probe_job(i: int) -> float:
    """Worker: every law at checkpoint ``i``, the result stored beside the snapshot; returns its CPU seconds."""
    laws, snapshots = _JOB["laws"], _JOB["snapshots"]
    c0 = time.process_time()
    snapshots.load_into(i)
    snapshots.save_result(i, {name: law.measure(i) for name, law in laws.items()})
    return time.process_time() - c0


def _worker_threads(n: int) -> None:
    torch.set_num_threads(n)


def probe_checkpoints(
    laws: dict[str, CheckpointLaw],
    snapshots: CheckpointSnapshots,
    *,
    workers: int | None = None,
    progress: bool = True,
    desc: str = "probe checkpoints",
) -> dict[str, float]:
    """Run every law at every snapshot not probed yet and add all results to the laws in order.

    ``workers`` processes (forked, each on ``threads // workers`` torch threads; default: one
    per torch thread) probe one checkpoint each at a time; each result is stored beside its
    snapshot as it comes (an interrupted call loses only the checkpoints in flight). One
    worker probes in this process; the parameters hold their values from before the call
    afterwards. Returns the phase's wall seconds, its CPU seconds (this process and the
    workers), the workers' share of them and the number of workers.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    t0, c0 = time.perf_counter(), time.process_time()
    todo = [i for i in snapshots.indices() if not snapshots.has_result(i)]
    threads = torch.get_num_threads()
    workers = max(1, min(workers or threads, len(todo) or 1))
    bar = tqdm(total=len(todo), desc=desc, unit="checkpoint", disable=not progress)
    worker_cpu = 0.0
    current = [p.detach().clone() for p in snapshots.params]
    _JOB.update(laws=laws, snapshots=snapshots)
    try:
        if workers == 1:
            for i in todo:  # its CPU time is this process's own
                _probe_job(i)
                bar.update()
        else:
            with ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context("fork"),
                initializer=_worker_threads,
                initargs=(max(1, threads // workers),),
            ) as pool:
                for fut in as_completed([pool.submit(_probe_job, i) for i in todo]):
                    worker_cpu += fut.result()
                    bar.update()
    finally:
        _JOB.clear()
        with torch.no_grad():
            for p, t in zip(snapshots.params, current):
                p.copy_(t)
    bar.close()
    for i in snapshots.indices():
        result = snapshots.result(i)
        for name, law in laws.items():
            law.add(result[name])
    return {
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0 + worker_cpu,
        "worker_cpu_seconds": worker_cpu,
        "workers": workers if todo else 0,
    }
