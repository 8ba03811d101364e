"""Streaming, resumable Parquet output, and the manifest of a sharded run.

A run writes one small Parquet file per finished chunk of probe items into a
work folder next to the output (``RUN.parquet.parts/``), each written to a
temporary name and renamed into place, so a crash can never leave a
half-written chunk behind. ``finalize`` concatenates the chunks in order into
the final file (one row group per chunk), again through a temporary name and
an atomic rename, then removes the work folder. A run restarted with the
same arguments finds the finished chunks and skips them; a run restarted with
different arguments is refused instead of mixing two runs in one table.

Sharded runs (``normfast.engine.distributed``) share the same work folder: every
rank writes the chunks it computed there. At the end rank ``r`` writes part
``RUN.rank{r}-of-{W}.parquet`` (the ``r``-th contiguous block of chunks, so
the parts in order are the items in order) and rank 0 writes
``RUN.manifest.json``, which names the parts, their row counts and chunk
ranges, the run metadata and the run's fingerprint. :func:`read_table`,
:func:`read_metadata` and ``ProbeResult.load`` accept a manifest wherever
they accept a Parquet file.

Memory: nothing here holds more than one chunk of rows at a time.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

METADATA_KEY = b"normfast"
MANIFEST_FORMAT = "normfast-manifest"
MANIFEST_VERSION = 1
_RUN_FILE = "run.json"


def fingerprint(spec: Mapping[str, Any]) -> str:
    """Stable hash of the arguments that determine a run's rows."""
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def manifest_path(out: str | os.PathLike) -> Path:
    """``runs/x.parquet`` -> ``runs/x.manifest.json``: where a sharded run's manifest goes."""
    out = Path(out)
    return out.with_name(out.stem + ".manifest.json")


def part_path(out: str | os.PathLike, index: int, n_parts: int) -> Path:
    """``runs/x.parquet`` -> ``runs/x.rank{index}-of-{n_parts}.parquet``."""
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{index}-of-{n_parts}.parquet")


def is_manifest(path: str | os.PathLike) -> bool:
    return str(path).endswith(".json")


