"""``LightningMonitor``: :class:`normfast.TrainingMonitor` as a Lightning callback (optional extra).

Lightning is not a dependency of normfast (``pip install 'normfast[lightning]'``). This module imports
without it; :class:`LightningMonitor` then raises ``ModuleNotFoundError`` naming the extra when built.
The monitor's ``before_step`` runs in ``on_before_optimizer_step`` (after the backward, before the
update), its ``after_step`` in ``on_train_batch_end`` (after the update), with ``trainer.global_step``
as the step; its state goes into Lightning's checkpoints through the callback's ``state_dict``.
"""

from __future__ import annotations

from typing import Any, Sequence

try:  # the unified package first, then the standalone one
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning.callbacks import Callback as _Callback
    except ImportError:
        _Callback = None

#: whether a Lightning package is installed
AVAILABLE = _Callback is not None


class LightningMonitor(_Callback if AVAILABLE else object):  # type: ignore[misc]
    """Record every probe item's radial budget while a Lightning ``Trainer`` trains.

    Args:
        probes: the probe items.
        encoder: a normfast ``Encoder`` sharing the LightningModule's parameters; default: the
            LightningModule itself, wrapped by :func:`normfast.load_encoder` (its ``forward`` must
            map a batch of probe items, as the encoder's ``prepare`` stacks them, to embeddings).
        **monitor: the :class:`normfast.TrainingMonitor` settings (``every``, ``out``, ...).

    With several optimizers only the first is monitored.
    """

    def __init__(self, probes: Sequence[Any], *, encoder: Any = None, **monitor: Any):
        if not AVAILABLE:
            raise ModuleNotFoundError(
                "LightningMonitor needs Lightning: pip install 'normfast[lightning]' (or lightning / pytorch-lightning)"
            )
        super().__init__()
        self.items = list(probes)
        self.encoder = encoder
        self.settings = monitor
        self.monitor: Any = None
        self._saved: dict[str, Any] | None = None
        self._open = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is None and stage == "fit" and trainer.is_global_zero:
            from normfast.engine.monitor.recorder import TrainingMonitor

            self.monitor = TrainingMonitor(
                self.encoder if self.encoder is not None else pl_module, self.items, **self.settings
            )
            if self._saved is not None:
                self.monitor.load_state_dict(self._saved)
                self._saved = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is not None and optimizer is trainer.optimizers[0]:
            self.monitor.before_step(optimizer, step=trainer.global_step)
            self._open = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is not None and self._open:  # an accumulation batch without a step: nothing to close
            self.monitor.after_step()
            self._open = False

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict() if self.monitor is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.monitor is not None:
            self.monitor.load_state_dict(state_dict)
        else:
            self._saved = dict(state_dict)
