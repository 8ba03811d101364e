"""The monitor's identity and resume state: the settings its fingerprint covers (:func:`monitor_spec`),
what :meth:`TrainingMonitor.state_dict` holds beside the training checkpoint, and the checks
:meth:`TrainingMonitor.load_state_dict` makes before it trusts one.

A state is trusted only when it is whole and agrees with itself, with the model and with the blocks
on disk (:func:`check_state`, :func:`check_model`, :func:`check_blocks`): every check runs before
anything in the monitor folder is touched, and a refusal is one ``ValueError`` line that deletes
nothing. The state records the monitored parameters' names, shapes and dtypes, so that a checkpoint
resumed on another model (a wider layer) is refused instead of mixing two networks' steps in one
``monitor.parquet``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

from normfast.core.checks import first_line
from normfast.data.formats import format_version
from normfast.data.runwriter import chunk_file, verify_chunk
from normfast.engine.monitor.layout import CHANGES as MONITOR_CHANGES
from normfast.engine.monitor.layout import MONITOR_FORMAT, MONITOR_VERSION, TIMING_KEYS

__all__ = [
    "STATE_VERSION",
    "check_blocks",
    "check_model",
    "check_state",
    "monitor_spec",
    "monitored_mismatch",
    "pack_rows",
    "parameter_signature",
    "state_header",
    "unpack_rows",
]

#: the version of the state dict's layout
STATE_VERSION = 3
#: state version -> what changed (one line each)
CHANGES = {
    1: "the first state layout",
    2: "monitor_version and the monitored parameters (names, shapes, dtypes), checked on resume",
    3: "term_sums: the realized terms summed over the steps since the last stored row (average=True)",
}
#: the clock's keys before it timed clean steps (such states still load); now TIMING_KEYS
_TIMING = ("train_seconds", "terms_seconds", "virtual_seconds", "timed_steps")
_INTEGER_COLUMNS = ("step", "item", "n_steps")


def pack_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recorded rows not yet written, as tensors and lists (``torch.load(weights_only=True)`` reads them)."""
    return [{k: (list(v) if k == "id" else torch.from_numpy(np.asarray(v).copy())) for k, v in r.items()} for r in rows]


