"""One probe call's output, around the chunk loop: the call's record and resume key, its Parquet output
opened (or resumed: a finished run is returned as it is), the chunks run and written as they finish,
and the run finished -- one file, a table in memory, or one part per rank with a manifest -- with the
run-level summaries (the M run, how the heat's batches were drawn, the objective's health, the regime,
the reference of ``heat_rel``, the time).

:meth:`normfast.engine.prober.Prober.probe` (the session: its directions, its identity) calls
:func:`probe_call` with the call's :class:`~normfast.engine.runner.state.ProbeRun`; the Prober is passed
in as ``prober`` (this module sits below it) and read for its record and its fixed reference only.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa

from normfast.data.manifest import manifest_path, part_path, write_manifest
from normfast.data.resume_key import PROBE_RESUME_KEY
from normfast.data.schema import METADATA_KEY
from normfast.engine.diagnostics.regime import REGIME_INPUTS, run_regime
from normfast.engine.diagnostics.relative_heat import heat_inputs, heat_reference, pool_se_of, with_relative_heat
from normfast.engine.result import ProbeResult
from normfast.engine.runner.chunks import run_chunks
from normfast.engine.runner.distributed import Shard, chunks_for_rank, part_blocks
from normfast.engine.runner.files import abandoned_if_not_finite, open_output
from normfast.engine.runner.provenance import run_metadata
from normfast.engine.runner.reference import call_reference
from normfast.engine.runner.state import ProbeRun

__all__ = ["call_record", "finish_sharded", "probe_call"]

#: the finished rows by chunk: the columns asked for -> the chunks' tables (at least those columns), in order
Chunks = Callable[[Sequence[str]], Iterable[pa.Table]]


def call_record(
    prober: Any, run: ProbeRun, probes: Sequence[Any], ids: Sequence[str] | None, ident: dict, pairs_hash: str
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``(metadata, record, key)`` of one call: its metadata as known before the chunks
    (:func:`~normfast.engine.runner.provenance.run_metadata`), the record a work folder keeps (the
    metadata less the versions and the device) and the hash of its resume key
    (:data:`~normfast.data.resume_key.PROBE_RESUME_KEY`: the allow-list of what the rows depend on)."""
    metadata = run_metadata(prober, run, probes, ids, ident, pairs_hash)
    record = {k: v for k, v in metadata.items() if k not in ("versions", "device")}
    key = PROBE_RESUME_KEY.fingerprint(record)
    metadata["spec_fingerprint"] = key
    # in words, for the summary and the page (a description: the same source may be named otherwise)
    pairs = prober.pairs
    metadata["pair_source"] = {
        "kind": getattr(pairs, "kind", None),
        "n": len(pairs),
        "what": getattr(pairs, "what", None),
    }
    # not in the key: a run may be resumed with any number of ranks
    metadata["world_size"] = 1 if run.shard is None else run.shard.world_size
    return metadata, record, key


def probe_call(
    prober: Any,
    run: ProbeRun,
    probes: Sequence[Any],
    ids: Sequence[str] | None,
    metadata: dict[str, Any],
    record: Mapping[str, Any],
    key: str,
    *,
    out: str | Path | None,
    resume: bool,
    overwrite: bool,
    snapshot: Callable[[], Any] | None = None,
) -> ProbeResult:
    """The call's rows: its output opened (or resumed), ``snapshot`` (the single-snapshot predictor, for
    every item at once) before the chunks, the chunks not yet done, the outcomes and the finish."""
    shard = run.shard
    if shard is not None:
        shard.check_agree(key, "arguments")
    n_chunks = math.ceil(len(probes) / run.config.chunk_size)
    writer, done = None, set()
    if out is not None:
        out = Path(out)
        finished, writer, done = open_output(out, record, key, shard, resume, overwrite)
        run.writer = writer
        if finished is not None:
            return finished
    tables: dict[int, pa.Table] = {}

    recorded: list[bool] = []

    def emit(c: int, table: pa.Table) -> None:
        if writer is not None:
            writer.write_chunk(c, table)
            if not recorded:  # the run's outcomes beside its chunks, for a resume that computes nothing
                recorded.append(True)
                writer.record_outcomes(_outcomes({}, run))
        else:
            tables[c] = table

    if snapshot is not None:  # before the chunks: every chunk's rows take their slice of it
        with abandoned_if_not_finite(writer):
            run.snapshot = snapshot()
        metadata["snapshot"] = run.snapshot.info
    todo = [c for c in range(n_chunks) if c not in done]
    mine = todo if shard is None else chunks_for_rank(todo, shard.rank, shard.world_size)
    t0 = time.perf_counter()
    failure, fixed = None, None
    try:
        if todo:  # every rank takes part (directions are collective), even one with no chunks of its own
            with abandoned_if_not_finite(writer):
                run_chunks(run, probes, ids, mine, emit)
        # after the chunks: adaptive M fixes M on the call's first chunk; every rank computes the same
        fixed = call_reference(prober)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        if shard is None:
            raise
        failure = exc
    seconds = round(time.perf_counter() - t0, 3)
    _outcomes(metadata, run)
    if writer is not None and run.computed_nothing():  # every chunk was written before: the earlier call's
        metadata.update(writer.recorded_outcomes())
    if shard is None:
        metadata["seconds"] = seconds
        return _finish(writer, tables, n_chunks, metadata, fixed)
    return finish_sharded(shard, writer, out, key, metadata, n_chunks, tables, failure, seconds, fixed)


