"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (:func:`load_fashion_mnist`), read from
its IDX files (:func:`read_idx`)."""

from __future__ import annotations

import gzip
import os
import struct
import threading
from pathlib import Path

import numpy as np

from normfast.data.system import FASHION_APT, FASHION_FILES, FASHION_MNIST_DIR

__all__ = ["FASHION_MNIST_CLASSES", "load_fashion_mnist", "read_idx"]

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_IDX_TYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike, *, ndim: int | None = None) -> np.ndarray:
    """Parse an IDX file (the MNIST format), gzipped or not, validating header and size.

    Header: two zero bytes, a type code (0x08 = unsigned byte, ...), the number
    of dimensions, then one big-endian uint32 per dimension.
    """
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"read_idx: {p} is not an IDX file (magic bytes {raw[:4].hex() or 'none'})")
    dims = raw[3]
    if ndim is not None and dims != ndim:
        raise ValueError(f"read_idx: expected a {ndim}-D IDX file, {p} declares {dims} dimensions")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise ValueError(f"read_idx: {p} is truncated inside its header")
    shape = struct.unpack(f">{dims}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"read_idx: {p} declares shape {shape} ({expected} payload bytes) but holds {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # a writable copy in native byte order


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike = FASHION_MNIST_DIR
) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 28, 28], labels int64 [N])`` of Fashion-MNIST (N = 60000 / 10000).

    Class names are in :data:`FASHION_MNIST_CLASSES`. The arrays are read once per
    process and folder and returned read-only (copy them to modify).
    """
    if split not in FASHION_FILES:
        raise ValueError(f"load_fashion_mnist: split must be 'train' or 'test', got {split!r}")
    folder = Path(root)
    key = (split, str(folder.resolve()))
    with _FASHION_LOCK:
        if key not in _FASHION_CACHE:
            _FASHION_CACHE[key] = _read_fashion_mnist(split, folder)
        return _FASHION_CACHE[key]


_FASHION_CACHE: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
_FASHION_LOCK = threading.Lock()


def _read_fashion_mnist(split: str, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    img_name, lab_name, n = FASHION_FILES[split]
    for name in (img_name, lab_name):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"load_fashion_mnist: {folder / name} is missing; install with: {FASHION_APT}")
    images = read_idx(folder / img_name, ndim=3)
    labels = read_idx(folder / lab_name, ndim=1).astype(np.int64)
    if images.shape != (n, 28, 28) or labels.shape != (n,):
        raise ValueError(
            f"load_fashion_mnist: expected {n} images of 28x28 and {n} labels for "
            f"split={split!r}, got images.shape={images.shape}, "
            f"labels.shape={labels.shape}"
        )
    if labels.min() < 0 or labels.max() >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"load_fashion_mnist: labels outside 0..9 in {folder / lab_name}")
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels
