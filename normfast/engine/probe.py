"""The probe engine: ``probe(encoder, probes, objective, pairs, config) -> ProbeResult``.

For every probe item (a whole input with ``output="pooled"``, or every token
position with ``output="tokens"``) it measures drift ``D``, heat ``V²``,
``m2``, ``Q``, the radial damping ``κ``, the standard error and sign stability
of ``D``, and solves the equilibrium law for ``R_eq`` (full law) and
``R_eq`` with ``D = 0`` (heat-only law) -- see DESIGN §1.

The drift comes from the mean update direction over its own ``M_D =
config.drift_batches`` virtual batches (the first ``M`` of them are the
heat's): the gradients are summed per batch group as they are computed, and
each chunk takes K more directional derivatives (jvp mode) or one more GEMM
(head mode) along the K group means; ``D`` and ``m2`` are those of the
overall mean, ``se_D`` and ``sign_stability`` come from the group drifts
(:func:`normfast.engine.ops.drift_from_groups`). ``drift_batches=None``
keeps the per-batch drift of the M heat batches.

Loop structure
--------------
1. Resolve the probed parameters ``P`` and the *cut*: the first encoder stage
   that owns a parameter of ``P``. Everything before it is frozen.
2. Virtual batches -> update directions ``p_B`` (``normfast.engine.directions``).
   With the mean-direction drift, one pass over all ``M_D`` batches keeps the
   first ``M`` directions and sums the rest per group.
3. Probe items in chunks. Per chunk the frozen front runs once (``no_grad``),
   then either head mode (closed form, ``normfast.engine.ops.head_stats``) or jvp
   mode (``normfast.engine.transmission.Tail``, K directions per pass) feeds
   ``normfast.engine.ops.ProbeAccumulator``; κ by one JVP along the decayed
   parameters; the equilibrium quartic is solved by the C++ extension.
4. Each finished chunk is written to Parquet at once (``normfast.data.io``); an
   interrupted run restarted with ``resume=True`` skips finished chunks.

Loop order and memory: when all ``M`` directions fit in ``memory_budget_mb``
the chunks are the outer loop (output streams chunk by chunk). Otherwise the
directions are computed in groups that fit and become the outer loop, with
one accumulator per chunk kept across groups (results are identical: the
accumulators merge exactly); output is then written at the end, and AdamW
needs a first pass over the batches for ``v̂``.

Memory at scale: in the chunks-outer order (the default whenever the
directions fit) nothing is kept per chunk once it is written: peak memory is
set by the model, the directions and one chunk, not by the number of probe
rows, and ``probe(..., out=...)`` returns a result that reads the Parquet file
lazily. The directions-outer order keeps every chunk's accumulator (and
embeddings) until the last group, so its memory grows with the probe rows.
The progress bar counts probe items, so its ETA holds for uneven chunks.

Scale-out: inside a ``torch.distributed`` process group (e.g. under
``torchrun``) the chunks are sharded over the ranks, the directions computed
once on rank 0 and broadcast, and the output is a manifest over one Parquet
part per rank -- see ``normfast.engine.distributed``.
"""
from __future__ import annotations

import collections.abc
import json
import math
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from normfast.engine.config import ProbeConfig
from normfast.engine.result import ProbeResult
from normfast.engine.runfiles import _finish_sharded, _open_output, restore_outer_state, save_outer_state
from normfast.engine.directions import (Directions, OptimizerPreset, compute_directions,
                                 estimate_second_moments, resolve_parameters)
from normfast.engine.ops import drift_from_groups
from normfast.engine.uncertainty import equilibrium_intervals, jackknife_se
from normfast.engine.distributed import Shard, chunks_for_rank, current_shard
from normfast.encoders import Encoder
from normfast.data.io import (METADATA_KEY, fingerprint)
from normfast.data.schema import SCHEMA_VERSION
from normfast.data.pairs import as_pair_source as _as_pair_source
from normfast.engine.adaptive import adaptive_plan
from normfast.engine.objectives import objective_settings
from normfast.engine.provenance import device_name as _device_name
from normfast.engine.provenance import hash_items as _hash_items
from normfast.engine.provenance import hash_model as _hash_model
from normfast.engine.provenance import library_versions as _library_versions
from normfast.engine.regime import REGIME_INPUTS, run_regime
from normfast.engine.transmission import (Tail, head_inputs, head_kappa, head_kappa_exempt, kappa_from_jvp,
                                          prepared_head)

