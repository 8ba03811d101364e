"""Streaming, resumable Parquet output.

A run writes one small Parquet file per finished chunk of probe items into a
work folder next to the output (``RUN.parquet.parts/``), each written to a
temporary name and renamed into place, so a crash can never leave a
half-written chunk behind. ``finalize`` concatenates the chunks in order into
the final file (one row group per chunk), again through a temporary name and
an atomic rename, then removes the work folder. A run restarted with the
same arguments finds the finished chunks and skips them; a run restarted with
different arguments is refused instead of mixing two runs in one table.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

METADATA_KEY = b"normfast"
_RUN_FILE = "run.json"


def fingerprint(spec: Mapping[str, Any]) -> str:
    """Stable hash of the arguments that determine a run's rows."""
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


class ChunkedParquetWriter:
    """Write a table chunk by chunk; resume after an interruption.

    Args:
        out: final Parquet path.
        spec: the run's defining arguments (model, probes, objective, config...);
            its fingerprint must match for a resume.
        resume: reuse finished chunks of an earlier run with the same spec.
            Without it an existing work folder is an error (never silently
            overwritten or mixed).
        overwrite: replace an existing final file.
    """

    def __init__(self, out: str | os.PathLike, spec: Mapping[str, Any], *, resume: bool = False,
                 overwrite: bool = False):
        self.out = Path(out)
        if self.out.suffix != ".parquet":
            raise ValueError(f"ChunkedParquetWriter: expected an output path ending in .parquet, got {str(self.out)!r}")
        self.parts = self.out.with_name(self.out.name + ".parts")
        self.key = fingerprint(spec)
        self.schema: pa.Schema | None = None
        if self.out.exists() and not (overwrite or resume):
            raise FileExistsError(f"{self.out} exists; pass overwrite=True (CLI: --overwrite) to replace it")
        run_file = self.parts / _RUN_FILE
        if self.parts.exists():
            if not resume:
                raise FileExistsError(
                    f"{self.parts} holds an unfinished run; resume it (CLI: --resume) or delete the folder")
            try:
                previous = json.loads(run_file.read_text())
            except (OSError, ValueError):
                previous = {}
            if previous.get("key") != self.key:
                raise ValueError(
                    f"cannot resume: the unfinished run in {self.parts} was made with different arguments "
                    f"(fingerprint {previous.get('key')!r} != {self.key!r}); delete the folder to start over")
        else:
            self.parts.mkdir(parents=True)
            _atomic_write_text(json.dumps({"key": self.key, "spec": spec}, default=str, indent=1), run_file)

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

    def read_chunk(self, index: int) -> pa.Table:
        return pq.read_table(self._chunk_path(index))

    def finalize(self, n_chunks: int, metadata: Mapping[str, Any]) -> Path:
        """Concatenate chunks ``0..n_chunks-1`` into the output file and clean up."""
        missing = sorted(set(range(n_chunks)) - self.done())
        if missing:
            raise RuntimeError(f"finalize: chunks {missing[:10]}{'...' if len(missing) > 10 else ''} "
                               f"are missing from {self.parts}")
        meta_blob = json.dumps(dict(metadata), default=str).encode()
        fd, tmp = tempfile.mkstemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent)
        os.close(fd)
        writer = None
        try:
            for i in range(n_chunks):
                table = self.read_chunk(i)
                if writer is None:
                    schema = table.schema.with_metadata({**(table.schema.metadata or {}), METADATA_KEY: meta_blob})
                    writer = pq.ParquetWriter(tmp, schema)
                writer.write_table(table.cast(writer.schema), row_group_size=max(1, table.num_rows))
            if writer is None:  # zero chunks: still write a valid, empty file
                raise RuntimeError("finalize: nothing to write (no chunks)")
            writer.close()
            writer = None
            os.replace(tmp, self.out)
        finally:
            if writer is not None:
                writer.close()
            Path(tmp).unlink(missing_ok=True)
        shutil.rmtree(self.parts, ignore_errors=True)
        return self.out


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The run metadata stored in a normfast Parquet file's schema."""
    schema = pq.read_schema(path)
    blob = (schema.metadata or {}).get(METADATA_KEY)
    if blob is None:
        raise ValueError(f"{path}: not a normfast run (no {METADATA_KEY.decode()!r} schema metadata)")
    return json.loads(blob)


def read_table(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> pa.Table:
    """Read one run file, or several parts (e.g. from a manifest) as one table."""
    if isinstance(paths, (str, os.PathLike)):
        return pq.read_table(paths)
    tables = [pq.read_table(p) for p in paths]
    if not tables:
        raise ValueError("read_table: no files given")
    return pa.concat_tables(tables, promote_options="default")
