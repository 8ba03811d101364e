"""The monitor folder's contract: every column and metadata key a training monitor writes.

A monitor folder (``normfast.TrainingMonitor(..., out=FOLDER)``) is a format of
its own, beside the probe table of :mod:`normfast.data.schema`: it holds

* ``monitor.parquet`` -- one row per probe item per recorded training step
  (:data:`COLUMNS`), with the monitor's settings as a JSON object under the
  schema metadata key ``normfast`` (:data:`METADATA_KEYS`; the same key as a
  probe run's, told apart by ``format``);
* ``monitor.parquet.parts/`` while training runs (finished blocks of recorded
  steps, one Parquet file each; a resumed run continues them);
* ``summary.json`` -- the timing of the run, written at the end
  (:data:`SUMMARY_KEYS`); the Parquet file itself holds no clock, so a run
  stopped and resumed writes the same bytes as an uninterrupted one;
* what ``normfast report FOLDER`` writes: ``report.json``, ``report_items.csv``
  and ``monitor_norms.png``.

The docs' Training monitor page renders these tables from here
(:func:`render_markdown`, the ``schema:monitor`` marker of docs/hooks.py), and the
tests check that the monitor writes exactly what is registered. Changing a column or
a metadata key: change the registry, bump :data:`MONITOR_VERSION`, and add the new
version with its :func:`monitor_fingerprint` to :data:`RELEASED` and one line to
:data:`CHANGES` (``python -m normfast.engine.monitor.layout --fingerprint``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from normfast.data.formats import format_version
from normfast.data.schema import (
    Column,
    MetadataKey,
    column_rows,
    fingerprint_main,
    key_rows,
    registry_problems,
    unregistered_keys,
)

#: the ``format`` metadata value of a monitor folder's Parquet file
MONITOR_FORMAT = "normfast-monitor"
#: version of the monitor format (``metadata["monitor_version"]``)
MONITOR_VERSION = 2
#: the files of a monitor folder
MONITOR_FILE = "monitor.parquet"
SUMMARY_FILE = "summary.json"

CHANGES = {
    1: "the first monitor format",
    2: "the column n_steps and the metadata key average: a row's realized terms may be the mean over every step since "
    "the previous row",
}

_TERMS = "`terms=True` (the default)"
_VIRTUAL = "`virtual=M` (M ≥ 2)"

#: every column of ``monitor.parquet``, in the order the monitor writes them
COLUMNS: tuple[Column, ...] = (
    Column(
        "step",
        "int64",
        "always",
        "the optimizer step (0-based): the row's norm is the state before it, its terms are what it did",
    ),
    Column("item", "int64", "always", "index of the probe item (0-based, in the order given)"),
    Column("id", "string", "always", "the item's id (from `ids=`; else the item index)"),
    Column(
        "lr",
        "double",
        "always",
        "η of the step: the learning rate of the first parameter group that trains a monitored parameter",
    ),
    Column("norm", "double", "always", "R = ‖z‖ before the step"),
    Column(
        "n_steps",
        "int64",
        _TERMS,
        "how many steps the row's realized terms average: with `average=True` (the default) every step since "
        "the previous row, this one included (`every`, the first row 1); with `average=False` 1, the row's own "
        "step (version 1 files have no such column: their terms are the row's step alone)",
    ),
    Column(
        "task1",
        "double",
        _TERMS,
        "first-order task term 2 z·J Δθ_t of a step (Δθ_t: the step without its weight-decay part), averaged "
        "over the row's `n_steps` steps, as are the other terms",
    ),
    Column("task2", "double", _TERMS, "second-order task term ‖J Δθ_t‖²"),
    Column(
        "decay",
        "double",
        _TERMS,
        "decay term 2 z·J Δθ_d + ‖J Δθ_d‖² + 2 J Δθ_t·J Δθ_d (Δθ_d: the step's "
        "weight-decay part, as the optimizer applied it)",
    ),
    Column("remainder", "double", _TERMS, "curvature remainder ‖z'‖² − ‖z + J Δθ‖²: what the linearization misses"),
    Column(
        "delta_r2",
        "double",
        _TERMS,
        "R'² − R², the realized change (the sum of the four terms); averaged over `n_steps` steps it telescopes to "
        "the change of R² over them divided by `n_steps`",
    ),
    Column(
        "virtual_D",
        "double",
        _VIRTUAL,
        "the engine's drift at the state from M virtual batches (D; AdamW: D_w; metadata `law`)",
    ),
    Column("virtual_Q", "double", _VIRTUAL, "the engine's second moment (Q; AdamW: Q_w)"),
    Column("virtual_kappa", "double", _VIRTUAL, "the engine's radial damping κ at the state"),
    Column(
        "virtual_r_eq",
        "double",
        _VIRTUAL,
        "the law solved at this state alone (a snapshot: the report averages D, Q, κ over the window instead)",
    ),
    Column("virtual_r_eq_heat", "double", _VIRTUAL, "the same with the drift set to zero"),
)

#: every key of the monitor's metadata (``normfast.read_metadata(FOLDER / "monitor.parquet")``)
METADATA_KEYS: tuple[MetadataKey, ...] = (
    MetadataKey("format", f"`{MONITOR_FORMAT}`"),
    MetadataKey("monitor_version", "version of this format (an int)"),
    MetadataKey("model", "the model as given (class name or `model_name=`)"),
    MetadataKey("n_items", "number of probe items"),
    MetadataKey("probes_fingerprint", "hash of the probe items and their ids"),
    MetadataKey("every", "a step is recorded (a row stored) when `step % every == 0`"),
    MetadataKey(
        "average",
        "whether a row's realized terms are their mean over every step since the previous row (true: computed at "
        "every step) or the row's own step's (false)",
    ),
    MetadataKey("terms", "whether the realized terms were computed (false: norms only)"),
    MetadataKey("virtual", "M, the virtual batches of the engine's probe at each recorded step (0: none)"),
    MetadataKey("virtual_settings", "the virtual probe's objective, batch size, seed and drift estimator"),
    MetadataKey("flush_every", "recorded steps per streamed block (the unit of resume)"),
    MetadataKey("dtype", "the precision of the jvps (`float64` by default)"),
    MetadataKey("optimizer", "the optimizer's class name"),
    MetadataKey(
        "law", "`sgd` or `adamw`: how the law scales the terms with R (the report's law, the virtual columns' branch)"
    ),
    MetadataKey("lr", "η at the first recorded step (per step: the `lr` column)"),
    MetadataKey("weight_decay", "λ of the decayed parameters (the largest, when groups differ)"),
    MetadataKey("momentum", "heavy-ball β of SGD (0 otherwise); the law uses η/(1−β)"),
    MetadataKey(
        "param_groups",
        "each parameter group's settings at the first recorded step, with the number of monitored tensors in it",
    ),
    MetadataKey(
        "decay_buffer",
        "heavy-ball with weight decay only: `exact` (the shadow buffer saw every step from "
        "the optimizer's first) or `warm-started` (the monitor joined later; its error "
        "decays as β^t); null otherwise",
    ),
    MetadataKey("n_trained_parameters", "number of monitored parameter tensors (those the optimizer updates)"),
    MetadataKey("trained_parameters", "their names (the first 50)"),
    MetadataKey(
        "cut_stage",
        "the first encoder stage that owns a trained parameter (the stages before it are frozen and run once)",
    ),
    MetadataKey("first_step", "the first recorded step"),
    MetadataKey("last_step", "the last recorded step"),
    MetadataKey("recorded_steps", "the number of recorded steps"),
    MetadataKey("spec_fingerprint", "hash of the settings that determine the rows (a resume checks it)"),
    MetadataKey("versions", "library versions (normfast, torch, numpy, pyarrow, python, ...)"),
)

#: the keys of ``summary.json`` (the run's clock; written at the end)
#: the clock's state (``TrainingMonitor.state_dict()["timing"]``, :class:`~normfast.engine.monitor.parts.MonitorClock`)
TIMING_KEYS = ("train_seconds", "terms_seconds", "virtual_seconds", "timed_steps", "clean_seconds", "clean_steps")

SUMMARY_KEYS: tuple[MetadataKey, ...] = (
    MetadataKey("steps", "optimizer steps seen"),
    MetadataKey("recorded_steps", "steps recorded"),
    MetadataKey(
        "train_seconds",
        "wall time of the training steps, the monitor's own time taken out (measured "
        "between consecutive `after_step` calls)",
    ),
    MetadataKey(
        "terms_seconds",
        "the monitor's own time for norms and realized terms: inside its hooks (the blocks flushed there "
        "included) and inside `close()`",
    ),
    MetadataKey("virtual_seconds", "the monitor's own time for the virtual probes"),
    MetadataKey("monitor_seconds", "terms_seconds + virtual_seconds"),
    MetadataKey("wall_seconds", "train_seconds + monitor_seconds: the wall time the clock saw"),
    MetadataKey(
        "clean_steps",
        "training steps timed clean, their training following three `after_step` calls without monitor work "
        "(one where the monitored parameters are over 64 MiB): the steps that far from the last one the monitor "
        "measured, and the step after a stretch of that many steps, from its third step and every 50 steps "
        "after, whose work it defers to that step's `after_step`",
    ),
    MetadataKey("clean_step_seconds", "the mean clean training step (NaN without one)"),
    MetadataKey(
        "overhead_terms",
        "terms_seconds against the training alone (timed_steps x clean_step_seconds; without a clean step, "
        "train_seconds)",
    ),
    MetadataKey("overhead_virtual", "virtual_seconds against the training alone"),
    MetadataKey(
        "overhead_interference",
        "how much slower the training's own steps ran beside the monitor: train_seconds against the training alone, "
        "minus 1",
    ),
    MetadataKey(
        "overhead",
        "the wall-time overhead: wall_seconds against the training alone, minus 1 (the monitor's own time and "
        "the interference; a run without a clean step gives monitor_seconds / train_seconds, a lower bound)",
    ),
    MetadataKey(
        "seconds_per_recorded_step",
        "the monitor's own time per recorded step (terms: with `average=True` the terms of every step "
        "since the last row; virtual)",
    ),
    MetadataKey("seconds_per_train_step", "the mean training step"),
)

#: monitor version -> fingerprint of the registry it was released with
RELEASED = {1: "83c9bdc138359920", 2: "afeb325b245a3f05"}

COLUMN_NAMES = tuple(c.name for c in COLUMNS)


def monitor_fingerprint() -> str:
    """Hash of the column names and types (in order) and of the metadata key names."""
    blob = json.dumps(
        {"columns": [[c.name, c.type] for c in COLUMNS], "metadata": [k.name for k in METADATA_KEYS]}
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_table(schema: Any) -> list[str]:
    """Problems with a monitor table's columns against the registry (empty: it conforms)."""
    return registry_problems(schema, COLUMNS, "normfast/engine/monitor/layout.py COLUMNS")


