"""The chunk loop of a probe run: probe items in chunks, head mode (closed form) or jvp mode
(directions in passes; directions-outer when they do not fit the memory budget), each chunk
finished into its table (:mod:`normfast.engine.runner.rows`) and handed on as soon as it is done."""

from __future__ import annotations

import collections.abc
import warnings
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa
import torch

from normfast.engine.directions.gradients import Directions
from normfast.engine.estimators.uncertainty import jackknife_se
from normfast.engine.runner.adaptive import adaptive_choice
from normfast.engine.runner.files import restore_outer_state, save_outer_state
from normfast.engine.runner.rows import finish_table, row_metadata
from normfast.engine.runner.state import ProbeRun
from normfast.engine.transmission.head.dispatch import head_mode_stats
from normfast.engine.transmission.head.inputs import head_inputs, head_kappa, head_kappa_exempt, prepared_head
from normfast.engine.transmission.jvp import Tail, kappa_from_jvp


def as_probe_sequence(probes: Any) -> Sequence[Any]:
    """The probe items as a sequence: lists and tensors as they are, anything with ``len`` and slicing
    read chunk by chunk (never copied whole), other iterables collected into a list."""
    if isinstance(probes, (list, torch.Tensor)):
        return probes
    if isinstance(probes, (str, bytes, tuple, collections.abc.Mapping)) or not (
        hasattr(probes, "__len__") and hasattr(probes, "__getitem__")
    ):
        return list(probes)
    return probes


def chunk_items(probes: Sequence[Any], c: int, size: int) -> Sequence[Any]:
    items = probes[c * size : (c + 1) * size]
    return items if isinstance(items, (list, torch.Tensor)) else list(items)


def run_chunks(
    run: ProbeRun,
    probes: Sequence[Any],
    ids: Sequence[str] | None,
    todo: list[int],
    emit: Callable[[int, pa.Table], None],
) -> None:
    """Probe the chunks ``todo`` and hand each finished table to ``emit``.

    Sharded runs call this on every rank (directions are a collective), each with its own ``todo``.
    """
    cfg = run.config
    encoder = run.encoder
    was_training = encoder.training
    encoder.eval()
    try:
        choice = adaptive_choice(run, chunk_items(probes, 0, cfg.chunk_size)) if cfg.target_rse is not None else None
        if run.mode == "head":
            dirs = choice.directions if choice is not None else run.all_directions()
            G = prepared_head(encoder, dirs, dtype=run.acc_dtype, groups=run.groups)  # once, for every chunk
            g = None
            bar = run.bar(todo, "probing (head mode)")
            for c in todo:
                items = chunk_items(probes, c, cfg.chunk_size)
                table = _head_chunk(run, items, c, ids, G, g, dirs)
                emit(c, table)
                bar.advance(c, table.num_rows)
            bar.close()
            return
        group = run.direction_group()
        if choice is not None and choice.directions is not None:
            dirs = choice.directions
        elif choice is None and run.fits():
            dirs = run.all_directions()
        else:
            dirs = None
        if dirs is not None:
            bar = run.bar(todo, "probing (jvp mode)")
            for c in todo:
                items = chunk_items(probes, c, cfg.chunk_size)
                table = _jvp_chunk(run, items, c, ids, [dirs])
                emit(c, table)
                bar.advance(c, table.num_rows)
            bar.close()
            return
        # directions-outer: the directions do not fit in the budget together
        per_batch = run.direction_bytes() / 2**20
        beside = f" beside the drift's {run.groups} group means ({run.drift_bytes() / 2**20:.3g} MB)"
        warnings.warn(
            f"probe: {run.M} update directions of {per_batch:.3g} MB each (the probed parameters' size) do not "
            f"fit in half the memory budget ({cfg.memory_budget_mb:.4g} MB, --memory-budget-mb)"
            + (beside if run.drift_bytes() else "")
            + f"; computing them in groups of {group}, the directions-outer loop: every chunk's state is kept "
            f"across the groups and the output written at the end (fewer probed parameters, e.g. the last "
            f"layer, keep the run streaming)",
            stacklevel=3,
        )
        groups = [list(range(lo, min(lo + group, run.M))) for lo in range(0, run.M, group)]
        drift = None
        if cfg.drift_from_mean:
            drift = choice.drift if choice is not None and choice.drift is not None else run.drift_directions()
        emit_all = _jvp_directions_outer(run, probes, ids, todo, groups, drift)
        for c, table in emit_all:
            emit(c, table)
    finally:
        encoder.train(was_training)


def _jvp_chunk(
    run: ProbeRun, items: Sequence[Any], c: int, ids: Sequence[str] | None, dir_groups: Sequence[Directions]
) -> pa.Table:
    state, front, rows = run.front(items)
    tail = Tail(run.encoder, run.names, run.cut, run.output)
    z = tail.primal(front, rows)
    acc = run.new_accumulator(z.shape[0], z.shape[-1])
    for dirs in dir_groups:
        run.jvp_update(acc, tail, front, rows, z, dirs)
    kappa = _jvp_kappa(run, tail, front, rows, z, dir_groups[0])
    drift = run.jvp_drift(tail, front, rows, z, dir_groups[0]) if dir_groups[0].drift is not None else None
    meta = row_metadata(run, state, items, c, ids, rows)
    return finish_table(run, meta, z, _with_drift(run, acc.finalize(), drift), *kappa)