def _atomic_write_table(table: pa.Table, path: Path, **kwargs: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp, **kwargs)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_text(text: str, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ChunkedParquetWriter:
    """Write a table chunk by chunk; resume after an interruption.

    Args:
        out: final Parquet path.
        spec: the run's defining arguments (model, probes, objective, config...);
            its fingerprint must match for a resume.
        resume: reuse finished chunks of an earlier run with the same spec.
            Without it an existing work folder is an error (never silently
            overwritten or mixed).
        overwrite: replace an existing final output (a Parquet file or a manifest).
        attach: join a work folder that another process (rank 0 of a sharded
            run) has already created or validated; only checks the fingerprint.
    """

    def __init__(self, out: str | os.PathLike, spec: Mapping[str, Any], *, resume: bool = False,
                 overwrite: bool = False, attach: bool = False):
        self.out = Path(out)
        if self.out.suffix != ".parquet":
            raise ValueError(f"ChunkedParquetWriter: expected an output path ending in .parquet, got {str(self.out)!r}")
        self.parts = self.out.with_name(self.out.name + ".parts")
        self.spec = json.loads(json.dumps(dict(spec), default=str))
        self.key = fingerprint(spec)
        self.schema: pa.Schema | None = None
        run_file = self.parts / _RUN_FILE
        if attach:
            self._check_key(run_file)
            return
        for final in (self.out, manifest_path(self.out)):
            if final.exists() and not (overwrite or resume):
                raise FileExistsError(f"{final} exists; pass overwrite=True (CLI: --overwrite) to replace it")
        if self.parts.exists():
            if not resume:
                raise FileExistsError(
                    f"{self.parts} holds an unfinished run; resume it (CLI: --resume) or delete the folder")
            self._check_key(run_file)
            self._drop_unreadable_chunks()
        else:
            self.parts.mkdir(parents=True)
            _atomic_write_text(json.dumps({"key": self.key, "spec": spec}, default=str, indent=1), run_file)

    def _check_key(self, run_file: Path) -> None:
        try:
            previous = json.loads(run_file.read_text())
        except (OSError, ValueError):
            previous = {}
        if previous.get("key") != self.key:
            changed = describe_spec_change(previous.get("spec") or {}, self.spec)
            raise ValueError(
                f"cannot resume: the unfinished run in {self.parts} was made with different arguments; "
                f"changed: {changed}. Run again with the same arguments, or delete the folder to start over")

    def _drop_unreadable_chunks(self) -> None:
        """Resume: delete chunk files whose Parquet footer cannot be read (a truncated write, a disk
        fault) so that they are computed again, and say which; leftover temporary files go too."""
        for tmp in self.parts.glob(".chunk-*.tmp"):
            tmp.unlink(missing_ok=True)
        bad = []
        for path in sorted(self.parts.glob("chunk-*.parquet")):
            try:
                pq.ParquetFile(path).close()
            except (OSError, pa.ArrowException) as exc:
                bad.append((path, exc))
        for path, _ in bad:
            path.unlink(missing_ok=True)
        if bad:
            names = ", ".join(p.name for p, _ in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            first = str(bad[0][1]).splitlines()[0] if str(bad[0][1]) else type(bad[0][1]).__name__
            warnings.warn(f"resume: {len(bad)} chunk file(s) in {self.parts} could not be read ({first}): "
                          f"{names}; computing them again", RuntimeWarning, stacklevel=4)

    def _chunk_path(self, index: int) -> Path:
        return self.parts / f"chunk-{index:07d}.parquet"

    def done(self) -> set[int]:
        """Indices of chunks already written (complete files only)."""
        out = set()
        for p in self.parts.glob("chunk-*.parquet"):
            try:
                out.add(int(p.stem.split("-")[1]))
            except ValueError:
                continue
        return out

    def write_chunk(self, index: int, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
        elif not table.schema.equals(self.schema):
            table = table.cast(self.schema)
        _atomic_write_table(table, self._chunk_path(index))

    def read_chunk(self, index: int, columns: Sequence[str] | None = None) -> pa.Table:
        return pq.read_table(self._chunk_path(index), columns=None if columns is None else list(columns))

    def write_part(self, chunks: Sequence[int], path: str | os.PathLike, metadata: Mapping[str, Any]) -> int:
        """Concatenate the given finished chunks, in order, into ``path`` (one row group per
        chunk; ``metadata`` in the schema); atomic. Returns the number of rows written.

        Reads one chunk at a time, so memory stays at one chunk whatever the run's size.
        """
        path = Path(path)
        chunks = list(chunks)
        missing = sorted(set(chunks) - self.done())
        if missing:
            raise RuntimeError(f"write_part: chunks {missing[:10]}{'...' if len(missing) > 10 else ''} "
                               f"are missing from {self.parts}")
        if not chunks:
            raise RuntimeError("write_part: nothing to write (no chunks)")
        meta_blob = json.dumps(dict(metadata), default=str).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        writer = None
        rows = 0
        try:
            for i in chunks:
                table = self.read_chunk(i)
                if writer is None:
                    schema = table.schema.with_metadata({**(table.schema.metadata or {}), METADATA_KEY: meta_blob})
                    writer = pq.ParquetWriter(tmp, schema)
                writer.write_table(table.cast(writer.schema), row_group_size=max(1, table.num_rows))
                rows += table.num_rows
                del table
            writer.close()
            writer = None
            os.replace(tmp, path)
        finally:
            if writer is not None:
                writer.close()
            Path(tmp).unlink(missing_ok=True)
        return rows

    def finalize(self, n_chunks: int, metadata: Mapping[str, Any]) -> Path:
        """Concatenate chunks ``0..n_chunks-1`` into the output file and clean up.

        A manifest left at the same output by an earlier sharded run (only possible
        with ``overwrite``/``resume``) is removed with its parts: one output, one run.
        """
        missing = sorted(set(range(n_chunks)) - self.done())
        if missing:
            raise RuntimeError(f"finalize: chunks {missing[:10]}{'...' if len(missing) > 10 else ''} "
                               f"are missing from {self.parts}")
        self.write_part(range(n_chunks), self.out, metadata)
        remove_manifest(manifest_path(self.out))
        self.cleanup()
        return self.out

    def cleanup(self) -> None:
        """Remove the work folder (after every part of the run has been written)."""
        shutil.rmtree(self.parts, ignore_errors=True)


# ----------------------------------------------------------------------------
# naming what changed between two runs
# ----------------------------------------------------------------------------
#: flattened spec key -> how a refusal names it
_SPEC_LABELS = {
    "input_fingerprints.probes": "the probe items (probes)",
    "input_fingerprints.pairs": "the virtual-batch source (pairs)",
    "input_fingerprints.ids": "the item ids (ids)",
    "input_fingerprints.second_moments": "the given second moments (second_moments)",
    "model_fingerprint": "the model's weights",
    "model": "the model",
    "n_items": "the number of probe items",
    "n_pairs": "the size of the pair source",
}


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and key != "optimizer":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _short(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_spec_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """The arguments that differ between two run specs, in words (for a refused resume).

    Settings are named as the user sets them, with their old and new values
    (``config.lr 0.001 -> 0.01``, ``objective_settings.temperature 0.05 -> 0.2``);
    inputs stored as hashes are named (``the probe items (probes)``). A top-level
    copy of a setting that changed the same way (``lr``, ``M``) is not repeated.
    """
    a = _flatten(json.loads(json.dumps(dict(old), default=str)))
    b = _flatten(json.loads(json.dumps(dict(new), default=str)))
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k != "spec_fingerprint"]
    nested = {(json.dumps(a.get(k)), json.dumps(b.get(k))) for k in changed if "." in k}
    out = []
    for k in changed:
        if "." not in k and (json.dumps(a.get(k)), json.dumps(b.get(k))) in nested:
            continue  # the same change is named under config. / objective_settings.
        label = _SPEC_LABELS.get(k)
        if k not in a:
            out.append(f"{label or k} (not recorded by the earlier run)")
        elif label is not None and (k.startswith("input_fingerprints") or k == "model_fingerprint"):
            out.append(label)
        else:
            out.append(f"{label or k} {_short(a.get(k))} -> {_short(b.get(k))}")
    return ", ".join(out) if out else "nothing that can be named (the run file is unreadable or from another version)"


# ----------------------------------------------------------------------------
# manifests
# ----------------------------------------------------------------------------
def write_manifest(path: str | os.PathLike, parts: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any],
                   key: str) -> Path:
    """Write a manifest (atomically) naming ``parts`` in item order.

    Each part is ``{"path", "rows", "chunks": [first, end)}`` (a path absolute or relative to
    the working directory); paths are stored relative to the manifest's folder so a run
    folder can be moved as a whole.
    Parts of an earlier manifest at ``path`` that the new one does not name are removed.
    """
    path = Path(path)
    entries = []
    for part in parts:
        # a relative part path is relative to the working directory, like the manifest's own path
        rel = os.path.relpath(Path(part["path"]).absolute(), path.parent.absolute())
        entries.append({"path": rel, "rows": int(part["rows"]), "chunks": [int(c) for c in part["chunks"]]})
    blob = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "fingerprint": key,
            "rows": sum(e["rows"] for e in entries), "parts": entries, "metadata": dict(metadata)}
    stale = set()
    if path.exists():
        try:
            stale = {(path.parent / e["path"]).resolve() for e in json.loads(path.read_text())["parts"]}
        except (OSError, ValueError, KeyError, TypeError):
            stale = set()
    _atomic_write_text(json.dumps(blob, default=str, indent=1), path)
    for old in stale - {(path.parent / e["path"]).resolve() for e in entries}:
        old.unlink(missing_ok=True)
    return path


def read_manifest(path: str | os.PathLike, *, check: bool = True) -> dict[str, Any]:
    """A manifest as a dict, with ``parts[i]["path"]`` resolved to absolute paths.

    ``check`` verifies that every part exists and holds the row count the manifest
    records (from the Parquet footers only: no data is read).
    """
    fn = "read_manifest"
    path = Path(path)
    try:
        blob = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{fn}: {path} is not valid JSON ({exc})") from None
    if not isinstance(blob, dict) or blob.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{fn}: {path} is not a normfast manifest (expected format={MANIFEST_FORMAT!r})")
    if blob.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{fn}: {path} has manifest version {blob.get('version')!r}, "
                         f"this normfast reads version {MANIFEST_VERSION}")
    parts = blob.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ValueError(f"{fn}: {path} names no parts")
    for part in parts:
        part["path"] = str((path.parent / part["path"]).resolve())
        if not check:
            continue
        if not Path(part["path"]).exists():
            raise FileNotFoundError(f"{fn}: part {part['path']} named by {path} does not exist")
        rows = pq.ParquetFile(part["path"]).metadata.num_rows
        if rows != part["rows"]:
            raise ValueError(f"{fn}: part {part['path']} holds {rows} rows, the manifest {path} says "
                             f"{part['rows']} (a part from a different run?)")
    return blob


