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
(:func:`normfast.engine.estimators.drift.drift_from_groups`). ``drift_batches=None``
keeps the per-batch drift of the M heat batches.

Loop structure
--------------
1. Resolve the probed parameters ``P`` and the *cut*: the first encoder stage
   that owns a parameter of ``P``. Everything before it is frozen.
2. Virtual batches -> update directions ``p_B`` (``normfast.engine.directions.gradients``).
   With the mean-direction drift, one pass over all ``M_D`` batches keeps the
   first ``M`` directions and sums the rest per group.
3. Probe items in chunks. Per chunk the frozen front runs once (``no_grad``),
   then either head mode (closed form, ``normfast.ops.head_stats``) or jvp
   mode (``normfast.engine.transmission.jvp.Tail``, K directions per pass) feeds
   ``normfast.ops.ProbeAccumulator``; κ by one JVP along the decayed
   parameters; the equilibrium quartic is solved by the C++ extension.
4. Each finished chunk is written to Parquet at once (``normfast.data.runwriter``); an
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
part per rank -- see ``normfast.engine.runner.distributed``.
"""

from __future__ import annotations

import collections.abc
import contextlib
import json
import math
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch

from normfast.core.checks import check_finite_weights
from normfast.data.io import fingerprint
from normfast.data.pairs import as_pair_source, check_batch_size
from normfast.data.schema import METADATA_KEY, SCHEMA_VERSION
from normfast.encoders import Encoder
from normfast.encoders.tokenizing import unknown_token_warning
from normfast.engine.config import ProbeConfig
from normfast.engine.diagnostics.regime import REGIME_INPUTS, run_regime
from normfast.engine.diagnostics.relative_heat import heat_inputs, heat_reference, with_relative_heat
from normfast.engine.directions.gradients import NonFiniteLoss
from normfast.engine.directions.objectives import objective_settings
from normfast.engine.result import ProbeResult
from normfast.engine.runner.chunks import run_chunks
from normfast.engine.runner.distributed import chunks_for_rank, current_shard
from normfast.engine.runner.files import finish_sharded, open_output
from normfast.engine.runner.provenance import (
    device_name,
    encoder_tokenizer,
    hash_items,
    hash_model,
    hash_pairs,
    hash_tokenizer,
    library_versions,
)
from normfast.engine.runner.state import ProbeRun


def probe(
    encoder: Encoder | str | torch.nn.Module,
    probes: Sequence[Any],
    objective: Any = "simcse",
    pairs: Any = None,
    config: ProbeConfig | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    pair_encoder: Encoder | None = None,
    ids: Sequence[str] | None = None,
    progress: bool = True,
    model_name: str | None = None,
    second_moments: Mapping[str, torch.Tensor] | None = None,
    distributed: bool = True,
) -> ProbeResult:
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
            :func:`normfast.engine.directions.gradients.adam_second_moments` of the real optimizer); without
            it ``v̂`` is the mean of ``ĝ²`` over the virtual batches.
        distributed: inside an initialized ``torch.distributed`` default group of two or more
            ranks, shard the probe items over the ranks (every rank calls ``probe`` with the same
            arguments; see :mod:`normfast.engine.runner.distributed`). With ``out`` a sharded run writes
            ``OUT.manifest.json`` and one part per rank instead of one file. ``False``: this
            process runs alone.

    Returns:
        :class:`ProbeResult` (on every rank of a sharded run). The same arguments and seed
        give the same table, sharded or not.

    Raises:
        ValueError: among others, for a NaN or infinite parameter of ``encoder`` or
            ``pair_encoder`` (named; before ``out`` is touched), and for a NaN or infinite
            objective on a virtual batch (:class:`~normfast.engine.directions.gradients.NonFiniteLoss`,
            naming the batch; the run's work folder is removed when this call made it).
    """
    from normfast.encoders import load_encoder
    from normfast.engine.directions.objectives import get_objective

    config = config or ProbeConfig()
    config.validate()
    if isinstance(objective, str):
        objective = get_objective(objective)
    probes = _as_probe_sequence(probes)
    if len(probes) == 0:
        raise ValueError("probe: expected at least one probe item, got an empty probe set")
    # the virtual batches' source, and whether a batch fits in it: said before the model is touched
    pairs = as_pair_source(pairs, objective, probes)
    if config.batch_indices is None:
        check_batch_size("probe", config.batch_size, pairs)
    if not isinstance(encoder, Encoder):
        encoder = load_encoder(encoder)
    if model_name is None:
        model_name = encoder.spec or type(encoder).__name__
    # a NaN or infinite weight makes every row NaN: said now, before the run's folder exists
    check_finite_weights("probe", encoder)
    if pair_encoder is not None:
        check_finite_weights("probe", pair_encoder, "the pair encoder")
    unknown = unknown_token_warning(encoder, probes)
    if unknown is not None:
        warnings.warn(unknown, UserWarning, stacklevel=2)
    if ids is None and callable(getattr(probes, "ids", None)):  # e.g. corpus windows: "DOC_ID/WINDOW"
        ids = probes.ids()
    if ids is not None:
        ids = [str(i) for i in ids]
        if len(ids) != len(probes):
            raise ValueError(f"probe: expected one id per probe item, got {len(ids)} ids for {len(probes)} items")
    shard = current_shard() if distributed else None

    n_items = len(probes)
    run = ProbeRun(
        encoder,
        objective,
        pairs,
        config,
        pair_encoder,
        progress and (shard is None or shard.is_root),
        second_moments,
        shard=shard,
        n_items=n_items,
    )
    n_chunks = math.ceil(n_items / config.chunk_size)
    inputs = {  # what the rows depend on besides the settings; named when a resume is refused
        "probes": hash_items(probes),
        # the pairs the virtual batches draw (every pair with the snapshot, whose trajectory draws its own)
        "pairs": hash_pairs(pairs, None if config.snapshot else np.concatenate([np.ravel(b) for b in run.batches])),
        "ids": hash_items(ids) if ids is not None else None,
        "second_moments": hash_items(sorted(second_moments.items())) if second_moments else None,
    }
    metadata = {
        "schema_version": SCHEMA_VERSION,
        "model": str(model_name),
        "model_fingerprint": hash_model(encoder),
        "tokenizer_fingerprint": hash_tokenizer(encoder_tokenizer(encoder)),
        "encoder_settings": encoder.settings(),
        "pair_encoder": None if pair_encoder is None else _identity(pair_encoder),
        "encoder_note": getattr(encoder, "note", None),
        "objective": objective.name,
        "temperature": getattr(objective, "temperature", None),
        "objective_settings": objective_settings(objective),
        "optimizer": config.optimizer,
        "lr": config.lr,
        "weight_decay": config.weight_decay,
        "momentum": config.momentum,
        "M": config.batches,
        "M_D": config.drift_batches if config.drift_from_mean else None,
        "M_initial": config.batches,
        "groups": run.groups if config.uncertainty or config.drift_from_mean else None,
        "uncertainty": config.uncertainty,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "mode": run.mode,
        "output": config.output,
        "params": config.params,
        "n_probed_parameters": len(run.names),
        "cut_stage": run.cut,
        "branch": run.branch,
        "n_items": n_items,
        "n_pairs": len(pairs),
        "chunk_size": config.chunk_size,
        "max_length": getattr(encoder, "max_length", None),
        "versions": library_versions(),
        "device": device_name(run.device),
        "config": asdict(config),
        "input_fingerprints": inputs,
    }
    if callable(getattr(probes, "describe", None)):  # e.g. corpus windows: documents, windows, stride
        metadata["corpus"] = probes.describe()
    spec = {k: metadata[k] for k in metadata if k not in ("versions", "device")}
    # the world size is not part of the spec: a run may be resumed with any number of ranks
    key = fingerprint(spec)
    metadata["spec_fingerprint"] = key
    # in words, for the summary and the page (not part of the spec: the same source may be named otherwise)
    metadata["pair_source"] = {"kind": pairs.kind, "n": len(pairs), "what": pairs.what}
    metadata["world_size"] = 1 if shard is None else shard.world_size
    if shard is not None:
        shard.check_agree(key, "arguments")

    writer = None
    done: set[int] = set()
    if out is not None:
        out = Path(out)
        finished, writer, done = open_output(out, spec, key, shard, resume, overwrite)
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
        from normfast.engine.trajectory.snapshot import snapshot_prediction

        with _abandoned_if_not_finite(writer):
            run.snapshot = snapshot_prediction(
                encoder, probes, objective, pairs, config, second_moments=second_moments, progress=run.progress
            )
        metadata["snapshot"] = run.snapshot.info
    todo = [c for c in range(n_chunks) if c not in done]
    mine = todo if shard is None else chunks_for_rank(todo, shard.rank, shard.world_size)
    t0 = time.perf_counter()
    failure = None
    try:
        if todo:  # every rank takes part (directions are collective), even one with no chunks of its own
            with _abandoned_if_not_finite(writer):
                run_chunks(run, probes, ids, mine, emit)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        if shard is None:
            raise
        failure = exc
    seconds = round(time.perf_counter() - t0, 3)
    metadata["M"] = run.M
    metadata["objective_health"] = run.objective_health()
    if run.adaptive is not None:
        metadata["adaptive"] = run.adaptive
    if shard is None:
        metadata["seconds"] = seconds
        if writer is not None:
            metadata["regime"] = run_regime(writer.read_chunk(c, REGIME_INPUTS) for c in range(n_chunks))
            inputs = heat_inputs(writer.chunk_columns(0))
            reference = heat_reference(writer.read_chunk(c, inputs) for c in range(n_chunks))
            metadata["heat_reference"] = reference
            path = writer.finalize(n_chunks, metadata, lambda t: with_relative_heat(t, reference))
            return ProbeResult.from_files([path], metadata, path)
        table = pa.concat_tables([tables[c] for c in range(n_chunks)])
        metadata["regime"] = run_regime([table])
        metadata["heat_reference"] = heat_reference([table])
        table = with_relative_heat(table, metadata["heat_reference"])
        meta_blob = {METADATA_KEY: json.dumps(metadata, default=str).encode()}
        return ProbeResult(table.replace_schema_metadata(meta_blob), metadata)
    return finish_sharded(shard, writer, out, key, metadata, n_chunks, tables, failure, seconds)


@contextlib.contextmanager
def _abandoned_if_not_finite(writer: Any) -> Iterator[None]:
    """A non-finite objective ends the run for good (the same arguments meet it again): its work folder
    goes, when this run made it, so that it does not block the next run as an unfinished one."""
    try:
        yield
    except NonFiniteLoss:
        if writer is not None:
            writer.abandon()
        raise


def _identity(encoder: Encoder) -> dict[str, Any]:
    """What makes an encoder's embeddings: its settings, weights and tokenizer (for the pair encoder)."""
    return {
        "settings": encoder.settings(),
        "model_fingerprint": hash_model(encoder),
        "tokenizer_fingerprint": hash_tokenizer(encoder_tokenizer(encoder)),
    }


def _as_probe_sequence(probes: Any) -> Sequence[Any]:
    if isinstance(probes, (list, torch.Tensor)):
        return probes
    if isinstance(probes, (str, bytes, tuple, collections.abc.Mapping)) or not (
        hasattr(probes, "__len__") and hasattr(probes, "__getitem__")
    ):
        return list(probes)
    return probes  # anything with len and slicing is read chunk by chunk, never copied whole
