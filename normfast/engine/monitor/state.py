"""The monitor's identity and resume state: the settings its fingerprint covers (:func:`monitor_spec`),
what :meth:`TrainingMonitor.state_dict` holds beside the training checkpoint, and the checks
:meth:`TrainingMonitor.load_state_dict` makes before it trusts one."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from normfast.engine.monitor.schema import MONITOR_FORMAT, MONITOR_VERSION

__all__ = ["STATE_VERSION", "check_state", "monitor_spec", "pack_rows", "unpack_rows"]

#: the version of the state dict's layout
STATE_VERSION = 1


def pack_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recorded rows not yet written, as tensors and lists (``torch.load(weights_only=True)`` reads them)."""
    return [{k: (list(v) if k == "id" else torch.from_numpy(np.asarray(v).copy())) for k, v in r.items()} for r in rows]


def unpack_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`pack_rows` undone."""
    return [{k: (list(v) if k == "id" else v.numpy()) for k, v in r.items()} for r in rows]


def check_state(fn: str, state: Mapping[str, Any], spec_fingerprint: str) -> None:
    """A monitor state of this format and version, made with the same settings and probes."""
    if state.get("format") != MONITOR_FORMAT or state.get("state_version") != STATE_VERSION:
        raise ValueError(
            f"{fn}: not a monitor state (format={state.get('format')!r}, state_version={state.get('state_version')!r})"
        )
    if state["spec_fingerprint"] != spec_fingerprint:
        raise ValueError(
            f"{fn}: the checkpoint's monitor was made with other settings or probes "
            f"(fingerprint {state['spec_fingerprint']} != {spec_fingerprint})"
        )


def monitor_spec(
    model_name: str,
    probes: list[Any],
    ids: list[str],
    *,
    every: int,
    terms: bool,
    virtual: int,
    objective: Any,
    virtual_batch_size: int,
    virtual_seed: int,
    flush_every: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Everything that defines a monitor's rows: written into its metadata, fingerprinted for resume."""
    from normfast.engine.runner.provenance import hash_items

    virtual_settings = None
    if virtual:
        from normfast.engine.directions.objectives import objective_settings

        virtual_settings = {
            "objective": getattr(objective, "name", str(objective)),
            "objective_settings": objective_settings(objective),
            "batch_size": virtual_batch_size,
            "seed": virtual_seed,
            "drift": "per batch over the M batches (averaged over the window's states)",
        }
    return {
        "format": MONITOR_FORMAT,
        "monitor_version": MONITOR_VERSION,
        "model": model_name,
        "n_items": len(probes),
        "probes_fingerprint": hash_items([*probes, *ids]),
        "every": every,
        "terms": terms,
        "virtual": virtual,
        "virtual_settings": virtual_settings,
        "flush_every": flush_every,
        "dtype": str(dtype).replace("torch.", ""),
    }
