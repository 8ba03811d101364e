"""The identity of a probe run: content hashes of its inputs and model, and the environment it ran in.

``hash_items`` and ``hash_model`` feed the run's spec fingerprint (resume refuses a
run whose inputs changed, naming them); ``library_versions`` and ``device_name``
go into the metadata of every run and every experiment's JSON.
"""

from __future__ import annotations

import hashlib
import platform
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch

from normfast import __version__


def iter_items(items: Sequence[Any]):
    if isinstance(items, (list, tuple, torch.Tensor, np.ndarray)):
        yield from items
        return
    for lo in range(0, len(items), 4096):  # on-demand sequences: by slices, as the engine reads them
        yield from items[lo : lo + 4096]


def _hash_feed(h: Any, it: Any) -> None:
    if isinstance(it, torch.Tensor):
        h.update(repr((tuple(it.shape), str(it.dtype))).encode())
        h.update(it.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(it, np.ndarray):
        h.update(repr((it.shape, str(it.dtype))).encode())
        h.update(np.ascontiguousarray(it).tobytes())
    elif isinstance(it, (list, tuple)) and any(isinstance(x, (torch.Tensor, np.ndarray, list, tuple)) for x in it):
        h.update(b"[")  # containers of arrays: by content (a repr abbreviates large arrays)
        for x in it:
            _hash_feed(h, x)
        h.update(b"]")
    else:
        h.update(repr(it).encode())
    h.update(b"\x00")


def hash_items(items: Sequence[Any]) -> str:
    if callable(getattr(items, "fingerprint", None)):  # e.g. corpus windows: hashed from their arrays
        return str(items.fingerprint())
    h = hashlib.sha256()
    for it in iter_items(items):
        _hash_feed(h, it)
    return h.hexdigest()[:16]


def hash_model(encoder: torch.nn.Module) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for n, p in encoder.named_parameters():
            h.update(n.encode())
            h.update(repr(tuple(p.shape)).encode())
            flat = p.detach().reshape(-1)
            h.update(repr(float(flat.double().sum())).encode())
            h.update(repr(float(flat[:: max(1, flat.numel() // 97)].double().square().sum())).encode())
    return h.hexdigest()[:16]


def library_versions(extra: Sequence[str] = ()) -> dict[str, str]:
    """normfast's, Python's and the main libraries' versions; ``extra``: more distributions to name
    (those not installed are left out)."""
    import importlib.metadata as md

    out = {
        "normfast": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "python": platform.python_version(),
    }
    for pkg in ("transformers", "open_clip_torch", "triton", *extra):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
