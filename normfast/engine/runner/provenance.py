"""The identity of a probe run: content hashes of its inputs, weights and tokenizer, and the environment
it ran in.

``hash_items``, ``hash_model`` and ``hash_tokenizer`` feed the run's spec fingerprint (resume
refuses a run whose inputs, weights or tokenizer changed, naming them); ``library_versions`` and
``device_name`` go into the metadata of every run (:func:`run_metadata`) and every experiment's JSON.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import re
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch

from normfast import __version__
from normfast.encoders.base import callable_name


def iter_items(items: Sequence[Any]):
    if isinstance(items, (list, tuple, torch.Tensor, np.ndarray)):
        yield from items
        return
    for lo in range(0, len(items), 4096):  # on-demand sequences: by slices, as the engine reads them
        yield from items[lo : lo + 4096]


def _hash_feed(h: Any, it: Any) -> None:
    if isinstance(it, torch.Tensor):
        h.update(repr((tuple(it.shape), str(it.dtype))).encode())
        h.update(tensor_bytes(it))
    elif isinstance(it, np.ndarray):
        h.update(repr((it.shape, str(it.dtype))).encode())
        h.update(np.ascontiguousarray(it).tobytes())
    elif _is_image(it):  # PIL: by its pixels (its repr names a memory address)
        h.update(repr((it.mode, tuple(it.size))).encode())
        h.update(it.tobytes())
    elif isinstance(it, (list, tuple)) and any(_by_content(x) for x in it):
        h.update(b"[")  # containers of arrays or images: by content (a repr abbreviates large arrays)
        for x in it:
            _hash_feed(h, x)
        h.update(b"]")
    else:
        h.update(repr(it).encode())
    h.update(b"\x00")


def _by_content(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, list, tuple)) or _is_image(x)


def hash_pairs(pairs: Any, indices: Sequence[int] | None = None, slice_size: int = 256) -> str:
    """Content hash of the pairs at ``indices`` of a pair source (``len`` and ``batch(indices)``; None:
    every pair), with the indices, read a slice at a time (memory holds one slice).

    A run passes the pairs its virtual batches draw: its rows depend on those and on nothing else of the
    source (the draw itself is set by the source's size and the run's settings, both in its key), so a
    huge on-demand source is not read whole for its key.
    """
    h = hashlib.sha256()
    order = np.arange(len(pairs)) if indices is None else np.unique(np.asarray(indices, dtype=np.int64))
    h.update(order.tobytes())
    for lo in range(0, len(order), slice_size):
        _hash_feed(h, pairs.batch(order[lo : lo + slice_size]))
    return h.hexdigest()[:16]


def _is_image(it: Any) -> bool:
    return all(hasattr(it, a) for a in ("mode", "size", "tobytes", "getbands"))


def tensor_bytes(t: torch.Tensor) -> Any:
    """Every byte of ``t``'s values, in row-major order, as a buffer (any dtype, device or layout)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def hash_items(items: Sequence[Any]) -> str:
    if callable(getattr(items, "fingerprint", None)):  # e.g. corpus windows: hashed from their arrays
        return str(items.fingerprint())
    h = hashlib.sha256()
    for it in iter_items(items):
        _hash_feed(h, it)
    return h.hexdigest()[:16]


def hash_model(module: torch.nn.Module) -> str:
    """Content hash of every parameter and buffer of ``module``: each one's name, shape, dtype and every
    byte of its values, in the order of the names (SHA-256, 16 hex digits).

    Any change to any value is seen (two rows of an embedding table swapped, one value moved by an
    ulp), and the same values give the same hash in any process and on any device. Cost: one pass over
    the weights' bytes (all-MiniLM-L6-v2's 91 MB in about 0.1 s on one CPU core).
    """
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    h = hashlib.sha256()
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if t.is_meta:
                raise ValueError(f"hash_model: {name} is on the meta device (no values to hash)")
            h.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
            h.update(tensor_bytes(t))
            h.update(b"\x00")
    return h.hexdigest()[:16]


#: tokenizer_config.json keys that say where a tokenizer was loaded from, not what it does
_WHERE_LOADED = ("name_or_path", "is_local", "local_files_only", "_commit_hash", "cache_dir", "token")
#: tokenizer.json keys that hold the state of the last call (set by every call with truncation or padding)
_CALL_STATE = ("truncation", "padding")


def hash_tokenizer(tokenizer: Any) -> str | None:
    """Content hash of a tokenizer's whole state (16 hex digits; None for no tokenizer).

    A ``transformers`` tokenizer is hashed through the files ``save_pretrained`` writes (its
    vocabulary, merges, normalizer -- lowercasing, accents -- pre-tokenizer, special tokens and
    configuration), less what says where it was loaded from and the truncation and padding of its
    last call; any other tokenizer (open_clip's) by its attributes (functions by their qualified
    names), less any attribute named ``cache``.
    """
    if tokenizer is None:
        return None
    h = hashlib.sha256()
    h.update(f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}".encode())
    if callable(getattr(tokenizer, "save_pretrained", None)):
        with tempfile.TemporaryDirectory(prefix="normfast-tokenizer-") as folder:
            tokenizer.save_pretrained(folder)
            for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
                h.update(path.relative_to(folder).as_posix().encode() + b"\x00")
                h.update(_tokenizer_file(path))
    else:
        h.update(json.dumps(_plain_state(vars(tokenizer), 0), sort_keys=True).encode())
    return h.hexdigest()[:16]