def _moved(obj: Any, device: Any) -> Any:
    """Tensors (in nested dicts) moved to ``device``."""
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


def _with_drift(run: ProbeRun, stats: dict[str, Any], drift: Mapping[str, torch.Tensor] | None) -> dict[str, Any]:
    """The heat statistics of the M batches with the drift (D, se_D, sign_stability, m2) of the M_D batches."""
    if drift is None:
        return stats
    out = dict(stats)
    reason = torch.where(stats["reason"] != 0, stats["reason"], drift["reason"].to(stats["reason"]))
    valid = reason == 0
    loo = dict(stats["loo"]) if "loo" in stats else None
    for b in run.branches:
        sfx = "" if b == "u" else "_w"
        for key in ("D", "se_D", "sign_stability", "m2"):
            out[key + sfx] = drift[key + sfx].to(stats["V2" + sfx])
        out["Q" + sfx] = out["m2" + sfx] + stats["V2" + sfx]
        if loo is not None:  # leave group g out of the drift's batches and the heat's together
            for key in ("D", "m2"):
                loo[key + sfx] = drift["loo"][key + sfx].to(loo["V2" + sfx])
            loo["Q" + sfx] = loo["m2" + sfx] + loo["V2" + sfx]
            out["se_Q" + sfx] = jackknife_se(loo["Q" + sfx])
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            out[key] = torch.where(valid, value, float("nan"))
    if loo is not None:
        out["loo"] = {k: torch.where(valid[:, None], v, float("nan")) for k, v in loo.items()}
    out["valid"], out["reason"] = valid, reason
    return out


def _jvp_kappa(
    run: ProbeRun, tail: Tail, front: dict, rows, z: torch.Tensor, dirs: Directions
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(κ, kappa_exempt)``: jvps along the decayed and along the exempt probed parameters.

    Both tangents go through one pass when some probed parameter is exempt from decay.
    """
    exempt = [n for n in run.names if n not in dirs.decayed]
    zero = lambda n: torch.zeros_like(run.encoder.get_parameter(n))  # noqa: E731
    tangents = [{n: dirs.decayed[n] if n in dirs.decayed else zero(n) for n in run.names}]
    if exempt:
        tangents.append({n: run.encoder.get_parameter(n).detach() if n in exempt else zero(n) for n in run.names})
    j = tail.jvp(front, {n: torch.stack([t[n] for t in tangents]) for n in run.names}, rows)
    kappa = kappa_from_jvp(z, j[0])
    return kappa, (kappa_from_jvp(z, j[1]) if exempt else torch.zeros_like(kappa))


def _jvp_directions_outer(
    run: ProbeRun,
    probes: Sequence[Any],
    ids: Sequence[str] | None,
    todo: list[int],
    groups: list[list[int]],
    drift_dirs: Directions | None,
):
    cfg = run.config
    tail = Tail(run.encoder, run.names, run.cut, run.output)
    accs, kept, ahead, first = restore_outer_state(run, todo)  # resumed: the groups already done
    for gi, group in enumerate(groups):
        if gi < first:
            continue
        dirs = run.directions(group)
        bar = run.bar(todo, f"probing (direction group {gi + 1}/{len(groups)})")
        failure = None
        try:
            for c in todo:
                if ahead.get(c, 0) > gi:
                    continue
                items = chunk_items(probes, c, cfg.chunk_size)
                state, front, rows = run.front(items)
                z = tail.primal(front, rows)
                if c not in accs:
                    accs[c] = run.new_accumulator(z.shape[0], z.shape[-1])
                    kappa = _jvp_kappa(run, tail, front, rows, z, dirs)
                    drift = None
                    if drift_dirs is not None:
                        drift = _moved(run.jvp_drift(tail, front, rows, z, drift_dirs), "cpu")
                    kept[c] = (
                        row_metadata(run, state, items, c, ids, rows),
                        z.cpu(),
                        tuple(k.cpu() for k in kappa),
                        drift,
                    )
                run.jvp_update(accs[c], tail, front, rows, z, dirs)
                bar.advance(c, z.shape[0])
        except Exception as exc:  # noqa: BLE001 - sharded: the ranks agree before the next broadcast
            failure = exc
        bar.close()
        run.checkpoint(failure)
        save_outer_state(run, gi + 1, todo, accs, kept)  # a kill now loses at most the next group
        del dirs
    for c in todo:
        meta, z, kappa, drift = kept[c]
        stats = accs[c].finalize()
        if drift is not None:
            drift = _moved(drift, stats["reason"].device)
        yield c, finish_table(run, meta, z, _with_drift(run, stats, drift), *kappa)


def _head_chunk(
    run: ProbeRun,
    items: Sequence[Any],
    c: int,
    ids: Sequence[str] | None,
    G: torch.Tensor,
    g: torch.Tensor | None,
    dirs: Directions,
) -> pa.Table:
    state, front, rows = run.front(items)
    a, z = head_inputs(run.encoder, front, run.cut, rows)
    stats = head_mode_stats(
        a, z, G, g, branch=run.branch, uncertainty=run.config.uncertainty, radial_spread=run.config.radial_spread
    )
    kappa = head_kappa(run.encoder, a, z, dirs.decayed)
    kappa_exempt = head_kappa_exempt(run.encoder, a, z, dirs.decayed, run.names)
    meta = row_metadata(run, state, items, c, ids, rows)
    return finish_table(run, meta, z, stats, kappa, kappa_exempt)
