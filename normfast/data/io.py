"""Reading a run's Parquet files, and what identifies a run.

:func:`read_table`, :func:`read_metadata`, :func:`count_rows` and
:func:`iter_batches` read a run's rows and metadata from a Parquet file or a
sharded run's manifest (:mod:`normfast.data.manifest`), always with the Parquet
page checksums verified: a file that fails them (or cannot be parsed) is a
:class:`DamagedFile` naming it (pyarrow's own error names no file);
:func:`read_parquet` reads any one Parquet file normfast wrote the same way (a
monitor's ``monitor.parquet``); :func:`open_run` opens a run for a reader, its format's
version and its columns' types checked; :func:`fingerprint` hashes the arguments that define a
run, and :func:`describe_spec_change` names, in words, those that differ between
two runs (for a refused resume). The run's work folder and its chunks are
:mod:`normfast.data.runwriter`'s.

Memory: :func:`iter_batches` holds one batch plus one row group at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from normfast.core.checks import first_line
from normfast.data.formats import check_column_types, run_metadata
from normfast.data.manifest import data_files, is_manifest, read_manifest
from normfast.data.schema import METADATA_KEY

__all__ = [
    "DamagedFile",
    "check_columns",
    "count_rows",
    "describe_spec_change",
    "fingerprint",
    "iter_batches",
    "json_ready",
    "open_run",
    "read_metadata",
    "read_parquet",
    "read_table",
]


class DamagedFile(OSError, ValueError):
    """A file normfast wrote that no longer reads as written (a page checksum fails, the Parquet cannot be
    parsed): one line naming the file. ``path`` is the file. An ``OSError`` as pyarrow's own error was
    (so code that caught that still does), and a ``ValueError`` as every other refusal of bad input."""

    def __init__(self, path: str | os.PathLike, exc: BaseException):
        super().__init__(
            f"{path} cannot be read ({first_line(exc)}): the file was damaged or changed after normfast wrote "
            f"it, and its values cannot be trusted"
        )
        self.path = Path(path)


@contextlib.contextmanager
def naming_damage(path: str | os.PathLike) -> Iterator[None]:
    """Turn pyarrow's error for a file whose content is bad into a :class:`DamagedFile` naming ``path``;
    an operating-system error with its errno (a full disk, a forbidden or missing file) says so itself."""
    try:
        yield
    except DamagedFile:
        raise
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise
        raise DamagedFile(path, exc) from None


def fingerprint(spec: Mapping[str, Any]) -> str:
    """Stable hash of the arguments that determine a run's rows. A number is hashed by its value:
    ``2048`` and ``2048.0`` are one setting (the command line parses floats where Python passes ints)."""
    blob = json.dumps(_by_value(spec), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _by_value(value: Any) -> Any:
    """``value`` with every integral float written as an int, in nested dicts, lists and tuples."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {k: _by_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_by_value(v) for v in value]
    return value


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
    "tokenizer_fingerprint": "the tokenizer",
    "encoder_settings.lowercase": "the tokenizer's lowercasing (encoder_settings.lowercase)",
    "encoder_settings.modules": "the model's modules (encoder_settings.modules: their types and sizes)",
    "encoder_settings.config": "the model's configuration (encoder_settings.config)",
    "encoder_settings.preprocess": "the image preprocessing (encoder_settings.preprocess)",
    "pair_encoder.model_fingerprint": "the pair encoder's weights",
    "pair_encoder.tokenizer_fingerprint": "the pair encoder's tokenizer",
    "model": "the model",
    "columns": "the output's columns (a format version of other columns: schema_version)",
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


def _is_hash(key: str) -> bool:
    """Whether a flattened spec key holds a content hash (named, its values not shown)."""
    return (
        key == "columns"
        or key.startswith("input_fingerprints.")
        or key.endswith(("fingerprint", ".modules", ".config", ".preprocess"))
    )