def remove_manifest(path: str | os.PathLike) -> None:
    """Delete a manifest and the parts it names (no error when absent)."""
    path = Path(path)
    if not path.exists():
        return
    try:
        parts = read_manifest(path, check=False)["parts"]
    except (OSError, ValueError):
        parts = []
    for part in parts:
        Path(part["path"]).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _run_blob(path: Path) -> dict[str, Any] | None:
    """The ``normfast`` metadata of a Parquet file, or None (not Parquet, or no such metadata)."""
    try:
        blob = (pq.read_schema(path).metadata or {}).get(METADATA_KEY)
        return None if blob is None else json.loads(blob)
    except (OSError, ValueError, pa.ArrowException):
        return None


def resolve_run(path: str | os.PathLike) -> Path:
    """The file that opens a run: a Parquet file or a manifest as given, or the one run in a folder.

    A folder is resolved to the single run it holds (a manifest, or a Parquet file with
    run metadata that no manifest names as a part; per-type tables of ``normfast
    aggregate`` are not runs). A folder with several runs, or none, is an error naming
    what was found; so is the work folder of an unfinished run (``RUN.parquet.parts``).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (expected a run: its .parquet file, its "
                                f".manifest.json, or the folder holding it)")
    if not path.is_dir():
        return path
    if path.name.endswith(".parquet.parts"):
        n = len(list(path.glob("chunk-*.parquet")))
        raise ValueError(f"{path} is the work folder of an unfinished run ({n} chunk file(s)): finish the run "
                         f"by running it again with --resume (resume=True); the chunks written so far are plain "
                         f"Parquet, readable with a glob (e.g. DuckDB: SELECT * FROM '{path}/chunk-*.parquet')")
    manifests = sorted(path.glob("*.manifest.json"))
    parts: set[Path] = set()
    for m in manifests:
        try:
            parts |= {Path(p["path"]).resolve() for p in read_manifest(m, check=False)["parts"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    runs = list(manifests)
    for p in sorted(path.glob("*.parquet")):
        blob = None if p.resolve() in parts else _run_blob(p)
        if blob is not None and "aggregation" not in blob:
            runs.append(p)
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise ValueError(f"{path} holds no normfast run (no .manifest.json, no .parquet file with "
                         f"{METADATA_KEY.decode()!r} run metadata)")
    raise ValueError(f"{path} holds {len(runs)} runs ({', '.join(p.name for p in runs[:6])}"
                     f"{', ...' if len(runs) > 6 else ''}): name one of them")


def data_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files holding a run's rows, in item order: the file itself, or a manifest's parts."""
    if is_manifest(path):
        return [Path(p["path"]) for p in read_manifest(path)["parts"]]
    return [Path(path)]


