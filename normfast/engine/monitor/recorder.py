"""normfast in the training loop: every probe item's radial budget while a model trains.

:class:`TrainingMonitor` hooks around ``optimizer.step()`` of any training loop and,
at every ``every``-th step, records for each probe item its norm and the realized
terms of the steps' change of ``R²`` (:mod:`normfast.engine.monitor.realized`: a jvp of the
item forward along the optimizer's actual step, split into its task and weight-decay
parts as torch's SGD, heavy-ball SGD and AdamW applied them, with AdamW's real state;
by default computed at every step and averaged over the steps since the last row),
optionally beside the engine's virtual drift and heat at that state
(:func:`normfast.engine.probe.probe` with ``M`` virtual batches). Rows stream to
Parquet in blocks of recorded steps; the monitor's :meth:`~TrainingMonitor.state_dict`
goes into the training run's checkpoint, and a run resumed from it writes the same
file as an uninterrupted one. ``normfast report FOLDER`` turns the folder into the
law's window-averaged prediction per item (:mod:`normfast.engine.monitor`).

Cost per step whose terms are computed (every step with ``average=True``, the stored
ones without): the trained parameters copied in float64 (twice), two jvps and one
forward of the probe items through the trained tail (the frozen front -- the stages
before the first trained parameter -- runs once, when the monitor starts); with
``virtual=M`` also one probe of ``M`` virtual batches per stored step. Heavy-ball SGD
with weight decay also needs a float64 copy of its parameters at every step (the
shadow decay buffer). Everything runs in eval mode (no dropout) under
``torch.no_grad``; the training's random streams are not touched.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import torch

from normfast.engine.monitor import state as monitor_state
from normfast.engine.monitor.layout import MONITOR_FILE, SUMMARY_FILE, row_schema, rows_table, step_row
from normfast.engine.monitor.parts import (
    MonitorClock,
    as_encoder,
    check_settings,
    device_of,
    eval_mode,
    folder_metadata,
    frozen_tail,
    monitored_parameters,
    optimizer_info,
    start_buffers,
    unwrap_optimizer,
    virtual_probe,
)
from normfast.engine.monitor.realized import DecaySplit, StepRule, StepSums, parameters_as, step_rules, step_terms


class TrainingMonitor:
    """Record every probe item's norm and realized radial budget while a model trains.

    Call :meth:`before_step` right before ``optimizer.step()`` and :meth:`after_step` right
    after it, on every training step (or :meth:`step` for both), and :meth:`close` at the end::

        mon = normfast.TrainingMonitor(model, probes, every=10, out="runs/train_monitor")
        for batch in loader:
            loss = ...; loss.backward()
            mon.before_step(optimizer)
            optimizer.step()
            mon.after_step()
            optimizer.zero_grad()
        mon.close()

    Args:
        model: the model being trained, or a normfast :class:`~normfast.encoders.Encoder` that
            shares its parameters: an ``Encoder`` is used as is, anything else goes through
            :func:`~normfast.encoders.load_encoder` (an ``nn.Module`` mapping a batch of probe
            items to embeddings; a ``sentence_transformers.SentenceTransformer``).
        probes: the probe items (texts, tensors, ids: whatever the encoder's ``prepare`` takes).
        every: store a row at steps ``0, every, 2·every, ...`` (default: the study in ``docs/monitor.md``).
        average: the realized terms of a stored row are their mean over every step since the
            previous stored row, the stored step included (the column ``n_steps`` says how many):
            the terms are computed at every step, so the window means use every step and the
            balance closes, at the cost of ``every=1`` and the table of ``every``. False: the terms
            of the stored step alone (``1/every`` of the cost; the window means then sample the
            steps, and the law from them is noisier: ``docs/monitor.md``).
        out: the monitor folder (``monitor.parquet``, ``summary.json``); None keeps the rows in
            memory (:meth:`table`).
        terms: compute the realized terms (False: norms only, one forward per recorded step).
        virtual: M ≥ 2 runs the engine's probe with M virtual batches at every recorded state
            (drift, heat, κ, the law at that state); needs ``objective`` and ``pairs``. 0: none.
        objective, pairs: the virtual batches' objective and pair source (as for :func:`probe`).
        virtual_batch_size, virtual_seed: the virtual batches' size, and the seed of their
            draw (step ``s`` draws with ``virtual_seed + s``).
        optimizer: the optimizer, when :meth:`before_step` is called without one.
        ids: a string id per probe item (default: the index).
        flush_every: recorded steps per streamed block (the unit of resume).
        dtype: precision of the jvps (float64: the terms are small differences).
        model_name: recorded in the metadata (default: the model's class name).
        overwrite: replace a finished monitor folder, or an unfinished one that is not resumed.

    Only the parameters the optimizer updates (and that require grad) are monitored; the
    encoder stages before the first of them are frozen and run once. Bad settings raise
    ``ValueError``/``TypeError`` naming the argument.
    """

    def __init__(
        self,
        model: Any,
        probes: Sequence[Any],
        *,
        every: int = 50,
        average: bool = True,
        out: str | os.PathLike | None = "runs/train_monitor",
        terms: bool = True,
        virtual: int = 0,
        objective: Any = None,
        pairs: Any = None,
        virtual_batch_size: int = 32,
        virtual_seed: int = 0,
        optimizer: Any = None,
        ids: Sequence[str] | None = None,
        flush_every: int = 16,
        dtype: torch.dtype = torch.float64,
        model_name: str | None = None,
        overwrite: bool = False,
    ):
        probes, ids = check_settings(
            every=every,
            flush_every=flush_every,
            virtual_batch_size=virtual_batch_size,
            virtual=virtual,
            objective=objective,
            dtype=dtype,
            probes=probes,
            ids=ids,
        )
        self.out = None if out is None else Path(out)
        if self.out is not None and self.out.exists() and not self.out.is_dir():
            raise ValueError(f"TrainingMonitor: out={str(self.out)!r} is a file; expected a folder for the monitor")
        self.encoder = as_encoder(model)
        self.probes = probes
        self.ids = ids if ids is not None else [str(i) for i in range(len(probes))]
        self.every, self.terms, self.virtual, self.average = every, bool(terms), virtual, bool(average)
        self.objective, self.pairs = objective, pairs
        self.virtual_batch_size, self.virtual_seed = virtual_batch_size, int(virtual_seed)
        self.flush_every, self.dtype, self.overwrite = flush_every, dtype, overwrite
        self.model_name = model_name or str(getattr(self.encoder, "name", "") or type(model).__name__)
        self._optimizer = None if optimizer is None else unwrap_optimizer(optimizer)
        self._spec = monitor_state.monitor_spec(
            self.model_name,
            probes,
            self.ids,
            every=every,
            average=self.average,
            terms=self.terms,
            virtual=virtual,
            objective=objective,
            virtual_batch_size=virtual_batch_size,
            virtual_seed=self.virtual_seed,
            flush_every=flush_every,
            dtype=dtype,
        )

        self.next_step = 0  # the step the next before_step() refers to (without step=)
        self.recorded = 0  # recorded steps so far
        self.steps_seen = 0
        self.chunks = 0  # blocks written
        self._pending: list[dict[str, Any]] = []
        self._memory: list[pa.Table] = []
        self._decay = DecaySplit()
        self._decay_mode: str | None = None
        self._info: dict[str, Any] | None = None  # optimizer settings at the first recorded step
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._clock, self._sums = MonitorClock(), StepSums()
        self._names: list[str] | None = None  # monitored parameters (set up at the first step)
        self._resumed: list[list[Any]] | None = None  # [name, shape, dtype] of a loaded state's parameters
        self._current: tuple[int, dict | None, dict, dict | None] | None = None
        #: a clock stretch's work, deferred to the step after it (MonitorClock: that step is clean)
        self._deferred: list[tuple] = []
        self._writer: Any = None
        self._closed = False

    # -- set-up -------------------------------------------------------------------
    def _bind(self, optimizer: Any) -> torch.optim.Optimizer:
        if optimizer is not None:
            self._optimizer = unwrap_optimizer(optimizer)
        if self._optimizer is None:
            raise ValueError(
                "TrainingMonitor: no optimizer: pass it to before_step(optimizer) or to "
                "TrainingMonitor(..., optimizer=...)"
            )
        return self._optimizer

    def _setup(self, optimizer: torch.optim.Optimizer) -> None:
        names, self._param_names = monitored_parameters(self.encoder, optimizer)
        mismatch = monitor_state.monitored_mismatch(self._resumed, names)
        if mismatch is not None:
            self.release()
            raise ValueError(f"TrainingMonitor.before_step: {mismatch}; resume with the optimizer it was made with")
        self._names = names
        self._clock.fit(self.encoder, names, self.dtype)
        self._cut, self._frozen, self._front = frozen_tail(self.encoder, names, self.probes, self.dtype)
        if self.out is not None and self._writer is None:
            self._open_writer(resume=False)

    def _f(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.func import functional_call

        return functional_call(
            self.encoder,
            {**self._frozen, **params},
            (self._front,),
            {"start": self._cut, "output": "pooled"},
            strict=False,
        )

    def _params(self) -> dict[str, torch.Tensor]:
        named = dict(self.encoder.named_parameters())
        return parameters_as(((n, named[n]) for n in self._names), dtype=self.dtype)

    def _open_writer(self, resume: bool) -> None:
        from normfast.data.runwriter import ChunkedParquetWriter

        self.out.mkdir(parents=True, exist_ok=True)
        self._writer = ChunkedParquetWriter(
            self.out / MONITOR_FILE, self._spec, resume=resume, overwrite=self.overwrite
        )

    # -- the steps ------------------------------------------------------------------
    def before_step(self, optimizer: Any = None, *, step: int | None = None) -> None:
        """Call right before ``optimizer.step()``, on every step. ``step``: the step's index
        (default: the monitor's own count, from 0)."""
        if self._closed:
            raise RuntimeError("TrainingMonitor.before_step: the monitor is closed")
        t0 = time.perf_counter()
        opt = self._bind(optimizer)
        if self._names is None:
            self._setup(opt)
        s = self.next_step if step is None else int(step)
        rules = step_rules(opt, self._param_names)
        record = s % self.every == 0
        measure = record or (self.terms and self.average)  # averaged: every step's terms
        buffered = {n: r for n, r in rules.items() if r.shadow_buffer}
        theta = self._params() if (measure or buffered) else None
        if buffered:
            if self._decay_mode is None:
                self._decay_mode = start_buffers(self.encoder, opt, theta, buffered, self._decay)
            self._decay.before_step(theta, buffered)
        virtual = None
        if record and self.virtual:
            t1 = time.perf_counter()
            virtual = virtual_probe(self, opt, rules, s, self._names)
            self._clock.add("virtual_seconds", time.perf_counter() - t1)
            t0 += time.perf_counter() - t1  # the virtual probe's time is counted apart
        self._current = (s, theta if measure else None, rules, virtual, record)
        self._clock.add("terms_seconds", time.perf_counter() - t0)

    def after_step(self, optimizer: Any = None) -> None:
        """Call right after ``optimizer.step()``, on every step."""
        if self._current is None:
            raise RuntimeError("TrainingMonitor.after_step: no before_step() for this step")
        t0 = time.perf_counter()
        if optimizer is not None:
            self._bind(optimizer)
        s, theta, rules, virtual, record = self._current
        self._current, clean = None, self._clock.clean_now(self.steps_seen)
        if theta is not None and self._clock.defer(self.steps_seen):
            # a clock stretch: its work waits for the step after it (the state it needs is copied now)
            self._deferred.append((s, theta, self._params(), self._decay.decay(theta, rules), rules, virtual, record))
            worked = False
        else:
            worked = self._run_deferred() or theta is not None
            if theta is not None:
                self._record(s, theta, rules, virtual, record)
        self._clock.worked(worked)
        self.next_step, self.steps_seen = s + 1, self.steps_seen + 1
        now = time.perf_counter()
        self._clock.add("terms_seconds", now - t0)
        self._clock.step_done(now, clean=clean)

    def _run_deferred(self) -> bool:
        """The clock stretch's deferred work in step order (at the step after it, a state, the end): any?"""
        deferred, self._deferred = self._deferred, []
        for s, theta, new, decay, rules, virtual, record in deferred:
            self._record(s, theta, rules, virtual, record, new=new, decay=decay)
        return bool(deferred)

    def step(self, optimizer: Any, closure: Any = None) -> Any:
        """``before_step``, ``optimizer.step(closure)``, ``after_step``; returns what the step returns."""
        self.before_step(optimizer)
        out = optimizer.step() if closure is None else optimizer.step(closure)
        self.after_step()
        return out

    @torch.no_grad()
    def _record(
        self,
        s: int,
        theta: dict,
        rules: Mapping[str, StepRule],
        virtual: dict | None,
        record: bool,
        *,
        new: dict | None = None,
        decay: dict | None = None,
    ) -> None:
        """Step ``s``'s terms (``theta`` before it; ``new`` and ``decay``: after it and its decay part,
        when they were kept for a deferred step) into the sums, and its row when ``record``."""
        from normfast.encoders import forward_ad_safe

        with eval_mode(self.encoder), forward_ad_safe():
            if self.terms:
                new = self._params() if new is None else new
                decay = self._decay.decay(theta, rules) if decay is None else decay
                t = step_terms(self._f, theta, new, decay)
                cols = {k: t[k] for k in ("task1", "task2", "decay", "remainder")}
                cols["delta_r2"] = t["r2_new"] - t["r2"]
                r2 = t["r2"]
                self._sums.add(cols)  # averaged or not, a stored row holds the mean of the steps since the last
            else:
                cols = {}
                r2 = self._f(theta).square().sum(-1)
        if not record:
            return
        if self.terms:
            cols, steps = self._sums.take()
        lr = rules[self._names[0]].lr
        row = step_row(s, self.ids, lr, r2, cols, steps if self.terms else None, virtual)
        if self._info is None:
            self._info = optimizer_info(self._optimizer, self._param_names, self._names, rules)
        if self._first_step is None:
            self._first_step = s
        self._last_step = s
        self._pending.append(row)
        self.recorded += 1
        if len(self._pending) == self.flush_every:
            self._flush()

    # -- output -------------------------------------------------------------------------
    def _schema(self) -> pa.Schema:
        return row_schema(terms=self.terms, virtual=self.virtual)

    def _rows_table(self, rows: list[dict[str, Any]]) -> pa.Table:
        return rows_table(rows, self._schema())

    def _flush(self) -> None:
        if not self._pending:
            return
        table = self._rows_table(self._pending)
        if self._writer is not None:
            self._writer.write_chunk(self.chunks, table)
        else:
            self._memory.append(table)
        self.chunks += 1
        self._pending = []

    def metadata(self) -> dict[str, Any]:
        """The settings written into ``monitor.parquet`` (no clock: see :meth:`summary`)."""
        return folder_metadata(
            self._spec,
            self._info,
            decay_buffer=self._decay_mode,
            names=self._names,
            cut_stage=getattr(self, "_cut", None),
            steps=(self._first_step, self._last_step, self.recorded),
        )

    def summary(self) -> dict[str, Any]:
        """The run's clock: the monitor's time against the training's (``summary.json``)."""
        return self._clock.summary(steps=self.steps_seen, recorded=self.recorded)

    def table(self) -> pa.Table:
        """Every row recorded so far (from memory, or the blocks written and the pending ones; after
        :meth:`close`, ``monitor.parquet``)."""
        if self._closed and self.out is not None:
            from normfast.data.io import read_parquet

            return read_parquet(self.out / MONITOR_FILE)  # its page checksums verified
        if self._writer is not None:
            tables = [self._writer.read_chunk(i) for i in range(self.chunks)]
        else:
            tables = list(self._memory)
        if self._pending:
            tables.append(self._rows_table(self._pending))
        return pa.concat_tables(tables) if tables else self._schema().empty_table()

    def close(self) -> Path | None:
        """Write the last block and ``monitor.parquet`` and ``summary.json``; returns the Parquet path
        (None without ``out``). Idempotent."""
        if self._closed:
            return None if self.out is None else self.out / MONITOR_FILE
        if self._current is not None:
            raise RuntimeError("TrainingMonitor.close: before_step() without its after_step()")
        t0 = time.perf_counter()
        self._run_deferred()
        self._flush()
        self._closed = True
        if self.out is None:
            return None
        if self._writer is None:
            if not self.recorded:
                warnings.warn(
                    "TrainingMonitor.close: no step was recorded; nothing written", RuntimeWarning, stacklevel=2
                )
                return None
            self._open_writer(resume=False)
        path = self._writer.finalize(self.chunks, self.metadata())
        self._clock.add("terms_seconds", time.perf_counter() - t0)  # the monitor's own time, as its hooks'
        from normfast.data.atomic import write_text_atomically  # the existing helper: aside, then renamed
        from normfast.data.io import json_ready

        write_text_atomically(json.dumps(json_ready(self.summary()), indent=1) + "\n", self.out / SUMMARY_FILE)
        return path

    def release(self) -> None:
        """Stop without finishing: the folder keeps the blocks written so far, and a run resumed from a
        :meth:`state_dict` continues them (a crash does the same)."""
        if self._writer is not None:
            self._writer.release()
            self._writer = None
        self._closed = True

    def __enter__(self) -> "TrainingMonitor":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.release()

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a training checkpoint must hold to resume the monitor (tensors, lists, numbers and
        strings only: ``torch.load(weights_only=True)`` reads it)."""
        from normfast.data.io import fingerprint

        if self._current is not None:
            raise RuntimeError("TrainingMonitor.state_dict: called between before_step() and after_step()")
        t0 = time.perf_counter()
        self._clock.worked(True)  # the checkpoint's own work comes before the next step
        self._run_deferred()  # a checkpoint holds every step's work
        self._clock.add("terms_seconds", time.perf_counter() - t0)
        named = dict(self.encoder.named_parameters())
        return {
            **monitor_state.state_header(),
            "parameters": self._resumed
            if self._names is None
            else monitor_state.parameter_signature((n, named[n]) for n in self._names),
            "spec_fingerprint": fingerprint(self._spec),
            "next_step": self.next_step,
            "steps_seen": self.steps_seen,
            "recorded": self.recorded,
            "chunks": self.chunks,
            "pending": monitor_state.pack_rows(self._pending),
            "decay_buffers": self._decay.state_dict(),
            "decay_buffer": self._decay_mode,
            "info": json.dumps(self._info),
            "first_step": self._first_step,
            "last_step": self._last_step,
            "timing": dict(self._clock.timing),
            "term_sums": self._sums.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a monitor from a checkpoint's :meth:`state_dict` (call before the first step of the
        resumed run). The monitor must have the same settings, probes, model and ``out``; the state is
        checked whole, against the model and against the blocks in ``out``, before anything is used or
        touched (:mod:`normfast.engine.monitor.state`): a refusal is one ``ValueError`` line that deletes
        nothing."""
        from normfast.data.io import fingerprint

        fn = "TrainingMonitor.load_state_dict"
        if self._names is not None:
            raise RuntimeError(f"{fn}: call it before the first step of the resumed run")
        n = len(self.probes)
        st = monitor_state.check_state(
            fn,
            state,
            fingerprint(self._spec),
            n_items=n,
            every=self.every,
            flush_every=self.flush_every,
            columns=self._schema().names,
        )
        monitor_state.check_model(fn, st["parameters"], self.encoder)
        if self.out is not None:
            monitor_state.check_blocks(
                fn, self.out / (MONITOR_FILE + ".parts"), st, n_items=n, flush_every=self.flush_every
            )
        self.next_step, self.steps_seen, self.recorded, self.chunks = (
            st[k] for k in ("next_step", "steps_seen", "recorded", "chunks")
        )
        self._pending, self._info, self._resumed = st["pending"], st["info"], st["parameters"]
        self._decay.load_state_dict(st["decay_buffers"], device_of(self.encoder))
        self._decay_mode, self._clock.timing = st["decay_buffer"], st["timing"]
        self._sums.load_state_dict(st["term_sums"], device_of(self.encoder))
        self._first_step, self._last_step = st["first_step"], st["last_step"]
        if self.out is not None:
            self._open_writer(resume=True)
