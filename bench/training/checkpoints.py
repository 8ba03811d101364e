"""The law at checkpoints: the engine at every checkpoint, the statistics averaged over them, the law
solved on the averages (full and heat-only), the regime check of the averages, and the last
checkpoint alone (:class:`CheckpointLaw`)."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


class CheckpointLaw:
    """The engine at checkpoints; statistics averaged over them; the law on the averages.

    ``probe_fn(seed)`` runs the engine once (a fresh seed, hence fresh virtual
    batches, per checkpoint) and returns its :class:`~normfast.engine.result.ProbeResult`.
    """

    COLUMNS = ("D", "Q", "V2", "se_D", "kappa", "kappa_exempt", "norm")

    def __init__(self, probe_fn: Callable[[int], Any], seed: int):
        self.probe_fn = probe_fn
        self.seed = seed
        self.columns: dict[str, list[np.ndarray]] = {k: [] for k in self.COLUMNS}
        self.last: dict[str, Any] | None = None  # the last checkpoint's r_eq, r_eq_heat and regime
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __call__(self, i: int) -> None:
        """Probe checkpoint ``i`` now, at the current parameters."""
        self.add(self.measure(i))

    def measure(self, i: int) -> dict[str, Any]:
        """The engine at checkpoint ``i`` (seed ``7919·seed + i``): its columns, the last-checkpoint
        entries and its times, without adding them (:meth:`add` does)."""
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.probe_fn(self.seed * 7919 + i)
        return {
            "columns": {col: np.asarray(res.column(col)) for col in self.COLUMNS},
            "last": {
                "r_eq": np.asarray(res.column("r_eq")),
                "r_eq_heat": np.asarray(res.column("r_eq_heat")),
                "regime": res.metadata.get("regime"),
            },
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
        }

    def add(self, entry: dict[str, Any]) -> None:
        """Append one checkpoint's :meth:`measure` (checkpoints in order)."""
        for col in self.COLUMNS:
            self.columns[col].append(entry["columns"][col])
        self.last = entry["last"]
        self.seconds += entry["seconds"]
        self.cpu_seconds += entry["cpu_seconds"]

    def state_dict(self) -> dict[str, Any]:
        """Everything gathered so far (for :class:`Resume`)."""
        return {"columns": self.columns, "last": self.last, "seconds": self.seconds, "cpu_seconds": self.cpu_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.COLUMNS) - set(state["columns"])
        if missing:
            raise ValueError(f"CheckpointLaw.load_state_dict: the state lacks the columns {sorted(missing)}")
        self.columns = {k: list(state["columns"][k]) for k in self.COLUMNS}
        self.last, self.seconds, self.cpu_seconds = state["last"], state["seconds"], state["cpu_seconds"]

    @property
    def n(self) -> int:
        return len(self.columns["D"])

    def averages(self) -> dict[str, np.ndarray]:
        if self.n == 0:
            raise RuntimeError("CheckpointLaw: no checkpoint was probed")
        return {k: np.stack(v).mean(0) for k, v in self.columns.items()}

    def predictions(self, lr: float, weight_decay: float) -> dict[str, np.ndarray]:
        """``full``/``heat`` from the averaged D, Q, κ; ``last_full``/``last_heat`` from the last checkpoint."""
        from normfast.core.equilibrium import equilibrium_norm

        avg = self.averages()
        zero = np.zeros_like(avg["D"])
        law = dict(lr=lr, weight_decay=weight_decay)
        return {
            "full": np.asarray(equilibrium_norm(avg["D"], avg["Q"], avg["kappa"], **law)),
            "heat": np.asarray(equilibrium_norm(zero, avg["Q"], avg["kappa"], **law)),
            "last_full": np.asarray(self.last["r_eq"]),
            "last_heat": np.asarray(self.last["r_eq_heat"]),
        }

    def regime(self, lr: float, weight_decay: float) -> dict[str, Any]:
        """The regime check of the averaged statistics.

        The se of the averaged drift is ``sqrt(mean se_D²) / sqrt(n)``: the checkpoints draw
        independent virtual batches (the drift's own variation along the trajectory is not in it).
        """
        from normfast.engine.diagnostics import classify_rows, run_regime

        avg = self.averages()
        se = np.sqrt(np.mean(np.square(np.stack(self.columns["se_D"])), axis=0) / self.n)
        cols = {**avg, "valid": np.isfinite(avg["D"]) & np.isfinite(avg["kappa"]), "se_D": se}
        rows = classify_rows(cols, lr=lr, weight_decay=weight_decay)
        out = run_regime([{**cols, **rows}])
        out["rows"] = {k: rows[k].tolist() for k in ("regime", "regime_reason")}
        out["last_checkpoint"] = self.last["regime"]
        return out