# ----------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------
def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The run metadata of a normfast Parquet file (schema metadata) or manifest."""
    if is_manifest(path):
        return dict(read_manifest(path, check=False)["metadata"])
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        if Path(path).is_dir():
            raise
        raise ValueError(f"{path}: not a normfast run (not a Parquet file: {str(exc).splitlines()[0]})") from None
    blob = (schema.metadata or {}).get(METADATA_KEY)
    if blob is None:
        raise ValueError(f"{path}: not a normfast run (no {METADATA_KEY.decode()!r} schema metadata)")
    return json.loads(blob)


def read_table(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
               columns: Sequence[str] | None = None) -> pa.Table:
    """Read one run file, a manifest, or several parts as one table (in the order given)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = data_files(paths)
    tables = [pq.read_table(p, columns=columns, memory_map=True) for p in paths]
    if not tables:
        raise ValueError("read_table: no files given")
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="default")


def count_rows(paths: Iterable[str | os.PathLike]) -> int:
    """Rows in the given Parquet files, from their footers."""
    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def iter_batches(paths: Iterable[str | os.PathLike], *, columns: Sequence[str] | None = None,
                 batch_size: int = 65536) -> Iterator[pa.RecordBatch]:
    """Stream the rows of the given Parquet files, in order, at most ``batch_size`` rows at a time.

    Reads row group by row group (small consecutive row groups are joined up to
    ``batch_size`` rows): memory stays at one batch plus one row group whatever the
    file's size (``ParquetFile.iter_batches`` lets the resident memory grow with the
    size of the file it reads, pyarrow 26; reading by row groups keeps it flat).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"iter_batches: expected batch_size to be a positive int, got {batch_size!r}")
    pending: list[pa.Table] = []
    rows = 0
    for p in paths:
        pf = pq.ParquetFile(p)
        try:
            for g in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(g, columns=columns)
                pending.append(table)
                rows += table.num_rows
                if rows < batch_size:
                    continue
                joined = pa.concat_tables(pending, promote_options="default").combine_chunks()
                for batch in joined.to_batches(max_chunksize=batch_size):
                    yield batch
                pending, rows = [], 0
        finally:
            pf.close()
    if rows:
        yield from pa.concat_tables(pending, promote_options="default").combine_chunks().to_batches(
            max_chunksize=batch_size)


def json_ready(o: Any) -> Any:
    """A copy of ``o`` that ``json.dumps(..., allow_nan=False)`` accepts: numpy scalars and
    arrays become Python numbers and lists, tuples become lists, NaN and infinities ``None``."""
    import math

    import numpy as np

    if isinstance(o, dict):
        return {str(k): json_ready(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_ready(v) for v in o]
    if isinstance(o, np.ndarray):
        return [json_ready(v) for v in o.tolist()]
    if isinstance(o, (bool, np.bool_)):
        return bool(o)
    if isinstance(o, (int, np.integer)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o