def unpack_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`pack_rows` undone."""
    return [{k: (list(v) if k == "id" else v.numpy()) for k, v in r.items()} for r in rows]


def state_header() -> dict[str, Any]:
    """What a state says of itself: its format and versions (the first keys of every state dict)."""
    return {"format": MONITOR_FORMAT, "state_version": STATE_VERSION, "monitor_version": MONITOR_VERSION}


def parameter_signature(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``[[name, shape, dtype], ...]`` of the monitored parameters: what identifies the model cheaply."""
    return [[n, list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in named]


def _count(fn: str, state: Mapping[str, Any], key: str, *, optional: bool = False) -> int | None:
    value = state.get(key)
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{fn}: the state's {key!r} is {value!r}, expected an int >= 0{' or None' * optional}")
    return value


def _pending(fn: str, rows: Any, *, n_items: int, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The state's rows not yet written, checked (types, columns, one value per item) and unpacked."""
    if not isinstance(rows, list):
        raise ValueError(f"{fn}: the state's 'pending' is a {type(rows).__name__}, expected a list of recorded rows")
    for i, row in enumerate(rows):
        where = f"{fn}: the state's 'pending' row {i}"
        if not isinstance(row, dict) or set(row) != set(columns):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{where} has the columns {got}, expected {sorted(columns)}")
        ids = row["id"]
        if not isinstance(ids, list) or len(ids) != n_items or not all(isinstance(x, str) for x in ids):
            raise ValueError(f"{where}: 'id' is not a list of {n_items} strings")
        for k, v in row.items():
            if k == "id":
                continue
            if not torch.is_tensor(v) or v.ndim != 1:
                raise ValueError(f"{where}: {k!r} is a {type(v).__name__}, expected a 1-d tensor")
            if len(v) != n_items:
                raise ValueError(f"{where}: {k!r} holds {len(v)} values, expected {n_items}")
            if (k in _INTEGER_COLUMNS) == v.is_floating_point():
                raise ValueError(
                    f"{where}: {k!r} is {v.dtype}, expected {'integers' if k in _INTEGER_COLUMNS else 'floats'}"
                )
        if not bool((row["step"] == row["step"][0]).all()):
            raise ValueError(f"{where}: its 'step' values differ (one recorded step per row)")
    return unpack_rows(rows)


def _term_sums(fn: str, value: Any, *, n_items: int) -> dict[str, Any]:
    """The state's running sums of the realized terms (state version 3; before it, none), checked."""
    where = f"{fn}: the state's 'term_sums'"
    if not isinstance(value, dict) or set(value) != {"sums", "steps"} or not isinstance(value["sums"], dict):
        raise ValueError(f"{where} is not a dict of 'sums' (term -> tensor) and 'steps'")
    steps = _count(fn, value, "steps")
    for k, v in value["sums"].items():
        if not torch.is_tensor(v) or v.shape != (n_items,) or v.dtype != torch.float64:
            raise ValueError(f"{where}: {k!r} is not a float64 tensor of {n_items} values")
    if (steps == 0) != (not value["sums"]):
        raise ValueError(f"{where}: {steps} steps summed but {len(value['sums'])} sums")
    return value


def _info(fn: str, text: Any) -> dict[str, Any] | None:
    try:
        info = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{fn}: the state's 'info' is not JSON ({first_line(exc)})") from None
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"{fn}: the state's 'info' is a {type(info).__name__}, not a JSON object")
    return info


def _parameters(fn: str, value: Any) -> list[list[Any]] | None:
    ok = value is None or (
        isinstance(value, list)
        and all(
            isinstance(p, list)
            and len(p) == 3
            and isinstance(p[0], str)
            and isinstance(p[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in p[1])
            and isinstance(p[2], str)
            for p in value
        )
    )
    if not ok:
        raise ValueError(f"{fn}: the state's 'parameters' is not a list of [name, shape, dtype]")
    return value


def _steps(fn: str, st: Mapping[str, Any], pending: list[dict[str, Any]], *, every: int, flush_every: int) -> None:
    """The counts and steps agree with each other: no step would be recorded twice, none skipped."""
    recorded, chunks, first, last, nxt = (st[k] for k in ("recorded", "chunks", "first_step", "last_step", "next_step"))
    if recorded != chunks * flush_every + len(pending):
        raise ValueError(
            f"{fn}: recorded={recorded} does not match the state's {chunks} blocks of {flush_every} steps + "
            f"{len(pending)} pending (the state was changed, or is another monitor's)"
        )
    if st["steps_seen"] < recorded:
        raise ValueError(f"{fn}: steps_seen={st['steps_seen']} is less than recorded={recorded}")
    if (first is None) != (recorded == 0) or (last is None) != (recorded == 0):
        raise ValueError(f"{fn}: first_step={first!r} and last_step={last!r} do not fit recorded={recorded}")
    if not recorded:
        return
    for name, step in (("first_step", first), ("last_step", last)):
        if step % every:
            raise ValueError(f"{fn}: {name}={step} is not a recorded step (every={every})")
    if first > last:
        raise ValueError(f"{fn}: first_step={first} is after last_step={last}")
    if nxt <= last:
        raise ValueError(f"{fn}: next_step={nxt} is not after last_step {last}: step {last} would be recorded again")
    if nxt > last + every:
        raise ValueError(
            f"{fn}: next_step={nxt} but the last recorded step is {last}: the resumed run would skip steps "
            f"{last + 1} to {nxt - 1}, of which step {last + every} is one to record"
        )
    previous = None
    for i, row in enumerate(pending):
        step = int(row["step"][0])
        if step > last:
            raise ValueError(f"{fn}: the state's 'pending' row {i} is step {step}, after last_step {last}")
        if step < first or step % every or (previous is not None and step <= previous):
            raise ValueError(f"{fn}: the state's 'pending' row {i} is step {step}, not the next recorded step")
        previous = step
    if pending and previous != last:
        raise ValueError(f"{fn}: the state's last pending row is step {previous}, its last_step {last}")


def check_state(
    fn: str, state: Any, spec_fingerprint: str, *, n_items: int, every: int, flush_every: int, columns: Sequence[str]
) -> dict[str, Any]:
    """A monitor state checked whole before any of it is used: this format, a version this normfast
    reads (a newer one: upgrade normfast; version 1, before the parameters were recorded, with a warning),
    the same settings and probes, every field of its type, and counts and steps that agree (no step
    recorded twice or skipped). Returns the fields, parsed (``info`` a dict, ``pending`` rows unpacked).
    Raises one ``ValueError`` line naming the field."""
    if not isinstance(state, Mapping) or state.get("format") != MONITOR_FORMAT:
        what = f"format={state.get('format')!r}" if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{fn}: not a monitor state ({what})")
    version = format_version(
        state,
        fn,
        key="state_version",
        current=STATE_VERSION,
        what="monitor state",
        older="it records no parameters, so the model cannot be checked against it",
        stacklevel=3,
    )
    if version >= 2:
        written = state.get("monitor_version")
        if isinstance(written, int) and not isinstance(written, bool) and 1 <= written < MONITOR_VERSION:
            raise ValueError(
                f"{fn}: the checkpoint's monitor writes monitor format version {written}, this normfast "
                f"{MONITOR_VERSION} ({MONITOR_CHANGES[MONITOR_VERSION]}): finish that run with the normfast that "
                f"started it, or start a new monitor folder"
            )
        format_version(  # a newer version, or a damaged one
            state, fn, key="monitor_version", current=MONITOR_VERSION, what="monitor format", older=""
        )
    if state.get("spec_fingerprint") != spec_fingerprint:
        raise ValueError(
            f"{fn}: the checkpoint's monitor was made with other settings or probes "
            f"(fingerprint {state.get('spec_fingerprint')} != {spec_fingerprint})"
        )
    out = {k: _count(fn, state, k) for k in ("next_step", "steps_seen", "recorded", "chunks")}
    out.update({k: _count(fn, state, k, optional=True) for k in ("first_step", "last_step")})
    timing = state.get("timing")
    if (
        not isinstance(timing, dict)
        or set(timing) not in (set(_TIMING), set(TIMING_KEYS))
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in timing.values())
    ):
        raise ValueError(f"{fn}: the state's 'timing' is not a dict of {', '.join(TIMING_KEYS)} (numbers)")
    timing = {k: 0 for k in TIMING_KEYS} | timing  # a state saved before the clock timed clean steps
    buffers = state.get("decay_buffers")
    if not isinstance(buffers, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in buffers.items()):
        raise ValueError(f"{fn}: the state's 'decay_buffers' is not a dict of parameter names to tensors")
    if state.get("decay_buffer") not in (None, "exact", "warm-started"):
        raise ValueError(f"{fn}: the state's 'decay_buffer' is {state.get('decay_buffer')!r}")
    out["pending"] = _pending(fn, state.get("pending"), n_items=n_items, columns=columns)
    out["term_sums"] = _term_sums(fn, state.get("term_sums", {"sums": {}, "steps": 0}), n_items=n_items)
    if out["term_sums"]["steps"] >= every:
        raise ValueError(f"{fn}: the state's 'term_sums' hold {out['term_sums']['steps']} steps, a row every {every}")
    out["info"] = _info(fn, state.get("info"))
    out["parameters"] = _parameters(fn, state.get("parameters")) if version >= 2 else None
    _steps(fn, out, out["pending"], every=every, flush_every=flush_every)
    if out["parameters"] is not None and not set(buffers) <= {p[0] for p in out["parameters"]}:
        raise ValueError(f"{fn}: the state's 'decay_buffers' name parameters it did not monitor")
    out.update(timing=dict(timing), decay_buffers=buffers, decay_buffer=state.get("decay_buffer"))
    return out


def check_model(fn: str, parameters: list[list[Any]] | None, model: torch.nn.Module) -> None:
    """The model has every parameter the checkpoint's monitor watched, of the same shape and dtype
    (``ValueError`` naming the first that differs)."""
    named = dict(model.named_parameters())
    for name, shape, dtype in parameters or ():
        here = named.get(name)
        if here is None:
            problem = f"parameter {name!r} is not in this one"
        elif list(here.shape) != shape:
            problem = f"parameter {name!r} has shape {tuple(here.shape)} here, {tuple(shape)} in the checkpoint"
        elif str(here.dtype).replace("torch.", "") != dtype:
            problem = f"parameter {name!r} is {str(here.dtype).replace('torch.', '')} here, {dtype} in the checkpoint"
        else:
            continue
        raise ValueError(
            f"{fn}: the checkpoint's monitor watched another model: {problem}; resume it with the model it was "
            f"made with (its rows would mix two networks), or start a new monitor folder"
        )


def monitored_mismatch(parameters: list[list[Any]] | None, names: Sequence[str]) -> str | None:
    """Why the parameters monitored now differ from the checkpoint's (None: they do not)."""
    before = [p[0] for p in parameters or ()]
    if parameters is None or before == list(names):
        return None
    for name in before:
        if name not in names:
            return f"the checkpoint's monitor monitored {name!r}, which the optimizer does not update here"
    extra = next((n for n in names if n not in before), None)
    if extra is not None:
        return f"the optimizer updates {extra!r}, which the checkpoint's monitor did not monitor"
    return "the monitored parameters are in another order than the checkpoint's"


def _steps_of(path: Path) -> np.ndarray:
    return pq.read_table(path, columns=["step"]).column("step").to_numpy()


def check_blocks(fn: str, parts: Path, st: Mapping[str, Any], *, n_items: int, flush_every: int) -> None:
    """The blocks a state counts are in the work folder ``parts``, whole and of the steps the state says;
    a block written after the checkpoint starts where the state goes on. Reads only; a refusal (one
    ``ValueError`` line) deletes nothing."""
    chunks, pending = st["chunks"], st["pending"]
    nothing = "nothing was deleted"
    missing = [i for i in range(chunks) if not chunk_file(parts, i).is_file()]
    if missing:
        raise ValueError(
            f"{fn}: {parts} lacks block(s) {missing[:5]} written before the checkpoint: the folder does not belong "
            f"to this checkpoint; {nothing}"
        )
    for i in range(chunks):
        problem = verify_chunk(chunk_file(parts, i))
        if problem is None and pq.read_metadata(chunk_file(parts, i)).num_rows != flush_every * n_items:
            problem = f"it does not hold {flush_every} recorded steps of {n_items} items"
        if problem is not None:
            raise ValueError(
                f"{fn}: block {i} ({chunk_file(parts, i)}) cannot be used ({problem}): the folder was damaged, or "
                f"does not belong to this checkpoint; {nothing}"
            )
    if chunks:
        start, end = int(_steps_of(chunk_file(parts, 0))[0]), int(_steps_of(chunk_file(parts, chunks - 1))[-1])
        if start != st["first_step"]:
            raise ValueError(f"{fn}: first_step={st['first_step']} but block 0 starts at step {start}; {nothing}")
        limit = int(pending[0]["step"][0]) if pending else st["last_step"] + 1
        if end >= limit or (not pending and end != st["last_step"]):
            raise ValueError(
                f"{fn}: block {chunks - 1} ends at step {end}, where the state goes on at step {limit}; {nothing}"
            )
    after = chunk_file(parts, chunks)
    if after.is_file() and verify_chunk(after) is None:  # written after the checkpoint (a damaged one is redone)
        start = int(_steps_of(after)[0])
        expected = int(pending[0]["step"][0]) if pending else None
        if (expected is not None and start != expected) or (
            expected is None and st["last_step"] is not None and start <= st["last_step"]
        ):
            raise ValueError(
                f"{fn}: block {chunks} on disk starts at step {start}, but the state's next rows start at step "
                f"{expected if expected is not None else st['last_step'] + 1}: the state's counts were changed, or "
                f"it belongs to another run; {nothing}"
            )


def monitor_spec(
    model_name: str,
    probes: list[Any],
    ids: list[str],
    *,
    every: int,
    average: bool,
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
        "average": average,
        "terms": terms,
        "virtual": virtual,
        "virtual_settings": virtual_settings,
        "flush_every": flush_every,
        "dtype": str(dtype).replace("torch.", ""),
    }