def check_metadata(metadata: dict[str, Any]) -> list[str]:
    """Problems with a monitor's metadata keys against the registry (empty: it conforms)."""
    return unregistered_keys(metadata, METADATA_KEYS, "normfast/engine/monitor/layout.py METADATA_KEYS")


def monitor_metadata(blob: Any, source: Any) -> dict[str, Any]:
    """A monitor's metadata (``monitor.parquet``'s, or an unfinished folder's settings) as read from
    ``source``, checked once for every reader: a JSON object of this format, of a version this normfast
    reads (a newer one is refused: upgrade normfast; see :func:`normfast.data.schema.format_version`).
    Every refusal is one ``ValueError`` line naming ``source``."""
    if not isinstance(blob, dict):
        raise ValueError(
            f"{source}: its normfast metadata is a {type(blob).__name__}, not a JSON object: the file is damaged "
            f"or was not written by normfast"
        )
    if blob.get("format") != MONITOR_FORMAT:
        raise ValueError(f"{source}: not a training monitor's file (format {blob.get('format')!r})")
    format_version(
        blob,
        source,
        key="monitor_version",
        current=MONITOR_VERSION,
        what="monitor format",
        older="what later versions added is absent (normfast.engine.monitor.layout.CHANGES lists it)",
        stacklevel=2,
    )
    return blob