# ----------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------
class _Run:
    """State shared by the chunks of one probe run."""

    def __init__(self, encoder: Encoder, objective: Any, pairs: Any, config: ProbeConfig,
                 pair_encoder: Encoder | None, progress: bool,
                 second_moments: Mapping[str, torch.Tensor] | None = None, shard: Shard | None = None,
                 n_items: int = 0):
        self.shard = shard
        self.n_items = n_items
        self.encoder = encoder
        self.objective = objective
        self.pairs = pairs
        self.config = config
        self.pair_encoder = pair_encoder
        self.progress = progress
        self.device = encoder.device
        self.names = resolve_parameters(encoder, config.params)
        stage_of = encoder.stage_of_parameters()
        self.cut = min(stage_of[n] for n in self.names)
        self.presets = {n: OptimizerPreset(config.preset_for(n), config.lr, config.weight_decay,
                                           config.momentum if config.preset_for(n) == "sgd" else 0.0,
                                           config.betas, config.eps, second_moments)
                        for n in self.names}
        self.branches = tuple(b for b in ("u", "w") if b in {p.branch for p in self.presets.values()})
        self.branch = "uw" if len(self.branches) == 2 else self.branches[0]
        self.mode = self._choose_mode()
        self.output = config.output
        if self.output == "tokens" and not encoder.has_tokens:
            raise ValueError(f"probe: output='tokens' needs a sequence model; {type(encoder).__name__} has no "
                             f"token positions")
        rng = np.random.default_rng(config.seed)
        from normfast.data.pairs import check_batch_indices, virtual_batches

        batch_seed = int(rng.integers(2**31))
        if config.batch_indices is None:
            # M_D batches with the mean-direction drift; the first M (drawn first from the same
            # generator, so the same as without it) are the heat's
            self.batches = virtual_batches(len(pairs), config.total_batches, config.batch_size, batch_seed)
        else:  # explicit batches replace the draw, in the same layout (checked against the source here)
            self.batches = [np.asarray(b, dtype=np.int64) for b in check_batch_indices(
                "probe", "config.batch_indices", config.batch_indices, n=len(pairs))]
        self.acc_dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        self.groups = config.effective_groups  # K: heat batch b (and drift batch b) in group b mod K
        self.M = config.batches                # the heat's M (adaptive M may raise it)
        self.adaptive: dict[str, Any] | None = None
        self._second_moments: dict[str, torch.Tensor] | None = None
        self.snapshot = None  # the single-snapshot predictor (config.snapshot), for every item at once

    def _choose_mode(self) -> str:
        mode = self.config.mode
        head = self.encoder.head()
        head_ok = head is not None and set(self.names) <= set(head.parameter_names) \
            and head.weight_name in self.names and self.branch != "uw"
        if mode == "head" and not head_ok:
            hint = self.encoder.head_hint() if head is None and hasattr(self.encoder, "head_hint") else ""
            raise ValueError("probe: mode='head' needs the probed parameters to be exactly the final linear "
                             "head's weight (and bias) with one optimizer preset; use mode='jvp' or params='head'"
                             + (f". {type(self.encoder).__name__} has no head: {hint}" if hint else ""))
        if mode == "auto":
            return "head" if head_ok else "jvp"
        return mode

    # -- directions -------------------------------------------------------------
    def all_directions(self) -> Directions:
        """The M heat directions and, with the mean-direction drift, the drift's K group means (one pass)."""
        return self._shared(lambda: self._compute_directions(list(range(self.M)), self.config.drift_from_mean))

    def drift_directions(self) -> Directions:
        """Only the drift's K group means over its M_D batches (the directions-outer order)."""
        return self._shared(lambda: self._compute_directions([], True))

    def directions(self, batch_ids: Sequence[int]) -> Directions:
        """Directions for the given (consecutive) heat batches, without the drift."""
        return self._shared(lambda: self._compute_directions(batch_ids, False))

    def _shared(self, compute: Callable[[], Directions]) -> Directions:
        """Sharded: computed on rank 0 only and broadcast (a collective: every rank calls it)."""
        if self.shard is None:
            return compute()
        dirs, failure = None, None
        if self.shard.is_root:
            try:
                dirs = compute()
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank
                failure = exc
        self.shard.raise_if_root_failed(failure)
        return self.shard.share_directions(dirs, self.device)

    def checkpoint(self, failure: BaseException | None) -> None:
        """Sharded: every rank learns whether any rank failed (a collective); raise if one did."""
        if self.shard is not None:
            self.shard.exchange(failure)
        elif failure is not None:
            raise failure

    def chunk_len(self, c: int) -> int:
        return min(self.config.chunk_size, self.n_items - c * self.config.chunk_size)

    def bar(self, todo: Sequence[int], desc: str) -> "_ChunkBar":
        return _ChunkBar(self, todo, desc)

    def _compute_directions(self, batch_ids: Sequence[int], with_drift: bool) -> Directions:
        cfg = self.config
        common = dict(cut=self.cut, pair_encoder=self.pair_encoder, no_decay=cfg.no_decay, seed=cfg.seed,
                      progress=self.progress)
        if with_drift:
            # one pass over all M_D batches: the first len(batch_ids) kept, all summed per group;
            # AdamW's v̂ (when not given) is the mean of ĝ² over all of them
            dirs = compute_directions(self.encoder, self.objective, self.pairs, self.names, self.presets,
                                      self.batches, keep=len(batch_ids), drift_groups=self.groups,
                                      check_invariance=True, **common)
            if dirs.second_moments:
                self._second_moments = dirs.second_moments
            return dirs
        second = None
        if len(batch_ids) < len(self.batches) and "w" in self.branches:
            if self._second_moments is None:  # AdamW's v̂ must come from all batches
                adam = [n for n in self.names if self.presets[n].name == "adamw"
                        and self.presets[n].second_moments is None]
                self._second_moments = estimate_second_moments(
                    self.encoder, self.objective, self.pairs, adam, self.batches, cut=self.cut,
                    pair_encoder=self.pair_encoder, seed=cfg.seed, progress=self.progress,
                    check_invariance=False)
            second = self._second_moments
        return compute_directions(self.encoder, self.objective, self.pairs, self.names, self.presets,
                                  [self.batches[b] for b in batch_ids], batch_offset=batch_ids[0],
                                  check_invariance=batch_ids[0] == 0 and not cfg.drift_from_mean,
                                  second_moments=second, **common)

    # -- one chunk -----------------------------------------------------------------
    def front(self, items: Sequence[Any]) -> tuple[dict, dict, torch.Tensor | None]:
        state = self.encoder.prepare(items)
        with torch.no_grad():
            front = self.encoder(state, 0, self.cut) if self.cut > 0 else state
        rows = state["mask"].bool() if self.output == "tokens" else None
        return state, front, rows

    def direction_bytes(self) -> int:
        """Memory of one update direction over the probed parameters (fp32)."""
        return sum(self.encoder.get_parameter(n).numel() for n in self.names) * 4

    def direction_group(self) -> int:
        """How many of the M directions fit in half the memory budget together."""
        return self.direction_group_for(self.M)

    def direction_group_for(self, m: int) -> int:
        """How many of ``m`` directions fit in half the memory budget together."""
        budget = self.config.memory_budget_mb * 2**20 / 2
        return int(max(1, min(m, budget // max(self.direction_bytes(), 1))))

    def k_per_pass(self, n_rows: int, dim: int) -> int:
        if self.config.directions_per_pass is not None:
            return min(self.config.directions_per_pass, self.M)
        if not self.encoder.batched_directions:  # the encoder runs faster one direction per pass
            return 1
        tail_stages = max(1, self.encoder.n_stages - self.cut)
        # heuristic: a tangent carries ~16 activations of width d per row and tail stage (fp32)
        per_direction = n_rows * dim * tail_stages * 16 * 4
        budget = self.config.memory_budget_mb * 2**20 / 2
        return int(max(1, min(self.M, budget // max(per_direction, 1))))

    def new_accumulator(self, n: int, d: int):
        from normfast.engine.ops import GroupedAccumulator, ProbeAccumulator

        kw = dict(branch=self.branch, device=self.device, dtype=self.acc_dtype)
        if self.config.uncertainty:
            return GroupedAccumulator(n, d, groups=self.groups, **kw)
        return ProbeAccumulator(n, d, **kw)

    def jvp_drift(self, tail: Tail, front: dict, rows, z: torch.Tensor, dirs: Directions) -> dict[str, Any]:
        """Drift statistics along the K group-mean directions of ``dirs.drift`` (K more jvps per branch)."""
        drift = dirs.drift
        step = min(self.k_per_pass(z.shape[0], z.shape[-1]), drift.K)
        out: dict[str, Any] = {}
        for b in self.branches:
            tangents = drift.stacked(dirs.names, dirs.branch_of, b)
            parts = [tail.jvp(front, {n: t[lo:lo + step] for n, t in tangents.items()}, rows)
                     for lo in range(0, drift.K, step)]
            stats = drift_from_groups(-torch.cat(parts), z, drift.counts, branch=b)
            reason = stats.pop("reason")
            for key in ("valid", "M"):
                stats.pop(key)
            out.setdefault("loo", {}).update(stats.pop("loo"))
            out.update(stats)
            out["reason"] = reason if "reason" not in out else torch.where(out["reason"] != 0, out["reason"], reason)
        return out

    def jvp_update(self, acc, tail: Tail, front: dict, rows, z: torch.Tensor, dirs: Directions) -> None:
        K = self.k_per_pass(z.shape[0], z.shape[-1])
        for lo in range(0, dirs.M, K):
            ids = list(range(lo, min(lo + K, dirs.M)))
            ts = {}
            for b in self.branches:
                ts[b] = -tail.jvp(front, dirs.stacked(ids, b), rows)
            kw = {"first_batch": dirs.first_batch + lo} if self.config.uncertainty else {}
            if self.branch == "uw":
                acc.update(ts["u"], z, t_w=ts["w"], **kw)
            else:
                acc.update(ts[self.branch], z, **kw)


def probe(encoder: Encoder | str | torch.nn.Module, probes: Sequence[Any], objective: Any = "simcse",
          pairs: Any = None, config: ProbeConfig | None = None, *, out: str | Path | None = None,
          resume: bool = False, overwrite: bool = False, pair_encoder: Encoder | None = None,
          ids: Sequence[str] | None = None, progress: bool = True,
          model_name: str | None = None,
          second_moments: Mapping[str, torch.Tensor] | None = None,
          distributed: bool = True) -> ProbeResult:
    """Measure drift, heat and damping for every probe item and predict its equilibrium norm.

    Args:
        encoder: an :class:`~normfast.encoders.Encoder`, an ``nn.Module``, or a spec string for
            :func:`normfast.encoders.load_encoder` (hub id, local folder, ``open_clip:ARCH``).
        probes: the probe inputs (texts, images, tensors). With ``config.output="tokens"``
            every token position of every input becomes a row. Any object with ``len`` and
            slicing (``probes[a:b]``) is read chunk by chunk and never copied whole (e.g. one
            that reads items from disk on demand); other iterables are collected into a list.
            Items may carry their own token ids and per-position columns (``token_columns()``),
            which then join the token rows: :class:`normfast.data.corpus.CorpusWindows` probes
            every token of a corpus in context this way (its ``fingerprint()`` and
            ``describe()`` go into the run's resume key and metadata).
        objective: an objective object or name (``"infonce"``, ``"clip"``, ``"supcon"``, ``"simcse"``).
        pairs: the virtual-batch source: a ``PairSource`` or an iterable of pairs /
            (item, label) tuples / items. SimCSE without pairs uses the probes themselves
            (then held in memory as a list; pass ``pairs`` for a huge on-demand probe set).
        config: a :class:`ProbeConfig` (defaults otherwise).
        out: Parquet path to stream rows to (one row group per chunk). The result then reads
            the file lazily: memory does not grow with the number of probe rows.
        resume: continue an interrupted run at ``out`` (same arguments required; a finished
            run with the same arguments is returned as is).
        pair_encoder: encoder for the positive side when it is a different model (e.g. the
            text tower when probing the image tower of a CLIP model); its parameters are not probed.
        ids: optional string id per probe item (default: the item's index).
        model_name: recorded in the metadata (default: the spec string or class name).
        second_moments: AdamW's bias-corrected ``v̂`` per parameter name (e.g. from
            :func:`normfast.engine.directions.adam_second_moments` of the real optimizer); without
            it ``v̂`` is the mean of ``ĝ²`` over the virtual batches.
        distributed: inside an initialized ``torch.distributed`` default group of two or more
            ranks, shard the probe items over the ranks (every rank calls ``probe`` with the same
            arguments; see :mod:`normfast.engine.distributed`). With ``out`` a sharded run writes
            ``OUT.manifest.json`` and one part per rank instead of one file. ``False``: this
            process runs alone.

    Returns:
        :class:`ProbeResult` (on every rank of a sharded run). The same arguments and seed
        give the same table, sharded or not.
    """
    from normfast.encoders import load_encoder
    from normfast.engine.objectives import get_objective

    config = config or ProbeConfig()
    config.validate()
    if model_name is None:
        model_name = encoder if isinstance(encoder, str) else type(encoder).__name__
    if not isinstance(encoder, Encoder):
        encoder = load_encoder(encoder)
    if isinstance(objective, str):
        objective = get_objective(objective)
    probes = _as_probe_sequence(probes)
    if len(probes) == 0:
        raise ValueError("probe: expected at least one probe item, got an empty probe set")
    if ids is None and callable(getattr(probes, "ids", None)):  # e.g. corpus windows: "DOC_ID/WINDOW"
        ids = probes.ids()
    if ids is not None:
        ids = [str(i) for i in ids]
        if len(ids) != len(probes):
            raise ValueError(f"probe: expected one id per probe item, got {len(ids)} ids for {len(probes)} items")
    pairs = _as_pair_source(pairs, objective, probes)
    shard = current_shard() if distributed else None

    n_items = len(probes)
    run = _Run(encoder, objective, pairs, config, pair_encoder, progress and (shard is None or shard.is_root),
               second_moments, shard=shard, n_items=n_items)
    n_chunks = math.ceil(n_items / config.chunk_size)
    inputs = {  # what the rows depend on besides the settings; named when a resume is refused
        "probes": _hash_items(probes),
        "pairs": _hash_items([pairs.batch(np.array([i])) for i in range(min(len(pairs), 4096))]),
        "ids": _hash_items(ids) if ids is not None else None,
        "second_moments": _hash_items(list(second_moments.values())) if second_moments else None,
    }
    metadata = {
        "schema_version": SCHEMA_VERSION,
        "model": str(model_name), "model_fingerprint": _hash_model(encoder),
        "encoder_note": getattr(encoder, "note", None),
        "objective": objective.name, "temperature": getattr(objective, "temperature", None),
        "objective_settings": objective_settings(objective),
        "optimizer": config.optimizer, "lr": config.lr, "weight_decay": config.weight_decay,
        "momentum": config.momentum, "M": config.batches,
        "M_D": config.drift_batches if config.drift_from_mean else None, "M_initial": config.batches,
        "groups": run.groups if config.uncertainty or config.drift_from_mean else None,
        "uncertainty": config.uncertainty,
        "batch_size": config.batch_size,
        "seed": config.seed, "mode": run.mode, "output": config.output, "params": config.params,
        "n_probed_parameters": len(run.names), "cut_stage": run.cut, "branch": run.branch,
        "n_items": n_items, "n_pairs": len(pairs), "chunk_size": config.chunk_size,
        "versions": _library_versions(), "device": _device_name(run.device),
        "config": asdict(config), "input_fingerprints": inputs,
    }
    if callable(getattr(probes, "describe", None)):  # e.g. corpus windows: documents, windows, stride
        metadata["corpus"] = probes.describe()
    spec = {k: metadata[k] for k in metadata if k not in ("versions", "device")}
    # the world size is not part of the spec: a run may be resumed with any number of ranks
    key = fingerprint(spec)
    metadata["spec_fingerprint"] = key
    metadata["world_size"] = 1 if shard is None else shard.world_size
    if shard is not None:
        shard.check_agree(key, "arguments")

    writer = None
    done: set[int] = set()
    if out is not None:
        out = Path(out)
        finished, writer, done = _open_output(out, spec, key, shard, resume, overwrite)
        run.writer = writer
        if finished is not None:
            return finished
    tables: dict[int, pa.Table] = {}

    def emit(c: int, table: pa.Table) -> None:
        if writer is not None:
            writer.write_chunk(c, table)
        else:
            tables[c] = table

    if config.snapshot:  # before the chunks: every chunk's rows take their slice of it
        from normfast.engine.snapshot import snapshot_prediction

        run.snapshot = snapshot_prediction(encoder, probes, objective, pairs, config, second_moments=second_moments,
                                           progress=run.progress)
        metadata["snapshot"] = run.snapshot.info
    todo = [c for c in range(n_chunks) if c not in done]
    mine = todo if shard is None else chunks_for_rank(todo, shard.rank, shard.world_size)
    t0 = time.perf_counter()
    failure = None
    try:
        if todo:  # every rank takes part (directions are collective), even one with no chunks of its own
            _run_chunks(run, probes, ids, mine, emit)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        if shard is None:
            raise
        failure = exc
    seconds = round(time.perf_counter() - t0, 3)
    metadata["M"] = run.M
    if run.adaptive is not None:
        metadata["adaptive"] = run.adaptive
    if shard is None:
        metadata["seconds"] = seconds
        if writer is not None:
            metadata["regime"] = run_regime(writer.read_chunk(c, REGIME_INPUTS) for c in range(n_chunks))
            path = writer.finalize(n_chunks, metadata)
            return ProbeResult.from_files([path], metadata, path)
        table = pa.concat_tables([tables[c] for c in range(n_chunks)])
        metadata["regime"] = run_regime([table])
        meta_blob = {METADATA_KEY: json.dumps(metadata, default=str).encode()}
        return ProbeResult(table.replace_schema_metadata(meta_blob), metadata)
    return _finish_sharded(shard, writer, out, key, metadata, n_chunks, tables, failure, seconds)


def _as_probe_sequence(probes: Any) -> Sequence[Any]:
    if isinstance(probes, (list, torch.Tensor)):
        return probes
    if isinstance(probes, (str, bytes, tuple, collections.abc.Mapping)) or not (
            hasattr(probes, "__len__") and hasattr(probes, "__getitem__")):
        return list(probes)
    return probes  # anything with len and slicing is read chunk by chunk, never copied whole


class _ChunkBar:
    """Progress over the chunks of a run, counted in probe items (so the ETA is right whatever the
    chunk sizes), with the rows written so far and their rate."""

    def __init__(self, run: "_Run", todo: Sequence[int], desc: str):
        self.run = run
        total = sum(run.chunk_len(c) for c in todo)
        if run.shard is not None:
            desc = f"{desc}, rank 0 of {run.shard.world_size}"
        self.bar = tqdm(total=total, desc=desc, unit="item", unit_scale=True, disable=not run.progress,
                        smoothing=0.05, dynamic_ncols=True)
        self.rows = 0
        self.t0 = time.perf_counter()

    def advance(self, c: int, rows: int) -> None:
        self.rows += rows
        if self.bar.disable:
            return
        rate = self.rows / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.rows:,} rows, {rate:,.0f} rows/s", refresh=False)
        self.bar.update(self.run.chunk_len(c))

    def close(self) -> None:
        self.bar.close()


def _chunk_items(probes: Sequence[Any], c: int, size: int) -> Sequence[Any]:
    items = probes[c * size:(c + 1) * size]
    return items if isinstance(items, (list, torch.Tensor)) else list(items)


def _run_chunks(run: _Run, probes: Sequence[Any], ids: Sequence[str] | None, todo: list[int],
                emit: Callable[[int, pa.Table], None]) -> None:
    """Probe the chunks ``todo`` and hand each finished table to ``emit``.

    Sharded runs call this on every rank (directions are a collective), each with its own ``todo``.
    """
    cfg = run.config
    encoder = run.encoder
    was_training = encoder.training
    encoder.eval()
    try:
        plan = adaptive_plan(run, _chunk_items(probes, 0, cfg.chunk_size)) if cfg.target_rse is not None else None
        if run.mode == "head":
            dirs = plan.directions if plan is not None else run.all_directions()
            G = prepared_head(encoder, dirs, dtype=run.acc_dtype, groups=run.groups)  # once, for every chunk
            g = None
            bar = run.bar(todo, "probing (head mode)")
            for c in todo:
                items = _chunk_items(probes, c, cfg.chunk_size)
                table = _head_chunk(run, items, c, ids, G, g, dirs)
                emit(c, table)
                bar.advance(c, table.num_rows)
            bar.close()
            return
        group = run.direction_group()
        if plan is not None and plan.directions is not None:
            dirs = plan.directions
        elif plan is None and group >= run.M:
            dirs = run.all_directions()
        else:
            dirs = None
        if dirs is not None:
            bar = run.bar(todo, "probing (jvp mode)")
            for c in todo:
                items = _chunk_items(probes, c, cfg.chunk_size)
                table = _jvp_chunk(run, items, c, ids, [dirs])
                emit(c, table)
                bar.advance(c, table.num_rows)
            bar.close()
            return
        # directions-outer: the directions do not fit in the budget together
        per_batch = run.direction_bytes()
        warnings.warn(f"probe: {run.M} directions of {per_batch / 2**20:.0f} MB each exceed the memory "
                      f"budget; computing them in groups of {group} (directions-outer loop order: the "
                      f"per-probe state of every chunk is kept in memory across the groups, and output is "
                      f"written at the end)", stacklevel=3)
        groups = [list(range(lo, min(lo + group, run.M))) for lo in range(0, run.M, group)]
        drift = None
        if cfg.drift_from_mean:
            drift = plan.drift if plan is not None else run.drift_directions()
        emit_all = _jvp_directions_outer(run, probes, ids, todo, groups, drift)
        for c, table in emit_all:
            emit(c, table)
    finally:
        encoder.train(was_training)


def _row_metadata(run: _Run, state: dict, items: Sequence[Any], c: int, ids: Sequence[str] | None,
                  rows: torch.Tensor | None) -> dict[str, Any]:
    size = run.config.chunk_size
    item_index = np.arange(c * size, c * size + len(items), dtype=np.int64)
    item_ids = [ids[i] for i in item_index] if ids is not None else [str(i) for i in item_index]
    texts = [it if isinstance(it, str) else str(getattr(it, "text", "")) for it in items]
    if rows is None:
        return {"item": item_index, "id": item_ids, "text": texts,
                "position": np.full(len(items), -1, np.int32),
                "token_id": np.full(len(items), -1, np.int64), "token": [""] * len(items),
                "is_special": np.zeros(len(items), bool)}
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
    meta = {"item": item_index[b_idx], "id": [item_ids[b] for b in b_idx], "text": [texts[b] for b in b_idx],
            "position": t_idx.astype(np.int32), "token_id": tok_ids, "token": tokens, "is_special": special}
    meta.update(_item_token_columns(items, b_idx, t_idx))
    return meta


def _item_token_columns(items: Sequence[Any], b_idx: np.ndarray, t_idx: np.ndarray) -> dict[str, Any]:
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


def _finish_table(run: _Run, meta: dict[str, Any], z: torch.Tensor, stats: Mapping[str, torch.Tensor],
                  kappa: torch.Tensor, kappa_exempt: torch.Tensor) -> pa.Table:
    from normfast.core.equilibrium import equilibrium_norm
    from normfast.engine.ops import REASONS
    from normfast.engine.regime import classify_rows

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
            bars = equilibrium_intervals(loo, kap, law, r_eq, r_heat, run.branches)
    cols["r_eq"] = r_eq
    cols["r_eq_heat"] = r_heat
    for k in ("r_eq_lo", "r_eq_hi", "r_eq_heat_lo", "r_eq_heat_hi"):
        cols[k] = bars.get(k, np.full(len(norm), np.nan))
    if run.snapshot is not None:
        item = np.asarray(meta["item"], dtype=np.int64)
        for k in ("r_eq", "D", "Q"):
            cols[f"{k}_snapshot"] = getattr(run.snapshot, k)[item]
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
    rows = classify_rows(cols, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    cols["drift_to_heat"] = rows["drift_to_heat"]
    cols["regime"] = rows["regime"].tolist()
    cols["regime_reason"] = rows["regime_reason"].tolist()
    return pa.table(cols)


def _jvp_chunk(run: _Run, items: Sequence[Any], c: int, ids: Sequence[str] | None,
               dir_groups: Sequence[Directions]) -> pa.Table:
    state, front, rows = run.front(items)
    tail = Tail(run.encoder, run.names, run.cut, run.output)
    z = tail.primal(front, rows)
    acc = run.new_accumulator(z.shape[0], z.shape[-1])
    for dirs in dir_groups:
        run.jvp_update(acc, tail, front, rows, z, dirs)
    kappa = _jvp_kappa(run, tail, front, rows, z, dir_groups[0])
    drift = run.jvp_drift(tail, front, rows, z, dir_groups[0]) if dir_groups[0].drift is not None else None
    meta = _row_metadata(run, state, items, c, ids, rows)
    return _finish_table(run, meta, z, _with_drift(run, acc.finalize(), drift), *kappa)


def _moved(obj: Any, device: Any) -> Any:
    """Tensors (in nested dicts) moved to ``device``."""
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


def _with_drift(run: _Run, stats: dict[str, Any], drift: Mapping[str, torch.Tensor] | None) -> dict[str, Any]:
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


def _jvp_kappa(run: _Run, tail: Tail, front: dict, rows, z: torch.Tensor,
               dirs: Directions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(κ, kappa_exempt)``: jvps along the decayed and along the exempt probed parameters.

    Both tangents go through one pass when some probed parameter is exempt from decay.
    """
    exempt = [n for n in run.names if n not in dirs.decayed]
    zero = lambda n: torch.zeros_like(run.encoder.get_parameter(n))  # noqa: E731
    tangents = [{n: dirs.decayed[n] if n in dirs.decayed else zero(n) for n in run.names}]
    if exempt:
        tangents.append({n: run.encoder.get_parameter(n).detach() if n in exempt else zero(n)
                         for n in run.names})
    j = tail.jvp(front, {n: torch.stack([t[n] for t in tangents]) for n in run.names}, rows)
    kappa = kappa_from_jvp(z, j[0])
    return kappa, (kappa_from_jvp(z, j[1]) if exempt else torch.zeros_like(kappa))


def _jvp_directions_outer(run: _Run, probes: Sequence[Any], ids: Sequence[str] | None, todo: list[int],
                          groups: list[list[int]], drift_dirs: Directions | None):
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
                items = _chunk_items(probes, c, cfg.chunk_size)
                state, front, rows = run.front(items)
                z = tail.primal(front, rows)
                if c not in accs:
                    accs[c] = run.new_accumulator(z.shape[0], z.shape[-1])
                    kappa = _jvp_kappa(run, tail, front, rows, z, dirs)
                    drift = None
                    if drift_dirs is not None:
                        drift = _moved(run.jvp_drift(tail, front, rows, z, drift_dirs), "cpu")
                    kept[c] = (_row_metadata(run, state, items, c, ids, rows), z.cpu(),
                               tuple(k.cpu() for k in kappa), drift)
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
        yield c, _finish_table(run, meta, z, _with_drift(run, stats, drift), *kappa)


def _head_chunk(run: _Run, items: Sequence[Any], c: int, ids: Sequence[str] | None, G: torch.Tensor,
                g: torch.Tensor | None, dirs: Directions) -> pa.Table:
    from normfast.engine.ops import head_stats

    state, front, rows = run.front(items)
    a, z = head_inputs(run.encoder, front, run.cut, rows)
    stats = head_stats(a, z, G, g, branch=run.branch, uncertainty=run.config.uncertainty,
                       radial_spread=run.config.radial_spread)
    kappa = head_kappa(run.encoder, a, z, dirs.decayed)
    kappa_exempt = head_kappa_exempt(run.encoder, a, z, dirs.decayed, run.names)
    meta = _row_metadata(run, state, items, c, ids, rows)
    return _finish_table(run, meta, z, stats, kappa, kappa_exempt)
