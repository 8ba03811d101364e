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

Faults (docs/reliability.md lists them all):

* Every file is written with Parquet page checksums (``write_page_checksum``) and
  read with them verified; every chunk also gets a SHA-256 of its bytes beside it
  (``chunk-N.parquet.sha256``, written before the chunk is renamed into place).
  A resume checks each chunk against it, so a chunk corrupted anywhere (page
  data, page header, footer) is named and computed again, like a truncated one.
* The work folder is created whole (``run.json`` and the lock file inside a
  temporary folder that is then renamed), so no folder without ``run.json`` can
  come from an interrupted start; the temporary files of every later write
  (chunks, parts, the final file, the manifest) live inside it, so a kill leaves
  nothing hidden beside the output. The one process that works in a folder holds
  an advisory lock (``flock``) on its ``lock`` file (:class:`RunLock`); a second
  one is refused with the holder named, and a dead holder frees it by dying.
* A manifest's part paths are stored relative to its folder and read back only
  inside it (:func:`normfast.core.paths.inside_folder`): a planted manifest
  naming ``../victim`` is refused, and only files named like parts
  (``*.rank{r}-of-{W}.parquet``) inside the folder are ever deleted.

Memory: nothing here holds more than one chunk of rows at a time.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from normfast.core.checks import first_line
from normfast.core.paths import inside_folder
from normfast.data.runlock import LOCK_FILE as _LOCK_FILE
from normfast.data.runlock import RunFolderLocked, RunLock  # noqa: F401 - RunFolderLocked: re-exported
from normfast.data.textfiles import read_text

METADATA_KEY = b"normfast"
MANIFEST_FORMAT = "normfast-manifest"
MANIFEST_VERSION = 1
_RUN_FILE = "run.json"
_DIGEST = ".sha256"
#: what normfast names the parts of a sharded run (the only files a manifest may have deleted)
_PART_NAME = re.compile(r".+\.rank\d+-of-\d+\.parquet$")


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


def _write_file_atomically(data: Any, path: Path, tmp_dir: Path | None = None) -> None:
    """``data`` (bytes or a pyarrow buffer) into ``path`` through a temporary file in ``tmp_dir``
    (default: beside ``path``; the same filesystem) and an atomic rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir or path.parent)
    os.close(fd)
    try:
        with open(tmp, "wb") as fh:
            fh.write(memoryview(data))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_text(text: str, path: Path, tmp_dir: Path | None = None) -> None:
    _write_file_atomically(text.encode(), path, tmp_dir)


def _parquet_bytes(table: pa.Table) -> pa.Buffer:
    """A table as a Parquet file in memory, with page checksums."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    return sink.getvalue()


