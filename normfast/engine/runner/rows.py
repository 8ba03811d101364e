"""A chunk's output table: the row metadata (items, tokens, the items' own columns), the statistics,
the law solved row by row with its intervals, the validity codes and the regime of every row."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch

from normfast.core.equilibrium import equilibrium_norm
from normfast.engine.diagnostics.regime import classify_rows
from normfast.engine.estimators.statkeys import REASONS
from normfast.engine.estimators.uncertainty import equilibrium_intervals
from normfast.engine.runner.state import ProbeRun


def row_metadata(
    run: ProbeRun, state: dict, items: Sequence[Any], c: int, ids: Sequence[str] | None, rows: torch.Tensor | None
) -> dict[str, Any]:
    size = run.config.chunk_size
    item_index = np.arange(c * size, c * size + len(items), dtype=np.int64)
    item_ids = [ids[i] for i in item_index] if ids is not None else [str(i) for i in item_index]
    texts = [it if isinstance(it, str) else str(getattr(it, "text", "")) for it in items]
    cut = truncation(run, state, item_index)
    if rows is None:
        return {
            "item": item_index,
            "id": item_ids,
            "text": texts,
            "position": np.full(len(items), -1, np.int32),
            "token_id": np.full(len(items), -1, np.int64),
            "token": [""] * len(items),
            "is_special": np.zeros(len(items), bool),
            "n_truncated": cut,
        }
    mask = rows.cpu().numpy()
    b_idx, t_idx = np.nonzero(mask)
    info = run.encoder.token_info(state)
    special = np.zeros(len(b_idx), bool)
    if info is not None:
        tok_ids, tok_texts = info
        tok_ids = tok_ids.cpu().numpy()[b_idx, t_idx].astype(np.int64)
        tokens = [tok_texts[b][t] for b, t in zip(b_idx, t_idx)]
        special = run.encoder.special_token_mask(state).cpu().numpy()[b_idx, t_idx]
    else:
        tok_ids = np.full(len(b_idx), -1, np.int64)
        tokens = [""] * len(b_idx)
    meta = {
        "item": item_index[b_idx],
        "id": [item_ids[b] for b in b_idx],
        "text": [texts[b] for b in b_idx],
        "position": t_idx.astype(np.int32),
        "token_id": tok_ids,
        "token": tokens,
        "is_special": special,
        "n_truncated": cut[b_idx],
    }
    meta.update(item_token_columns(items, b_idx, t_idx))
    return meta


def truncation(run: ProbeRun, state: dict, item_index: np.ndarray) -> np.ndarray:
    """int32 per input: the tokens the encoder cut off it at the model's maximum length (0: none, or
    nothing tokenized). The first cut input of a run is warned about; the summary counts them all."""
    counted = run.encoder.truncated_tokens(state)
    if counted is None:
        return np.zeros(len(item_index), np.int32)
    cut = counted.cpu().numpy().astype(np.int32)
    if cut.any() and not run.truncation_warned:
        run.truncation_warned = True
        first = int(np.argmax(cut > 0))
        warnings.warn(
            f"probe: item {int(item_index[first])} is longer than the model's maximum length of "
            f"{run.encoder.max_length} tokens and was truncated ({int(cut[first])} tokens cut); every "
            f"truncated input is counted in the column n_truncated and in the summary (warned once per "
            f"run; split long texts, or probe documents with --corpus, which windows them)",
            UserWarning,
            stacklevel=2,
        )
    return cut


def item_token_columns(items: Sequence[Any], b_idx: np.ndarray, t_idx: np.ndarray) -> dict[str, Any]:
    """Per-position columns that the probe items provide themselves (``item.token_columns()``, e.g.
    the document, word and special-token columns of corpus windows), gathered at the token rows."""
    if not len(items) or not all(callable(getattr(it, "token_columns", None)) for it in items):
        return {}
    per_item = [it.token_columns() for it in items]
    out: dict[str, Any] = {}
    for name in per_item[0]:
        parts = []
        for b, cols in enumerate(per_item):
            t = t_idx[b_idx == b]
            col = cols[name]
            parts.append(col[t] if isinstance(col, np.ndarray) else [col[i] for i in t])
        out[name] = np.concatenate(parts) if isinstance(parts[0], np.ndarray) else [v for p in parts for v in p]
    return out


def finish_table(
    run: ProbeRun,
    meta: dict[str, Any],
    z: torch.Tensor,
    stats: Mapping[str, torch.Tensor],
    kappa: torch.Tensor,
    kappa_exempt: torch.Tensor,
) -> pa.Table:
    cfg = run.config
    to_np = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    norm = to_np(z.double().norm(dim=-1))
    cols: dict[str, Any] = dict(meta)
    cols["norm"] = norm
    stat_names = []
    for b in run.branches:
        sfx = "" if b == "u" else "_w"
        stat_names += [f"{k}{sfx}" for k in ("D", "se_D", "sign_stability", "V2", "m2", "Q", "se_V2", "se_Q")]
    if run.branch == "uw":
        stat_names.append("C_uw")
    for k in stat_names:
        cols[k] = to_np(stats[k]) if k in stats else np.full(len(norm), np.nan)
    if run.heat_level_se > 0:  # the heat's pool's own level error, which the batch groups cannot see
        for b in run.branches:
            sfx = "" if b == "u" else "_w"
            for se in ("se_V2", "se_Q"):
                cols[se + sfx] = np.hypot(cols[se + sfx], cols["V2" + sfx] * run.heat_level_se)
    heat = "V2" if "u" in run.branches else "V2_w"
    if (
        "loo" in stats and heat in stats["loo"]
    ):  # for the relative heat's jackknife (normfast.engine.diagnostics.relative_heat)
        loo_heat = to_np(stats["loo"][heat])
        n_rows, k = loo_heat.shape
        offsets = pa.array(np.arange(0, n_rows * k + 1, k, dtype=np.int32))
        # the item field named as Parquet names it, so the table in memory and the file agree
        cols["heat_loo"] = pa.ListArray.from_arrays(
            offsets, pa.array(loo_heat.reshape(-1), pa.float64()), type=pa.list_(pa.field("element", pa.float64()))
        )
    kap = to_np(kappa)
    cols["kappa"] = kap
    law = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    zero = np.zeros_like(norm)
    D = cols.get("D", zero)
    Q = cols.get("Q", zero)
    extra = {}
    if "w" in run.branches:
        extra = dict(D_w=cols["D_w"], Q_w=cols["Q_w"], C_uw=cols.get("C_uw", zero))
    with warnings.catch_warnings():
        # kappa <= 0 (no stable equilibrium) is a per-row fact: counted into the summary, not warned per chunk
        warnings.filterwarnings("ignore", message=r"equilibrium_coefficients: ", category=RuntimeWarning)
        r_eq, n_pos = equilibrium_norm(D, Q, kap, return_count=True, **law, **extra)
        heat_extra = dict(extra, D_w=zero) if extra else {}
        r_heat = equilibrium_norm(zero, Q, kap, **law, **heat_extra)
        # the intervals: the same quartic solved without each group (same rows, same counting)
        bars = {}
        if "loo" in stats:
            loo = {k: to_np(v) for k, v in stats["loo"].items()}
            level = (cols, run.heat_level_se) if run.heat_level_se > 0 else None
            bars = equilibrium_intervals(loo, kap, law, r_eq, r_heat, run.branches, level)
    cols["r_eq"] = r_eq
    cols["r_eq_heat"] = r_heat
    for k in ("r_eq_lo", "r_eq_hi", "r_eq_heat_lo", "r_eq_heat_hi"):
        cols[k] = bars.get(k, np.full(len(norm), np.nan))
    if run.snapshot is not None:
        item = np.asarray(meta["item"], dtype=np.int64)
        for k in ("r_eq", "D", "Q"):
            cols[f"{k}_snapshot"] = getattr(run.snapshot, k)[item]
        for k in ("r_eq_lo", "r_eq_hi"):
            cols[k.replace("r_eq", "r_eq_snapshot")] = getattr(run.snapshot, k)[item]
        for k in ("norm_continued", "norm_continued_lo", "norm_continued_hi"):
            cols[k] = getattr(run.snapshot, k)[item]
    cols["n_pos_roots"] = np.asarray(n_pos, dtype=np.int8)
    valid = stats["valid"].cpu().numpy().astype(bool)
    reason = np.array([REASONS[int(r)] for r in stats["reason"].cpu().numpy()], dtype=object)
    bad_kappa = valid & ~np.isfinite(kap)
    reason[bad_kappa] = "non_finite_kappa"
    valid = valid & ~bad_kappa
    no_root = valid & ~np.isfinite(r_eq)
    reason[no_root] = "no_positive_root"
    cols["valid"] = valid
    cols["reason"] = reason.tolist()
    cols["kappa_exempt"] = to_np(kappa_exempt)
    saturated = bool(run.objective_health().get("saturated", False))
    rows = classify_rows(cols, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, saturated=saturated)
    cols["drift_to_heat"] = rows["drift_to_heat"]
    cols["regime"] = rows["regime"].tolist()
    cols["regime_reason"] = rows["regime_reason"].tolist()
    return pa.table(cols)
