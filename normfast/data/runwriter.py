"""Streaming, resumable Parquet output: a run's work folder of finished chunks.

A run writes one small Parquet file per finished chunk of probe items into a
work folder next to the output (``RUN.parquet.parts/``), each written to a
temporary name and renamed into place, so a crash can never leave a
half-written chunk behind. ``finalize`` concatenates the chunks in order into
the final file (one row group per chunk), again through a temporary name and
an atomic rename, then removes the files it wrote in the work folder, and the
folder when nothing else is in it (a file the user put there is left, and
named in a warning). A run restarted with the same arguments finds the
finished chunks and skips them; a run restarted with different arguments is
refused instead of mixing two runs in one table.

Sharded runs (``normfast.engine.runner.distributed``) share the same work folder: every
rank writes the chunks it computed there, and each writes its part
(:meth:`ChunkedParquetWriter.write_part`); the manifest that names the parts is
:mod:`normfast.data.manifest`'s.

Faults (docs/reliability.md lists them all):

* Every file is written with Parquet page checksums (``write_page_checksum``) and
  read with them verified; every chunk also gets a SHA-256 of its bytes beside it
  (``chunk-N.parquet.sha256``, written before the chunk is renamed into place).
  A resume checks each chunk against it (:func:`verify_chunk`), so a chunk
  corrupted anywhere (page data, page header, footer) is named and computed
  again, like a truncated one.
* The work folder is created whole (``run.json`` and the lock file inside a
  temporary folder that is then renamed), so no folder without ``run.json`` can
  come from an interrupted start; the temporary files of every later write
  (chunks, parts, the final file, the manifest) live inside it, so a kill leaves
  nothing hidden beside the output. The one process that works in a folder holds
  an advisory lock (``flock``) on its ``lock`` file (:class:`RunLock`); a second
  one is refused with the holder named, and a dead holder frees it by dying.

Memory: nothing here holds more than one chunk of rows at a time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from normfast.core.checks import first_line
from normfast.data.atomic import temporary_file, temporary_folder, write_file_atomically, write_text_atomically
from normfast.data.checksum import DIGEST_SUFFIX as _DIGEST
from normfast.data.checksum import digest_path, sha256_hex
from normfast.data.manifest import manifest_path, remove_manifest
from normfast.data.resume_key import WHOLE_SPEC, ResumeKey
from normfast.data.runlock import LOCK_FILE as _LOCK_FILE
from normfast.data.runlock import RunFolderLocked, RunLock
from normfast.data.schema import METADATA_KEY

_RUN_FILE = "run.json"


def _parquet_bytes(table: pa.Table) -> pa.Buffer:
    """A table as a Parquet file in memory, with page checksums."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    return sink.getvalue()