class ChunkedParquetWriter:
    """Write a table chunk by chunk; resume after an interruption.

    Args:
        out: final Parquet path.
        spec: the run's defining arguments (model, probes, objective, config...);
            its fingerprint must match for a resume.
        resume: reuse finished chunks of an earlier run with the same spec.
            Without it an existing work folder is an error (never silently
            overwritten or mixed).
        overwrite: replace an existing final output (a Parquet file or a manifest);
            without ``resume``, an unfinished run's work folder too.
        attach: join a work folder that another process (rank 0 of a sharded
            run) has already created or validated; only checks the fingerprint.

    Except with ``attach``, the writer holds the folder's :class:`RunLock` until
    :meth:`cleanup` (or :meth:`release`); another process is refused meanwhile.
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
        self.lock: RunLock | None = None
        run_file = self.parts / _RUN_FILE
        if attach:
            self._check_key(run_file)
            return
        for final in (self.out, manifest_path(self.out)):
            if final.exists() and not (overwrite or resume):
                raise FileExistsError(f"{final} exists; pass overwrite=True (CLI: --overwrite) to replace it")
        self._sweep_unborn_folders()
        if self.parts.exists() or self.parts.is_symlink():
            if not self.parts.is_dir() or self.parts.is_symlink():
                raise FileExistsError(f"{self.parts} is in the way of the run's work folder (it is not a folder "
                                      f"normfast made); move it away")
            self.lock = RunLock(self.parts).acquire()
            if resume:
                self._check_key(run_file)
                self._drop_unreadable_chunks()
                return
            if not overwrite:
                self.release()
                raise FileExistsError(
                    f"{self.parts} holds an unfinished run; continue it (resume=True, CLI: --resume), start over "
                    f"(overwrite=True, CLI: --overwrite), or delete the folder (rm -r {self.parts})")
            self._discard()
        self._create()

    # -- the work folder ------------------------------------------------------------
    def _create(self) -> None:
        """Create the work folder whole: run.json and the lock inside a temporary folder, renamed into place."""
        self.parts.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.parts.name}.", suffix=".tmp", dir=self.parts.parent))
        lock = RunLock(tmp).acquire()
        try:
            _atomic_write_text(json.dumps({"key": self.key, "spec": self.spec}, default=str, indent=1),
                               tmp / _RUN_FILE)
            try:
                os.rename(tmp, self.parts)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise FileExistsError(f"{self.parts} was created by another process at the same moment; "
                                      f"it holds that run now") from None
        except BaseException:
            lock.release()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.lock = lock.moved_to(self.parts)  # the locked file moved with the folder: still held

    def _sweep_unborn_folders(self) -> None:
        """Remove temporary work folders of starts that were killed before their rename: unlocked, and older
        than a minute (a start in progress takes milliseconds between creating its folder and locking it)."""
        for tmp in self.parts.parent.glob(f".{glob_escape(self.parts.name)}.*.tmp"):
            if not tmp.is_dir() or tmp.is_symlink() or time.time() - tmp.stat().st_mtime < 60:
                continue
            try:
                lock = RunLock(tmp).acquire()
            except (OSError, RunFolderLocked):
                continue  # another process is creating it right now
            lock.release()
            shutil.rmtree(tmp, ignore_errors=True)

    def _discard(self) -> None:
        """Delete an unfinished run's work folder (overwrite): only files normfast writes there."""
        strays = [p.name for p in self.parts.iterdir() if not _is_work_file(p.name)]
        if strays:
            self.release()
            raise FileExistsError(f"{self.parts} holds files normfast did not write ({', '.join(strays[:5])}); "
                                  f"it was not deleted. Move them away or delete the folder yourself")
        for p in self.parts.iterdir():
            if p.name != _LOCK_FILE:
                p.unlink()
        lock, self.lock = self.lock, None
        (self.parts / _LOCK_FILE).unlink(missing_ok=True)
        self.parts.rmdir()
        lock.release()

    def _check_key(self, run_file: Path) -> None:
        try:
            previous = json.loads(run_file.read_text())
        except FileNotFoundError:
            self.release()
            raise ValueError(
                f"cannot resume: the unfinished run in {self.parts} has no {_RUN_FILE} (deleted, or left by an older "
                f"normfast that was stopped while starting), so its chunks cannot be matched to these arguments. "
                f"Start over with overwrite=True (CLI: --overwrite), or delete the folder: rm -r {self.parts}") from None
        except (OSError, ValueError):
            previous = {}
        if previous.get("key") != self.key:
            changed = describe_spec_change(previous.get("spec") or {}, self.spec)
            self.release()
            raise ValueError(
                f"cannot resume: the unfinished run in {self.parts} was made with different arguments; "
                f"changed: {changed}. Run again with the same arguments, or start over with overwrite=True "
                f"(CLI: --overwrite) or by deleting the folder (rm -r {self.parts})")

    def _drop_unreadable_chunks(self) -> None:
        """Resume: delete the chunk files that fail their checksum or cannot be read (a truncated write, a
        disk fault, a flipped bit anywhere in the file), so that they are computed again, and say which;
        leftover temporary files go too."""
        for tmp in self.parts.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        for digest in self.parts.glob(f"chunk-*.parquet{_DIGEST}"):
            if not digest.with_name(digest.name[:-len(_DIGEST)]).exists():
                digest.unlink(missing_ok=True)  # its chunk was never renamed into place
        bad = []
        for path in sorted(self.parts.glob("chunk-*.parquet")):
            problem = verify_chunk(path)
            if problem is not None:
                bad.append((path, problem))
        for path, _ in bad:
            path.unlink(missing_ok=True)
            path.with_name(path.name + _DIGEST).unlink(missing_ok=True)
        if bad:
            names = ", ".join(p.name for p, _ in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            warnings.warn(f"resume: {len(bad)} chunk file(s) in {self.parts} could not be read ({bad[0][1]}): "
                          f"{names}; computing them again", RuntimeWarning, stacklevel=4)

    def release(self) -> None:
        """Give up the folder's lock (the run stops here; its files stay)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- chunks ---------------------------------------------------------------------
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
        """Write one chunk: its SHA-256 first, then the chunk itself (each atomically)."""
        if self.schema is None:
            self.schema = table.schema
        elif not table.schema.equals(self.schema):
            table = table.cast(self.schema)
        data = _parquet_bytes(table)
        path = self._chunk_path(index)
        _write_file_atomically(hashlib.sha256(memoryview(data)).hexdigest().encode(),
                               path.with_name(path.name + _DIGEST))
        _write_file_atomically(data, path)

    def read_chunk(self, index: int, columns: Sequence[str] | None = None) -> pa.Table:
        path = self._chunk_path(index)
        try:
            return pq.read_table(path, columns=None if columns is None else list(columns),
                                 page_checksum_verification=True)
        except (OSError, pa.ArrowException) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EIO):
                raise
            raise ValueError(f"{path} cannot be read ({first_line(exc)}): the chunk was damaged after it was "
                             f"written; run again with --resume (resume=True) to compute it again") from exc

    def write_part(self, chunks: Sequence[int], path: str | os.PathLike, metadata: Mapping[str, Any]) -> int:
        """Concatenate the given finished chunks, in order, into ``path`` (one row group per
        chunk; ``metadata`` in the schema; page checksums); atomic, through a temporary file in
        the work folder. Returns the number of rows written.

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
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.parts)
        os.close(fd)
        writer = None
        rows = 0
        try:
            for i in chunks:
                table = self.read_chunk(i)
                if writer is None:
                    schema = table.schema.with_metadata({**(table.schema.metadata or {}), METADATA_KEY: meta_blob})
                    writer = pq.ParquetWriter(tmp, schema, write_page_checksum=True)
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
        """Remove the work folder (after every part of the run has been written), then the lock."""
        shutil.rmtree(self.parts, ignore_errors=True)
        self.release()


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters taken literally."""
    import glob

    return glob.escape(name)


def _is_work_file(name: str) -> bool:
    """Whether a file in a work folder is one normfast writes there."""
    return (name in (_RUN_FILE, _LOCK_FILE) or re.fullmatch(r"chunk-\d+\.parquet(\.sha256)?", name) is not None
            or (name.startswith(".") and name.endswith(".tmp")) or name.startswith("outer-"))


def verify_chunk(path: str | os.PathLike) -> str | None:
    """Why a chunk file cannot be used (None when it can): its bytes against the SHA-256 written
    beside it, or, without one, a full read with the page checksums verified."""
    path = Path(path)
    try:
        data = path.read_bytes()
        digest = path.with_name(path.name + _DIGEST)
        if digest.exists():
            if hashlib.sha256(data).hexdigest() != digest.read_text().strip():
                return "the bytes do not match the checksum written with them"
            return None
        pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (OSError, pa.ArrowException) as exc:
        return first_line(exc)
    return None


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
                   key: str, *, tmp_dir: str | os.PathLike | None = None) -> Path:
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
    blob = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "fingerprint": key,
            "rows": sum(e["rows"] for e in entries), "parts": entries, "metadata": dict(metadata)}
    stale = set(_removable_parts(path)) if path.exists() else set()
    _atomic_write_text(json.dumps(blob, default=str, indent=1), path,
                       Path(tmp_dir) if tmp_dir is not None else None)
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
    if blob.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{fn}: {path} has manifest version {blob.get('version')!r}, "
                         f"this normfast reads version {MANIFEST_VERSION}")
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
            raise ValueError(f"{fn}: part {part['path']} holds {rows} rows, the manifest {path} says "
                             f"{part['rows']} (a part from a different run?)")
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
            warnings.warn(f"the manifest {path} names {name!r}, which is not a part of a sharded run; that file "
                          f"was left alone", RuntimeWarning, stacklevel=3)
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
    tables = [pq.read_table(p, columns=columns, memory_map=True, page_checksum_verification=True) for p in paths]
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
        pf = pq.ParquetFile(p, page_checksum_verification=True)
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
