"""``MonitorCallback``: :class:`normfast.TrainingMonitor` as a ``transformers.TrainerCallback``.

Works with ``transformers.Trainer`` and every trainer built on it (sentence-transformers'
``SentenceTransformerTrainer``): the monitor's ``before_step`` runs in
``on_pre_optimizer_step`` (after the gradients are clipped), its ``after_step`` in
``on_optimizer_step`` (before the scheduler moves the learning rate), with the trainer's
``global_step`` as the step. Its state is saved beside every checkpoint the trainer writes
(``checkpoint-N/normfast_monitor.pt``) and read back when the trainer resumes from one, so a
resumed run writes the same monitor folder as an uninterrupted one. Only the main process
records (``state.is_world_process_zero``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

from transformers import TrainerCallback

from normfast.data.torchfiles import load_plain, save_plain

#: the monitor's state, beside each checkpoint the trainer writes
STATE_FILE = "normfast_monitor.pt"


#: how many rows of a probe *dataset* the callback takes when ``n_probes`` is not given
DATASET_PROBES = 64


def probe_items(source: Any, n_probes: int | None = None, column: str | None = None) -> list[Any]:
    """The probe items of ``source``: every item of a sequence, or the first rows of a dataset (a
    ``datasets.Dataset`` or a dict of columns) whose ``column`` (default: the first column of strings)
    holds them, :data:`DATASET_PROBES` of them unless ``n_probes`` says. Whenever items are left out,
    one warning says how many of how many, and why."""
    fn = "MonitorCallback"
    names = getattr(source, "column_names", None)
    if names is None and isinstance(source, dict):
        names = list(source)
    if names is not None:
        if column is None:
            first = source[:1] if hasattr(source, "column_names") else {k: v[:1] for k, v in source.items()}
            column = next((c for c in names if first[c] and isinstance(first[c][0], str)), None)
            if column is None:
                raise ValueError(f"{fn}: the probe dataset has no column of strings ({names}); pass column=")
        elif column not in names:
            raise ValueError(f"{fn}: column={column!r} is not a column of the probe dataset ({names})")
        n = DATASET_PROBES if n_probes is None else n_probes
        total = len(source) if hasattr(source, "column_names") else len(source[column])
        items = list(source[:n][column]) if hasattr(source, "column_names") else list(source[column][:n])
        _say_left_out(len(items), total, n_probes is None, "rows of the probe dataset")
        return items
    if isinstance(source, (str, bytes)) or not hasattr(source, "__len__"):
        raise TypeError(f"{fn}: expected probes to be a sequence of items or a dataset, got {type(source).__name__}")
    items = list(source)
    if n_probes is not None and len(items) > n_probes:
        _say_left_out(n_probes, len(items), False, "probe items")
        items = items[:n_probes]
    return items


def _say_left_out(kept: int, total: int, default: bool, what: str) -> None:
    if kept < total:
        why = f"the default for a dataset, {DATASET_PROBES}" if default else "n_probes"
        warnings.warn(
            f"MonitorCallback: probing the first {kept} of {total} {what} ({why}); pass n_probes= for more",
            UserWarning,
            stacklevel=4,
        )


class MonitorCallback(TrainerCallback):
    """Record every probe item's radial budget while a ``transformers`` trainer trains.

    Example (sentence-transformers)::

        monitor = normfast.MonitorCallback(eval_dataset, every=10, out="runs/train_monitor")
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                             eval_dataset=eval_dataset, loss=loss, callbacks=[monitor])
        trainer.train()          # then: normfast report runs/train_monitor

    Args:
        probes: the probe items (every one is probed), or a dataset whose first ``n_probes`` rows are
            the probe set (``column``: which column; default the first column of strings). The trainer
            does not show its datasets to callbacks before it evaluates, so pass the evaluation set here.
        n_probes: how many items to take: default every item of a sequence, the first 64 rows of a
            dataset; a warning says how many were left out.
        column: the dataset column holding the items.
        encoder: a normfast ``Encoder`` sharing the trained model's parameters; default: the
            trainer's model, wrapped by :func:`normfast.load_encoder` (a ``SentenceTransformer``
            is wrapped with its own modules; a plain ``transformers`` model needs an encoder,
            e.g. ``normfast.encoders.HFEncoder(model.bert, tokenizer)`` for its mean-pooled body).
        **monitor: the :class:`normfast.TrainingMonitor` settings (``every``, ``out``, ``terms``,
            ``virtual`` with ``objective`` and ``pairs``, ``ids``, ...).

    The monitor is built when training starts (:attr:`monitor`) and closed when it ends.
    """

    def __init__(
        self,
        probes: Any,
        *,
        n_probes: int | None = None,
        column: str | None = None,
        encoder: Any = None,
        **monitor: Any,
    ):
        if n_probes is not None and (isinstance(n_probes, bool) or not isinstance(n_probes, int) or n_probes < 1):
            raise ValueError(f"MonitorCallback: expected n_probes to be None or an int >= 1, got {n_probes!r}")
        self.items: Sequence[Any] = probe_items(probes, n_probes, column)
        if not self.items:
            raise ValueError("MonitorCallback: the probe set is empty")
        self.encoder = encoder
        self.settings = monitor
        self.monitor: Any = None

    def _build(self, model: Any) -> None:
        from normfast.engine.monitor.recorder import TrainingMonitor

        target = self.encoder if self.encoder is not None else model
        if target is None:
            raise ValueError("MonitorCallback: the trainer passed no model; give encoder=")
        self.monitor = TrainingMonitor(target, self.items, **self.settings)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        self._build(model)
        if state.global_step > 0:  # resumed from a checkpoint: continue its monitor
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"MonitorCallback: the trainer resumed at step {state.global_step} but "
                    f"{path} is missing (the checkpoint was written without the monitor)"
                )
            self.monitor.load_state_dict(load_plain(path, "MonitorCallback: the monitor's state file"))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.before_step(optimizer, step=state.global_step)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.after_step(optimizer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            save_plain(self.monitor.state_dict(), os.path.join(folder, STATE_FILE))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