def describe_spec_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """The arguments that differ between two run specs, in words (for a refused resume).

    Settings are named as the user sets them, with their old and new values
    (``config.lr 0.001 -> 0.01``, ``objective_settings.temperature 0.05 -> 0.2``,
    ``encoder_settings.pooling ["mean"] -> ["cls"]``); inputs, weights and tokenizers stored as
    hashes are named only (``the probe items (probes)``, ``the model's weights``, ``the
    tokenizer``). A top-level copy of a setting that changed the same way (``lr``, ``M``) is not
    repeated.
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
        elif _is_hash(k):
            out.append(label or k)
        else:
            out.append(f"{label or k} {_short(a.get(k))} -> {_short(b.get(k))}")
    return ", ".join(out) if out else "nothing that can be named (the run file is unreadable or from another version)"


# ----------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------
def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The run metadata of a normfast Parquet file (schema metadata) or manifest.

    Every reader of a run comes through here, so the format is checked here, once
    (:func:`normfast.data.schema.run_metadata`): metadata that is not a JSON object, or whose
    ``schema_version`` is not an integer, is a one-line ``ValueError`` naming the file; a newer
    version is refused (upgrade normfast), an older one read with a warning that says so.
    """
    if is_manifest(path):
        return run_metadata(read_manifest(path, check=False)["metadata"], path)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        if Path(path).is_dir():
            raise
        raise ValueError(f"{path}: not a normfast run (not a Parquet file: {first_line(exc)})") from None
    blob = (schema.metadata or {}).get(METADATA_KEY)
    if blob is None:
        raise ValueError(f"{path}: not a normfast run (no {METADATA_KEY.decode()!r} schema metadata)")
    try:
        parsed = json.loads(blob)
    except ValueError as exc:
        raise ValueError(
            f"{path}: its normfast metadata is not JSON ({first_line(exc)}): the file is damaged or was not "
            f"written by normfast"
        ) from None
    return run_metadata(parsed, path)


def check_columns(paths: Iterable[str | os.PathLike]) -> None:
    """Refuse a run file whose registered columns hold values of another type (``V2`` as strings): one
    ``ValueError`` line naming the file and the column (from the footers; no data is read)."""
    for p in paths:
        check_column_types(pq.read_schema(p), p)


def open_run(path: str | os.PathLike) -> tuple[list[Path], dict[str, Any]]:
    """``(the Parquet files holding the run's rows in item order, its metadata)`` of a run file or
    manifest, checked: the format's version (:func:`read_metadata`) and the columns' types
    (:func:`check_columns`). What ``ProbeResult.load`` and ``aggregate`` open a run with."""
    metadata = read_metadata(path)
    files = data_files(path)
    check_columns(files)
    return files, metadata


def read_table(
    paths: str | os.PathLike | Iterable[str | os.PathLike], *, columns: Sequence[str] | None = None
) -> pa.Table:
    """Read one run file, a manifest, or several parts as one table (in the order given)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = data_files(paths)
    tables = [read_parquet(p, columns=columns) for p in paths]
    if not tables:
        raise ValueError("read_table: no files given")
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="default")


def read_parquet(path: str | os.PathLike, *, columns: Sequence[str] | None = None) -> pa.Table:
    """One Parquet file normfast wrote, read whole (or ``columns``) with its page checksums verified; a
    damaged file is a :class:`DamagedFile` naming it."""
    with naming_damage(path):
        return pq.read_table(path, columns=columns, memory_map=True, page_checksum_verification=True)


def count_rows(paths: Iterable[str | os.PathLike]) -> int:
    """Rows in the given Parquet files, from their footers."""
    total = 0
    for p in paths:
        with naming_damage(p):
            total += pq.ParquetFile(p).metadata.num_rows
    return total


def iter_batches(
    paths: Iterable[str | os.PathLike], *, columns: Sequence[str] | None = None, batch_size: int = 65536
) -> Iterator[pa.RecordBatch]:
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
        with naming_damage(p):
            pf = pq.ParquetFile(p, page_checksum_verification=True)
        try:
            for g in range(pf.metadata.num_row_groups):
                with naming_damage(p):
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
        yield from (
            pa.concat_tables(pending, promote_options="default").combine_chunks().to_batches(max_chunksize=batch_size)
        )


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
