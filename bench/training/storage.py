"""What a run keeps on disk so that an interruption costs little: the resume state of
:func:`~bench.training.stationary.train` (:class:`Resume`) and the parameters at every
checkpoint (:class:`CheckpointSnapshots`), each file written atomically and read back with
``torch.load(weights_only=True)`` (:mod:`normfast.data.torchfiles`): a file planted in a run folder
is refused, never run."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from bench.training.settings import TrainSettings
from normfast.data.torchfiles import load_plain, save_plain


@dataclass
class Resume:
    """Where :func:`train` keeps its state, so that an interrupted run goes on where it stopped.

    The state (trained parameters, the batch generator, the records, the times, and each
    ``parts`` object's ``state_dict()``) is written atomically to ``path`` every ``every``
    steps before the window and after every checkpoint in it; a run started with the same
    settings and an existing ``path`` loads it and continues, drawing the same batches, so
    the result is the one an uninterrupted run gives. A state written with other settings
    or another ``identity`` (whatever else determines the result: the data, the probe's
    settings) is refused (ValueError naming them). ``path`` is removed when the run
    completes unless ``keep``.
    """

    path: Path
    every: int = 500
    parts: dict[str, Any] = field(default_factory=dict)
    keep: bool = False
    identity: dict[str, Any] = field(default_factory=dict)  # what else must match (data, probe settings)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Resume: expected every to be a positive int, got {self.every!r}")

    def save(self, payload: dict[str, Any]) -> None:
        payload = {**payload, "parts": {k: v.state_dict() for k, v in self.parts.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        save_plain(payload, self.path)

    def load(self, settings: TrainSettings, params: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        payload = load_plain(self.path, "Resume: the state file")
        for key, mine in (("settings", asdict(settings)), ("identity", self.identity)):
            if payload.get(key) != mine:
                raise ValueError(
                    f"Resume: {self.path} was written with {key} {payload.get(key)}, this run "
                    f"has {mine}; remove the file to start afresh"
                )
        shapes = [tuple(p.shape) for p in params]
        if [tuple(t.shape) for t in payload["params"]] != shapes:
            raise ValueError(
                f"Resume: {self.path} holds parameters of shapes "
                f"{[tuple(t.shape) for t in payload['params']]}, this run trains {shapes}"
            )
        for name, part in self.parts.items():
            part.load_state_dict(payload["parts"][name])
        return payload


class CheckpointSnapshots:
    """The trained parameters at every checkpoint, one file each in ``folder``, probed later.

    As ``train(on_checkpoint=...)`` it saves ``params`` (a copy) as checkpoint ``i``;
    :func:`probe_checkpoints` then runs the engine on every snapshot and stores each
    result beside it, so an interrupted run loses at most the checkpoints being probed.
    ``identity`` (whatever determines the snapshots: settings, data) is written to the
    folder; a folder written with another identity is refused (ValueError), so results
    of different runs never mix.
    """

    def __init__(self, params: Sequence[torch.Tensor], folder: str | Path, identity: dict[str, Any] | None = None):
        self.params = list(params)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        tag = self.folder / "identity.json"
        mine = json.dumps(identity or {}, sort_keys=True, default=str)
        if tag.exists() and tag.read_text() != mine:
            raise ValueError(
                f"CheckpointSnapshots: {self.folder} holds the checkpoints of another run "
                f"({tag.read_text()[:200]}); remove the folder to start afresh"
            )
        tag.write_text(mine)

    def _path(self, i: int, kind: str) -> Path:
        return self.folder / f"{i:05d}.{kind}.pt"

    def __call__(self, i: int) -> None:
        save_plain([p.detach().clone() for p in self.params], self._path(i, "params"))

    def indices(self) -> list[int]:
        return sorted(int(f.name.split(".")[0]) for f in self.folder.glob("*.params.pt"))

    def load_into(self, i: int) -> None:
        """Copy checkpoint ``i``'s parameters into ``params``."""
        saved = load_plain(self._path(i, "params"), "CheckpointSnapshots: the checkpoint")
        with torch.no_grad():
            for p, t in zip(self.params, saved):
                p.copy_(t)

    def has_result(self, i: int) -> bool:
        return self._path(i, "result").exists()

    def result(self, i: int) -> dict[str, Any]:
        return load_plain(self._path(i, "result"), "CheckpointSnapshots: the result")

    def save_result(self, i: int, result: dict[str, Any]) -> None:
        save_plain(result, self._path(i, "result"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