class ChunkedParquetWriter:
    """Write a table chunk by chunk; resume after an interruption.

    Args:
        out: final Parquet path.
        spec: the run's record (model, probes, objective, config...), kept in the work
            folder's ``run.json``; a resume compares the part of it that ``key`` names.
        key: what a resume compares in two records (:mod:`normfast.data.resume_key`): a probe
            run's allow-list (``PROBE_RESUME_KEY``), by default the whole record. Applied to the
            earlier run's record too, so a record with more or fewer keys outside it still matches.
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

    def __init__(
        self,
        out: str | os.PathLike,
        spec: Mapping[str, Any],
        *,
        resume: bool = False,
        overwrite: bool = False,
        attach: bool = False,
        key: ResumeKey = WHOLE_SPEC,
    ):
        self.out = Path(out)
        if self.out.suffix != ".parquet":
            raise ValueError(f"ChunkedParquetWriter: expected an output path ending in .parquet, got {str(self.out)!r}")
        self.parts = self.out.with_name(self.out.name + ".parts")
        self.spec = json.loads(json.dumps(dict(spec), default=str))
        self.resume_key = key
        self.key = key.fingerprint(spec)
        self.schema: pa.Schema | None = None
        self.lock: RunLock | None = None
        self.created = False  # whether this writer made the work folder (so everything in it is this run's)
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
                raise FileExistsError(
                    f"{self.parts} is in the way of the run's work folder (it is not a folder "
                    f"normfast made); move it away"
                )
            self.lock = RunLock(self.parts).acquire()
            if resume:
                self._check_key(run_file)
                self._drop_unreadable_chunks()
                return
            if not overwrite:
                self.release()
                raise FileExistsError(
                    f"{self.parts} holds an unfinished run; continue it (resume=True, CLI: --resume), start over "
                    f"(overwrite=True, CLI: --overwrite), or delete the folder (rm -r {self.parts})"
                )
            self._discard()
        self._create()

    # -- the work folder ------------------------------------------------------------
    def _create(self) -> None:
        """Create the work folder whole: run.json and the lock inside a temporary folder, renamed into place."""
        self.parts.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_folder(self.parts)
        lock = RunLock(tmp).acquire()
        try:
            write_text_atomically(
                json.dumps({"key": self.key, "spec": self.spec}, default=str, indent=1), tmp / _RUN_FILE
            )
            try:
                os.rename(tmp, self.parts)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise FileExistsError(
                    f"{self.parts} was created by another process at the same moment; it holds that run now"
                ) from None
        except BaseException:
            lock.release()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.lock = lock.moved_to(self.parts)  # the locked file moved with the folder: still held
        self.created = True

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
            left = remove_work_files(tmp)
            if left:
                warnings.warn(f"{tmp}: left {describe_left(left)}", RuntimeWarning, stacklevel=4)

    def _discard(self) -> None:
        """Delete an unfinished run's work folder (overwrite): only files normfast writes there."""
        strays = sorted(p.name for p in self.parts.iterdir() if not _is_work_file(p))
        if strays:
            self.release()
            raise FileExistsError(
                f"{self.parts} holds files normfast did not write ({', '.join(strays[:5])}); "
                f"it was not deleted. Move them away or delete the folder yourself"
            )
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
                f"Start over with overwrite=True (CLI: --overwrite), or delete the folder: rm -r {self.parts}"
            ) from None
        except (OSError, ValueError):
            previous = {}
        earlier = previous.get("spec") if isinstance(previous, dict) else None
        earlier = earlier if isinstance(earlier, dict) else {}
        # the earlier record through today's key: keys it holds outside the key (or lacks) do not matter
        if self.resume_key.fingerprint(earlier) != self.key:
            changed = self.resume_key.describe(earlier, self.spec)
            self.release()
            raise ValueError(
                f"cannot resume: the unfinished run in {self.parts} was made with different arguments; "
                f"changed: {changed}. Run again with the same arguments, or start over with overwrite=True "
                f"(CLI: --overwrite) or by deleting the folder (rm -r {self.parts})"
            )

    def record_outcomes(self, outcomes: Mapping[str, Any]) -> None:
        """Keep what a run's computation decided and saw (``run.json``'s ``outcomes``, rewritten whole), so
        that a resume that computes nothing -- its chunks all written -- still reports it."""
        run_file = self.parts / _RUN_FILE
        record = {"key": self.key, "spec": self.spec, "outcomes": json.loads(json.dumps(dict(outcomes), default=str))}
        write_text_atomically(json.dumps(record, default=str, indent=1), run_file)

    def recorded_outcomes(self) -> dict[str, Any]:
        """The outcomes an earlier call recorded (:meth:`record_outcomes`); ``{}`` when none was."""
        try:
            record = json.loads((self.parts / _RUN_FILE).read_text())
        except (OSError, ValueError):
            return {}
        outcomes = record.get("outcomes") if isinstance(record, dict) else None
        return outcomes if isinstance(outcomes, dict) else {}

    def _drop_unreadable_chunks(self) -> None:
        """Resume: delete the chunk files that fail their checksum or cannot be read (a truncated write, a
        disk fault, a flipped bit anywhere in the file), so that they are computed again, and say which;
        leftover temporary files go too."""
        for tmp in self.parts.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        for digest in self.parts.glob(f"chunk-*.parquet{_DIGEST}"):
            if not digest.with_name(digest.name[: -len(_DIGEST)]).exists():
                digest.unlink(missing_ok=True)  # its chunk was never renamed into place
        bad = []
        for path in sorted(self.parts.glob("chunk-*.parquet")):
            problem = verify_chunk(path)
            if problem is not None:
                bad.append((path, problem))
        for path, _ in bad:
            path.unlink(missing_ok=True)
            digest_path(path).unlink(missing_ok=True)
        if bad:
            names = ", ".join(p.name for p, _ in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            warnings.warn(
                f"resume: {len(bad)} chunk file(s) in {self.parts} could not be read ({bad[0][1]}): "
                f"{names}; computing them again",
                RuntimeWarning,
                stacklevel=4,
            )

    def release(self) -> None:
        """Give up the folder's lock (the run stops here; its files stay)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- chunks ---------------------------------------------------------------------
    def _chunk_path(self, index: int) -> Path:
        return chunk_file(self.parts, index)

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
        write_file_atomically(sha256_hex(data).encode(), digest_path(path))
        write_file_atomically(data, path)

    def read_chunk(self, index: int, columns: Sequence[str] | None = None) -> pa.Table:
        path = self._chunk_path(index)
        try:
            return pq.read_table(
                path, columns=None if columns is None else list(columns), page_checksum_verification=True
            )
        except (OSError, pa.ArrowException) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EIO):
                raise
            raise ValueError(
                f"{path} cannot be read ({first_line(exc)}): the chunk was damaged after it was "
                f"written; run again with --resume (resume=True) to compute it again"
            ) from exc

    def chunk_columns(self, index: int) -> list[str]:
        """The column names of finished chunk ``index`` (from its footer; no data read)."""
        return list(pq.read_schema(self._chunk_path(index)).names)

    def write_part(
        self,
        chunks: Sequence[int],
        path: str | os.PathLike,
        metadata: Mapping[str, Any],
        transform: Callable[[pa.Table], pa.Table] | None = None,
    ) -> int:
        """Concatenate the given finished chunks, in order, into ``path`` (one row group per
        chunk; ``metadata`` in the schema; page checksums); atomic, through a temporary file in
        the work folder. Returns the number of rows written. ``transform``, when given, maps
        each chunk's table before it is written (columns that need every chunk, added last).

        Reads one chunk at a time, so memory stays at one chunk whatever the run's size.
        """
        path = Path(path)
        chunks = list(chunks)
        missing = sorted(set(chunks) - self.done())
        if missing:
            raise RuntimeError(
                f"write_part: chunks {missing[:10]}{'...' if len(missing) > 10 else ''} are missing from {self.parts}"
            )
        if not chunks:
            raise RuntimeError("write_part: nothing to write (no chunks)")
        meta_blob = json.dumps(dict(metadata), default=str).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_file(path, self.parts)
        writer = None
        rows = 0
        try:
            for i in chunks:
                table = self.read_chunk(i)
                if transform is not None:
                    table = transform(table)
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

    def finalize(
        self, n_chunks: int, metadata: Mapping[str, Any], transform: Callable[[pa.Table], pa.Table] | None = None
    ) -> Path:
        """Concatenate chunks ``0..n_chunks-1`` into the output file and clean up.

        A manifest left at the same output by an earlier sharded run (only possible
        with ``overwrite``/``resume``) is removed with its parts: one output, one run.
        """
        missing = sorted(set(range(n_chunks)) - self.done())
        if missing:
            raise RuntimeError(
                f"finalize: chunks {missing[:10]}{'...' if len(missing) > 10 else ''} are missing from {self.parts}"
            )
        self.write_part(range(n_chunks), self.out, metadata, transform)
        remove_manifest(manifest_path(self.out))
        self.cleanup()
        return self.out

    def cleanup(self) -> None:
        """Remove the files normfast wrote in the work folder (after every part of the run has been
        written), then the lock, then the folder when nothing else is in it. Anything else (a file the
        user put there) is left, and named in one warning."""
        left = remove_work_files(self.parts)
        self.release()
        if left:
            warnings.warn(f"{self.parts}: left {describe_left(left)}; the folder stays", RuntimeWarning, stacklevel=3)

    def abandon(self) -> None:
        """The run failed in a way that its own resume would meet again: remove the work folder if this
        writer made it (everything in it is this run's, so nothing is left to block the next run), else
        leave it as it was (an earlier run's chunks, for its ``--resume``); the lock is released either way."""
        if self.created and self.lock is not None:
            self.cleanup()
        else:
            self.release()


def chunk_file(parts: str | os.PathLike, index: int) -> Path:
    """The file of finished chunk ``index`` in the work folder ``parts``."""
    return Path(parts) / f"chunk-{index:07d}.parquet"


def holds_unfinished_run(out: str | os.PathLike) -> bool:
    """Whether the work folder of the output ``out`` holds an unfinished run (its ``run.json``); a folder
    left holding only files normfast did not write does not."""
    out = Path(out)
    return (out.with_name(out.name + ".parts") / _RUN_FILE).exists()


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters taken literally."""
    import glob

    return glob.escape(name)


def _is_work_file(path: Path) -> bool:
    """Whether an entry of a work folder is a file normfast writes there (a folder never is)."""
    name = path.name
    return (path.is_symlink() or not path.is_dir()) and (
        name in (_RUN_FILE, _LOCK_FILE)
        or re.fullmatch(r"(chunk-\d+\.parquet(\.sha256)?|outer-\d+\.pt)", name) is not None
        or (name.startswith(".") and name.endswith(".tmp"))
    )


def remove_work_files(folder: Path) -> list[str]:
    """Delete the files normfast writes in a work folder (the lock file last) and then the folder
    when it is empty; returns the names of the entries left (sorted): those normfast did not write."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    left = [p.name for p in sorted(folder.iterdir()) if not _is_work_file(p)]
    for p in sorted(folder.iterdir(), key=lambda p: p.name == _LOCK_FILE):
        if p.name not in left:
            with contextlib.suppress(OSError):  # as the removal of a finished run's folder always was
                p.unlink()
    if not left:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return left


def describe_left(names: Sequence[str]) -> str:
    """``notes.txt, plots (2 files normfast did not write)``: the entries a removal left, for a warning."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"{shown} ({len(names)} file{'s' if len(names) != 1 else ''} normfast did not write)"


def verify_chunk(path: str | os.PathLike) -> str | None:
    """Why a chunk file cannot be used (None when it can): its bytes against the SHA-256 written
    beside it, or, without one, a full read with the page checksums verified."""
    path = Path(path)
    try:
        data = path.read_bytes()
        digest = digest_path(path)
        if digest.exists():
            if sha256_hex(data) != digest.read_text().strip():
                return f"its bytes do not match the SHA-256 written beside it, {digest.name}"
            return None
        pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (OSError, pa.ArrowException) as exc:
        return first_line(exc)
    return None