def _outcomes(metadata: dict[str, Any], run: ProbeRun) -> dict[str, Any]:
    """What the chunk loop decided and saw: the M run, the heat's draw, the objective's health, adaptive M
    (into ``metadata``, which is returned)."""
    metadata["M"] = run.M
    metadata["heat_sampling"] = run.heat_sampling_info()
    metadata["objective_health"] = run.objective_health()
    if run.adaptive is not None:
        metadata["adaptive"] = run.adaptive
    return metadata


def _summaries(metadata: dict[str, Any], chunks: Chunks, columns: Sequence[str], fixed: dict | None) -> None:
    """The run-level summaries of finished rows: the regime, and the reference of ``heat_rel`` (``fixed``,
    a Prober's, or else the median over the rows; ``columns``: the rows' column names)."""
    metadata["regime"] = run_regime(chunks(REGIME_INPUTS))
    if fixed is None:
        fixed = heat_reference(chunks(heat_inputs(columns)), pool_se_of(metadata))
    metadata["heat_reference"] = fixed


def _in_memory(table: pa.Table, metadata: dict[str, Any]) -> ProbeResult:
    """A result held in memory: the rows with their ``heat_rel``, the metadata in the schema."""
    table = with_relative_heat(table, metadata["heat_reference"])
    meta_blob = {METADATA_KEY: json.dumps(metadata, default=str).encode()}
    return ProbeResult(table.replace_schema_metadata(meta_blob), metadata)


def _finish(
    writer: Any, tables: dict[int, pa.Table], n_chunks: int, metadata: dict[str, Any], fixed: dict | None
) -> ProbeResult:
    """A single process's finish: the summaries, then the final file (the chunks concatenated, the work
    folder removed) or the table in memory."""
    if writer is None:
        table = pa.concat_tables([tables[c] for c in range(n_chunks)])
        _summaries(metadata, lambda columns: [table], table.column_names, fixed)
        return _in_memory(table, metadata)
    _summaries(metadata, _reader(writer, n_chunks), writer.chunk_columns(0), fixed)
    reference = metadata["heat_reference"]
    path = writer.finalize(n_chunks, metadata, lambda t: with_relative_heat(t, reference))
    return ProbeResult.from_files([path], metadata, path)


def _reader(writer: Any, n_chunks: int) -> Chunks:
    return lambda columns: (writer.read_chunk(c, columns) for c in range(n_chunks))


def finish_sharded(
    shard: Shard,
    writer: Any,
    out: Path | None,
    key: str,
    metadata: dict[str, Any],
    n_chunks: int,
    tables: dict[int, pa.Table],
    failure: BaseException | None,
    seconds: float,
    reference: dict[str, Any] | None = None,
) -> ProbeResult:
    """After the chunk loop of a sharded run: exchange outcomes, then assemble the result (``heat_rel``
    against ``reference``, a Prober's fixed one, or else the run's own median)."""
    if writer is None:
        # in memory: every rank gets every rank's rows
        gathered = shard.exchange(failure, (seconds, tables))
        metadata["seconds"] = max(s for s, _ in gathered)
        merged: dict[int, pa.Table] = {}
        for _, part in gathered:
            merged.update(part)
        table = pa.concat_tables([merged[c] for c in range(n_chunks)])
        _summaries(metadata, lambda columns: [table], table.column_names, reference)
        return _in_memory(table, metadata)
    metadata["seconds"] = max(shard.exchange(failure, seconds))
    if shard.is_root:  # every chunk is written once the exchange returns
        try:
            metadata["regime"] = run_regime(_reader(writer, n_chunks)(REGIME_INPUTS))
        except Exception as exc:  # noqa: BLE001 - a missing summary must not hang the other ranks
            metadata["regime"] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            if reference is None:
                inputs = heat_inputs(writer.chunk_columns(0))
                reference = heat_reference(_reader(writer, n_chunks)(inputs), pool_se_of(metadata))
            metadata["heat_reference"] = reference
        except Exception as exc:  # noqa: BLE001 - as above
            metadata["heat_reference"] = {"error": f"{type(exc).__name__}: {exc}", "log_level": float("nan")}
    metadata = shard.broadcast_object(metadata)  # rank 0's device string etc. on every part
    reference = metadata["heat_reference"]
    block = part_blocks(n_chunks, shard.world_size)[shard.rank]
    path = part_path(out, shard.rank, shard.world_size)
    rows, failure = 0, None
    try:
        if len(block):
            rows = writer.write_part(block, path, metadata, lambda t: with_relative_heat(t, reference))
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        failure = exc
    written = shard.exchange(failure, rows)
    parts = [
        {"path": str(part_path(out, r, shard.world_size)), "rows": written[r], "chunks": [b.start, b.stop]}
        for r, b in enumerate(part_blocks(n_chunks, shard.world_size))
        if len(b)
    ]
    failure = None
    if shard.is_root:
        try:
            write_manifest(manifest_path(out), parts, metadata, key, tmp_dir=writer.parts)
            out.unlink(missing_ok=True)  # a single-file result of an earlier run would contradict the manifest
            writer.cleanup()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            failure = exc
    shard.raise_if_root_failed(failure)
    return ProbeResult.from_files([p["path"] for p in parts], metadata, manifest_path(out))
