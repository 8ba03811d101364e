"""The manifest of a sharded run, and finding the files of a run.

A sharded run (``normfast.engine.runner.distributed``) ends with one part per rank,
``RUN.rank{r}-of-{W}.parquet`` (the ``r``-th contiguous block of chunks, so the
parts in order are the items in order), and rank 0 writes ``RUN.manifest.json``,
which names the parts, their row counts and chunk ranges, the run metadata and
the run's fingerprint. :func:`normfast.data.io.read_table`,
:func:`normfast.data.io.read_metadata` and ``ProbeResult.load`` accept a
manifest wherever they accept a Parquet file.

A manifest's part paths are stored relative to its folder and read back only
inside it (:func:`normfast.core.paths.inside_folder`): a planted manifest naming
``../victim`` is refused, and only files named like parts
(``*.rank{r}-of-{W}.parquet``) inside the folder are ever deleted.

:func:`resolve_run` turns what a user names (a Parquet file, a manifest, a
folder) into the file that opens the run; :func:`data_files` lists the Parquet
files that hold its rows, and :func:`run_inputs` every file a reader opens.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from normfast.core.paths import inside_folder
from normfast.data.atomic import write_text_atomically
from normfast.data.formats import format_version
from normfast.data.schema import METADATA_KEY
from normfast.data.textfiles import read_text

MANIFEST_FORMAT = "normfast-manifest"
MANIFEST_VERSION = 1
#: what normfast names the parts of a sharded run (the only files a manifest may have deleted)
_PART_NAME = re.compile(r".+\.rank\d+-of-\d+\.parquet$")


def manifest_path(out: str | os.PathLike) -> Path:
    """``runs/x.parquet`` -> ``runs/x.manifest.json``: where a sharded run's manifest goes."""
    out = Path(out)
    return out.with_name(out.stem + ".manifest.json")


def run_stem(path: str | os.PathLike) -> str:
    """A run's name from its file: ``runs/x.parquet`` or ``runs/x.manifest.json`` -> ``x`` (the inverse of
    :func:`manifest_path`), for the files a command writes beside it."""
    name = Path(path).name
    return name[: -len(".manifest.json")] if name.endswith(".manifest.json") else Path(name).stem


def part_path(out: str | os.PathLike, index: int, n_parts: int) -> Path:
    """``runs/x.parquet`` -> ``runs/x.rank{index}-of-{n_parts}.parquet``."""
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{index}-of-{n_parts}.parquet")


def is_manifest(path: str | os.PathLike) -> bool:
    return str(path).endswith(".json")


