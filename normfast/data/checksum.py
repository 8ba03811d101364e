"""SHA-256 of the bytes normfast writes, and reading them back verified.

One machinery for every file whose content must come back as written: a run's chunks carry their
digest in a ``.sha256`` file beside them (:mod:`normfast.data.runwriter`), saved directions in
their manifest (:mod:`normfast.engine.runner.artifact`). A file is read whole into memory once,
checked, and the same bytes are then parsed: what is checked is what is used.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

#: the suffix of the file that holds the SHA-256 of the file it is named after
DIGEST_SUFFIX = ".sha256"


def sha256_hex(data: Any) -> str:
    """The SHA-256 of ``data`` (bytes or a buffer such as a pyarrow ``Buffer``), as 64 hex digits."""
    return hashlib.sha256(memoryview(data)).hexdigest()


def digest_path(path: str | os.PathLike) -> Path:
    """``chunk-0000003.parquet`` -> ``chunk-0000003.parquet.sha256``."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def read_checked(path: str | os.PathLike, sha256: str, size: int | None = None) -> tuple[bytes | None, str | None]:
    """``(the bytes of path, None)`` when they are a regular file of ``size`` bytes (when given) whose
    SHA-256 is ``sha256``; else ``(None, why not)``, in words. Never reads more than ``size`` bytes
    plus one, so a link to a device (``/dev/zero``) or a file grown huge is refused, not read."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            link = " (a symbolic link to one that is not)" if path.is_symlink() else ""
            return None, f"it is not a regular file{link}"
        if size is not None and st.st_size != size:
            return None, f"it holds {st.st_size:,} bytes, its manifest records {size:,}"
        with open(path, "rb") as fh:
            data = fh.read() if size is None else fh.read(size + 1)
    except FileNotFoundError:
        return None, "it does not exist"
    except OSError as exc:
        return None, exc.strerror or type(exc).__name__
    if size is not None and len(data) != size:
        return None, f"it holds {len(data):,} bytes, its manifest records {size:,}"
    if sha256_hex(data) != sha256:
        return None, "its bytes do not match the SHA-256 recorded when it was written"
    return data, None