def _tokenizer_file(path: Path) -> bytes:
    drop = {"tokenizer_config.json": _WHERE_LOADED, "tokenizer.json": _CALL_STATE}.get(path.name)
    data = path.read_bytes()
    if drop is None:
        return data
    try:
        content = json.loads(data)
    except ValueError:
        return data
    for key in drop:
        content.pop(key, None)
    return json.dumps(content, sort_keys=True).encode()


def _plain_state(value: Any, depth: int) -> Any:
    """``value`` as plain JSON data that is the same in every process (no memory addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict) and _is_table(value):  # a vocabulary or merge ranks, in their order: fast
        return ["table", hashlib.sha256(repr(list(value.items())).encode()).hexdigest()]
    if isinstance(value, dict):
        items = [(json.dumps(_plain_state(k, depth + 1)), _plain_state(v, depth + 1)) for k, v in value.items()]
        return [["dict"], *sorted(([k, v] for k, v in items if k != '"cache"'), key=lambda kv: kv[0])]
    if isinstance(value, (list, tuple)):
        return [_plain_state(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(_plain_state(v, depth + 1)) for v in value)
    if isinstance(value, re.Pattern):
        return ["re", value.pattern, value.flags]
    if isinstance(value, (torch.Tensor, np.ndarray)):
        h = hashlib.sha256()
        _hash_feed(h, value)
        return ["array", h.hexdigest()]
    if callable(getattr(value, "save_pretrained", None)):  # e.g. the transformers tokenizer inside open_clip's
        return ["tokenizer", hash_tokenizer(value)]
    if isinstance(value, (type, functools.partial)) or hasattr(value, "__code__") or not hasattr(value, "__dict__"):
        return ["callable" if callable(value) else "object", callable_name(value)]
    if hasattr(value, "__dict__") and depth < 4:
        return [type(value).__qualname__, _plain_state(vars(value), depth + 1)]
    return [type(value).__qualname__]


_SIMPLE = {type(None), bool, int, float, str, bytes}


def _is_table(d: dict) -> bool:
    """Keys and values all numbers or strings (keys may be tuples of strings): their reprs say it all."""
    keys = set(map(type, d))
    if not set(map(type, d.values())) <= _SIMPLE or not keys <= _SIMPLE | {tuple}:
        return False
    return tuple not in keys or all(set(map(type, k)) <= _SIMPLE for k in d if type(k) is tuple)


def encoder_tokenizer(encoder: Any) -> Any:
    """The tokenizer an encoder prepares its text with (a cached-front encoder's: its base's), or None."""
    tokenizer = getattr(encoder, "tokenizer", None)
    base = getattr(encoder, "base", None)
    if tokenizer is None and isinstance(base, torch.nn.Module):
        tokenizer = getattr(base, "tokenizer", None)
    return tokenizer


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


def run_metadata(
    prober: Any, run: Any, probes: Sequence[Any], ids: Sequence[str] | None, ident: dict, pairs_hash: str
) -> dict[str, Any]:
    """A call's metadata (:class:`~normfast.engine.prober.Prober`): the schema version, the model and its
    fingerprints, the objective, the settings, the run's resolved plan, the inputs' fingerprints
    (``pairs_hash``: the pair source's), the library versions and the device."""
    from dataclasses import asdict

    from normfast.data.schema import SCHEMA_VERSION
    from normfast.engine.directions.objectives import objective_settings

    config = prober.config
    second = prober.second_moments
    inputs = {  # what the rows depend on besides the settings; named when a resume is refused
        "probes": hash_items(probes),
        "pairs": pairs_hash,
        "ids": hash_items(ids) if ids is not None else None,
        "second_moments": hash_items(sorted(second.items())) if second else None,
    }
    metadata = {
        "schema_version": SCHEMA_VERSION,
        "model": prober.model_name,
        "model_fingerprint": ident["model_fingerprint"],
        "tokenizer_fingerprint": ident["tokenizer_fingerprint"],
        "encoder_settings": ident["encoder_settings"],
        "pair_encoder": ident["pair_encoder"],
        "encoder_note": getattr(prober.encoder, "note", None),
        "objective": prober.objective.name,
        "temperature": getattr(prober.objective, "temperature", None),
        "objective_settings": objective_settings(prober.objective),
        "optimizer": config.optimizer,
        "lr": config.lr,
        "weight_decay": config.weight_decay,
        "momentum": config.momentum,
        "M": config.batches,
        "M_D": config.drift_batches if config.drift_from_mean else None,
        "M_initial": config.batches,
        "groups": run.groups if config.uncertainty or config.drift_from_mean else None,
        "uncertainty": config.uncertainty,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "mode": run.mode,
        "output": config.output,
        "params": config.params,
        "n_probed_parameters": len(run.names),
        "cut_stage": run.cut,
        "branch": run.branch,
        "n_items": len(probes),
        "n_pairs": len(prober.pairs),
        "chunk_size": config.chunk_size,
        "max_length": getattr(prober.encoder, "max_length", None),
        "versions": library_versions(),
        "device": device_name(run.device),
        "config": asdict(config),
        "input_fingerprints": inputs,
    }
    if callable(getattr(probes, "describe", None)):  # e.g. corpus windows: documents, windows, stride
        metadata["corpus"] = probes.describe()
    return metadata