def write_manifest(
    path: str | os.PathLike,
    parts: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any],
    key: str,
    *,
    tmp_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a manifest (atomically) naming ``parts`` in item order.

    Each part is ``{"path", "rows", "chunks": [first, end)}``. A relative part path
    is taken from the working directory, as every path a caller passes is; parts are
    stored relative to the manifest's folder (so a run folder can be moved as a
    whole) and must lie inside it. Parts of an earlier manifest at ``path`` that the
    new one does not name are removed (only part files inside its folder, see
    :func:`remove_manifest`). ``tmp_dir``: where the temporary file goes (default:
    beside ``path``).
    """
    path = Path(path)
    folder = path.parent.resolve()
    entries = []
    for part in parts:
        p = Path(part["path"])
        rel = os.path.relpath(p.resolve(), folder)
        inside_folder(folder, rel, f"write_manifest: the part {p}")
        entries.append({"path": rel, "rows": int(part["rows"]), "chunks": [int(c) for c in part["chunks"]]})
    blob = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "fingerprint": key,
        "rows": sum(e["rows"] for e in entries),
        "parts": entries,
        "metadata": dict(metadata),
    }
    stale = set(_removable_parts(path)) if path.exists() else set()
    write_text_atomically(json.dumps(blob, default=str, indent=1), path, Path(tmp_dir) if tmp_dir is not None else None)
    for old in stale - {(folder / e["path"]).resolve() for e in entries}:
        old.unlink(missing_ok=True)
    return path


def read_manifest(path: str | os.PathLike, *, check: bool = True) -> dict[str, Any]:
    """A manifest as a dict, with ``parts[i]["path"]`` resolved to absolute paths.

    A part outside the manifest's folder (``../x``, an absolute path elsewhere, a
    link leading out) is refused with ``ValueError``: it is never opened.
    ``check`` verifies that every part exists and holds the row count the manifest
    records (from the Parquet footers only: no data is read).
    """
    fn = "read_manifest"
    path = Path(path)
    try:
        blob = json.loads(read_text(path, "manifest"))
    except ValueError as exc:
        raise ValueError(f"{fn}: {path} is not valid JSON ({exc})") from None
    if not isinstance(blob, dict) or blob.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{fn}: {path} is not a normfast manifest (expected format={MANIFEST_FORMAT!r})")
    format_version(
        blob,
        f"{fn}: {path}",
        key="version",
        current=MANIFEST_VERSION,
        what="manifest format",
        older="its fields are read as this version's",
    )
    parts = blob.get("parts")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        raise ValueError(f"{fn}: {path} names no parts")
    for part in parts:
        part["path"] = str(inside_folder(path.parent, part.get("path"), f"{fn}: the manifest {path}").resolve())
        if not check:
            continue
        if not Path(part["path"]).exists():
            raise FileNotFoundError(f"{fn}: part {part['path']} named by {path} does not exist")
        rows = pq.ParquetFile(part["path"]).metadata.num_rows
        if rows != part["rows"]:
            raise ValueError(
                f"{fn}: part {part['path']} holds {rows} rows, the manifest {path} says "
                f"{part['rows']} (a part from a different run?)"
            )
    return blob


def _removable_parts(path: Path) -> list[Path]:
    """The files of a manifest that :func:`remove_manifest` may delete: the parts it names that lie
    inside its folder and are named like parts (``*.rank{r}-of-{W}.parquet``). Any other entry is
    left alone, with a warning."""
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
        entries = [e.get("path") for e in blob["parts"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    out = []
    for name in entries:
        try:
            part = inside_folder(path.parent, name, f"the manifest {path}")
        except ValueError as exc:
            warnings.warn(f"{exc}; that file was left alone", RuntimeWarning, stacklevel=3)
            continue
        if not _PART_NAME.match(part.name) or part.is_dir():
            warnings.warn(
                f"the manifest {path} names {name!r}, which is not a part of a sharded run; that file was left alone",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        out.append(part.resolve())
    return out


def remove_manifest(path: str | os.PathLike) -> None:
    """Delete a manifest and its parts (no error when absent). Only part files inside the
    manifest's folder are deleted; a manifest naming anything else (``../victim.txt``) has
    those entries left alone, with a warning."""
    path = Path(path)
    if not path.exists():
        return
    for part in _removable_parts(path):
        part.unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def run_inputs(path: str | os.PathLike) -> list[Path]:
    """Every file a reader of the run at ``path`` opens (for the output-versus-input check): the
    file itself, and a manifest's parts when it can be read."""
    files = [Path(path)]
    if is_manifest(path) and Path(path).is_file():
        try:
            files += [Path(p["path"]) for p in read_manifest(path, check=False)["parts"]]
        except (OSError, ValueError):
            pass  # the reader reports it
    return files


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
        raise FileNotFoundError(
            f"{path} does not exist (expected a run: its .parquet file, its .manifest.json, or the folder holding it)"
        )
    if not path.is_dir():
        return path
    if path.name.endswith(".parquet.parts"):
        n = len(list(path.glob("chunk-*.parquet")))
        raise ValueError(
            f"{path} is the work folder of an unfinished run ({n} chunk file(s)): finish the run "
            f"by running it again with --resume (resume=True); the chunks written so far are plain "
            f"Parquet, readable with a glob (e.g. DuckDB: SELECT * FROM '{path}/chunk-*.parquet')"
        )
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
        raise ValueError(
            f"{path} holds no normfast run (no .manifest.json, no .parquet file with "
            f"{METADATA_KEY.decode()!r} run metadata)"
        )
    raise ValueError(
        f"{path} holds {len(runs)} runs ({', '.join(p.name for p in runs[:6])}"
        f"{', ...' if len(runs) > 6 else ''}): name one of them"
    )


def data_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files holding a run's rows, in item order: the file itself, or a manifest's parts."""
    if is_manifest(path):
        return [Path(p["path"]) for p in read_manifest(path)["parts"]]
    return [Path(path)]