def render_markdown() -> str:
    """The monitor folder's tables (columns, metadata keys, summary keys), as the docs show them."""
    lines = [
        f"Monitor format version {MONITOR_VERSION} (`normfast.engine.monitor.layout.MONITOR_VERSION`).",
        "",
        f"`{MONITOR_FILE}`: one row per probe item per recorded step.",
        "",
        *column_rows(COLUMNS),
        "",
        *key_rows(METADATA_KEYS),
        "",
        f"`{SUMMARY_FILE}`: the run's clock, written when the monitor is closed.",
        "",
        *key_rows(SUMMARY_KEYS, header="key"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return fingerprint_main("normfast.engine.monitor.layout", monitor_fingerprint, argv)


if __name__ == "__main__":
    raise SystemExit(main())


#: the row columns of the realized terms and of the virtual probe (present when recorded)
TERM_COLUMNS = ("n_steps", "task1", "task2", "decay", "remainder", "delta_r2")
VIRTUAL_COLUMNS = ("virtual_D", "virtual_Q", "virtual_kappa", "virtual_r_eq", "virtual_r_eq_heat")
_TYPES = {"int64": pa.int64(), "string": pa.string(), "double": pa.float64()}


def row_schema(*, terms: bool, virtual: bool) -> pa.Schema:
    """The columns of ``monitor.parquet`` for a monitor that records ``terms`` and/or ``virtual``."""
    present = {"step", "item", "id", "lr", "norm"}
    if terms:
        present.update(TERM_COLUMNS)
    if virtual:
        present.update(VIRTUAL_COLUMNS)
    return pa.schema([pa.field(c.name, _TYPES[c.type]) for c in COLUMNS if c.name in present])


def step_row(
    step: int,
    ids: Sequence[str],
    lr: float,
    r2: Any,
    terms: Mapping[str, Any],
    n_steps: int | None,
    virtual: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One recorded step's rows, column by column (numpy): the step, each item with its id, the learning
    rate, the norm (from ``R²``), the realized ``terms`` (tensors; with ``n_steps``, the steps they average)
    and the ``virtual`` probe's columns."""
    n = len(ids)
    row: dict[str, Any] = {
        "step": np.full(n, step, dtype=np.int64),
        "item": np.arange(n, dtype=np.int64),
        "id": list(ids),
        "lr": np.full(n, lr, dtype=np.float64),
        "norm": r2.sqrt().double().cpu().numpy(),
    }
    row.update({k: v.double().cpu().numpy() for k, v in terms.items()})
    if n_steps is not None:
        row["n_steps"] = np.full(n, n_steps, dtype=np.int64)
    if virtual is not None:
        row.update(virtual)
    return row


def rows_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Recorded rows (one dict of per-item arrays per step) as one table of ``schema``."""
    arrays = [
        pa.array([i for r in rows for i in r["id"]], type=pa.string())
        if f.name == "id"
        else pa.array(np.concatenate([np.asarray(r[f.name]) for r in rows]), type=f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)
