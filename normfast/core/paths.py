"""Path rules shared by every command and file format: where a named file may be, and what an
output may not replace.

* :func:`inside_folder` -- a path that a file names (a manifest's parts, a
  sentence-transformers module folder, a BEIR split) is resolved against the
  folder of the file that names it and must stay inside that folder, symbolic
  links followed; otherwise it is refused. A planted ``../victim.txt`` is then
  neither read nor deleted.
* :func:`check_outputs` -- before any compute, every output a command is about
  to write is checked against its inputs: an output that is one of the inputs
  (the same file, however it is spelled: relative, absolute, through a link or
  a hard link), a file output that is an existing folder, and a folder output
  that is an existing file are refused with the flag named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

PathLike = str | os.PathLike


def _real(path: PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def is_inside(folder: PathLike, path: PathLike) -> bool:
    """Whether ``path`` (links followed) lies inside ``folder`` (links followed)."""
    root, target = _real(folder), _real(path)
    return target == root or root in target.parents


def inside_folder(folder: PathLike, name: str, what: str) -> Path:
    """``folder / name``, refused unless it stays inside ``folder``.

    ``name`` must be a relative path (``part.parquet``, ``sub/part.parquet``) that
    does not climb out of ``folder`` -- lexically (no ``..`` past the top) and after
    following symbolic links. ``what`` names the file that holds ``name``, for the
    error (``"the manifest runs/x.manifest.json"``). Raises ``ValueError``.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{what} names the path {name!r}; expected a file name relative to {folder}")
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise ValueError(
            f"{what} names {name!r}, outside its folder {folder}; refused (a file may only "
            f"name files inside its own folder)"
        )
    path = Path(folder) / name
    if not is_inside(folder, path):
        raise ValueError(
            f"{what} names {name!r}, which leads outside its folder {folder} (through a symbolic link); refused"
        )
    return path


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether two paths name one file (the same path once resolved, or the same inode)."""
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(
    *,
    inputs: Iterable[PathLike | None] = (),
    files: Mapping[str, PathLike | None] | None = None,
    folders: Mapping[str, PathLike | None] | None = None,
    owned: Iterable[PathLike] = (),
) -> None:
    """Refuse, before any compute, outputs that would replace an input or that have the wrong kind.

    Args:
        inputs: the files the command reads (None entries are skipped).
        files: ``{flag or label: path}`` of the files the command writes; an existing
            folder there is refused, and so is a path that is one of ``inputs``.
        folders: ``{flag: path}`` of the folders the command writes into; an existing
            file there is refused.
        owned: folders the command creates and later deletes (a run's work folder):
            an input inside one is refused.

    Raises ``ValueError`` naming the flag, the path and the input (the caller adds the command).
    """
    inputs = [Path(p) for p in inputs if p is not None]
    for flag, path in (files or {}).items():
        if path is None:
            continue
        if os.path.isdir(path):
            raise ValueError(
                f"{flag} {path} is a folder; give the path of a file to write (for instance a name inside that folder)"
            )
        for source in inputs:
            if same_file(path, source):
                raise ValueError(
                    f"{flag} {path} is also an input ({source}); writing it would "
                    f"replace what is being read. Choose another output path"
                )
    for flag, path in (folders or {}).items():
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a file; expected a folder to write into")
    for folder in owned:
        for source in inputs:
            if is_inside(folder, source):
                raise ValueError(
                    f"the input {source} lies inside {folder}, a work folder this "
                    f"command deletes when it finishes; move the input elsewhere"
                )
