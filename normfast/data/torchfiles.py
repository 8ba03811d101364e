"""State files that are read back with ``torch.load(weights_only=True)``: nothing in them can run.

A file that normfast reads from a run or state folder (a resume state, a probed checkpoint's
result, the directions-outer state of a chunk) could have been planted there; a full unpickler
would execute whatever the file names. ``weights_only=True`` admits only tensors, dicts, lists,
tuples, numbers, strings and None, so what normfast writes is first turned into those
(:func:`to_plain`): a numeric numpy array becomes a tensor, another array its elements, a numpy
scalar a 0-d tensor, each tagged so that :func:`from_plain` restores it exactly (dtype and
shape). Anything else is refused when the file is written, not when it is
read. :func:`save_plain` and :func:`load_plain` do both; a file that does not load this way is a
``ValueError`` naming it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normfast.data.atomic import write_file_atomically

__all__ = ["from_plain", "load_plain", "save_plain", "to_plain"]

_ARRAY, _OBJECTS, _SCALAR = "__numpy__", "__list__", "__numpy_scalar__"


def to_plain(obj: Any) -> Any:
    """``obj`` as what ``torch.load(weights_only=True)`` reads; :func:`from_plain` undoes it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "biufc":
            data = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)  # (which makes 0-d 1-d)
            try:
                return {_ARRAY: torch.from_numpy(data if data.flags.writeable else data.copy())}
            except TypeError:  # a dtype torch lacks (unsigned 64-bit, big-endian): element by element
                pass
        return {_OBJECTS: obj.ravel().tolist(), "shape": list(obj.shape), "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return {_SCALAR: to_plain(np.asarray(obj))}
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return obj
    raise TypeError(
        f"to_plain: cannot store a {type(obj).__name__} in a state file read with "
        f"weights_only=True (tensors, numpy arrays and scalars, dicts, lists, tuples, numbers, "
        f"strings and None only)"
    )


def from_plain(obj: Any) -> Any:
    """The object :func:`to_plain` was given (numpy arrays and scalars restored)."""
    if isinstance(obj, dict):
        if set(obj) == {_ARRAY}:
            return obj[_ARRAY].numpy()
        if set(obj) == {_SCALAR}:
            return from_plain(obj[_SCALAR])[()]
        if set(obj) == {_OBJECTS}:  # the directions-outer state of normfast 0.x: a 1-d object array
            out = np.empty(len(obj[_OBJECTS]), dtype=object)
            out[:] = obj[_OBJECTS]
            return out
        if set(obj) == {_OBJECTS, "shape", "dtype"}:
            dtype = np.dtype(obj["dtype"])
            out = np.empty(len(obj[_OBJECTS]), dtype=dtype)
            out[:] = obj[_OBJECTS]
            return out.reshape(obj["shape"])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj


def save_plain(obj: Any, path: str | os.PathLike, tmp_dir: str | os.PathLike | None = None) -> None:
    """``obj`` (see :func:`to_plain`) into ``path`` with ``torch.save``, atomically."""
    buf = io.BytesIO()
    torch.save(to_plain(obj), buf)
    write_file_atomically(buf.getbuffer(), Path(path), None if tmp_dir is None else Path(tmp_dir))


def load_plain(path: str | os.PathLike, what: str = "state file") -> Any:
    """What :func:`save_plain` wrote to ``path``, read with ``weights_only=True``.

    A file that holds anything else (a pickle naming a function to call, a damaged file) is
    refused with a ``ValueError`` naming ``what`` and the file; nothing in it runs.
    """
    try:
        return from_plain(torch.load(path, map_location="cpu", weights_only=True))
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{what} {path} cannot be read safely ({_why(exc)}): it was not written by normfast, "
            f"or it is damaged; nothing in it was run. Delete it to start that part afresh"
        ) from None


def _why(exc: BaseException) -> str:
    """What the weights-only unpickler refused (``Unsupported global: GLOBAL io.open``), without torch's
    advice to load the file with ``weights_only=False``; else the error's first line."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        rest = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        if rest:
            return rest[0].split(" was not an allowed global")[0][:200]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else type(exc).__name__
