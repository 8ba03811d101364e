"""Argument validation shared by every public entry point.

Errors name the function, the argument, what was expected and what arrived,
e.g. ``head_stats: expected A to be 2-D [N, d_in], got A.shape=(3, 4, 5)``.
Validation happens before anything is allocated.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def describe(name: str, x: Any) -> str:
    """One-line description of an array argument for error messages."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    device = getattr(x, "device", None)
    parts = [f"{name}.shape={tuple(shape)}" if shape is not None else f"type({name})={type(x).__name__}"]
    if dtype is not None:
        parts.append(f"dtype={dtype}")
    if device is not None:
        parts.append(f"device={device}")
    return ", ".join(parts)


def as_tensor(fn: str, name: str, x: Any) -> torch.Tensor:
    """Accept a torch tensor, a numpy array or any DLPack-capable array (CuPy, JAX, ...).

    numpy and DLPack inputs share memory with the returned tensor (no copy). A tensor
    that requires grad is detached (a view, no copy): the backend computes statistics,
    which are not differentiated, and its in-place kernels would refuse such a tensor.
    """
    if isinstance(x, torch.Tensor):
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "fiub":
            raise TypeError(f"{fn}: expected {name} to be a numeric array, got {describe(name, x)}")
        return torch.from_numpy(np.ascontiguousarray(x) if not x.flags.writeable else x)
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise TypeError(f"{fn}: could not import {name} through DLPack ({exc})") from exc
    raise TypeError(
        f"{fn}: expected {name} to be a torch.Tensor, numpy array or DLPack-capable array, got {type(x).__name__}"
    )


def check_float(fn: str, name: str, x: torch.Tensor, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{fn}: expected {name} to have a floating dtype ({allowed}), got {describe(name, x)}")


def check_ndim(fn: str, name: str, x: torch.Tensor, ndims: int | Iterable[int], layout: str) -> None:
    allowed = (ndims,) if isinstance(ndims, int) else tuple(ndims)
    if x.dim() not in allowed:
        raise ValueError(f"{fn}: expected {name} to be {layout}, got {describe(name, x)}")


def check_same_device(fn: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{fn}: expected all inputs on one device, got {listing}")


def check_positive_int(fn: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{fn}: expected {name} to be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_finite_scalar(
    fn: str, name: str, value: Any, *, minimum: float | None = None, strictly: bool = False
) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: expected {name} to be a real number, got {value!r}") from None
    if not np.isfinite(v):
        raise ValueError(f"{fn}: expected {name} to be finite, got {value!r}")
    if minimum is not None and (v < minimum or (strictly and v == minimum)):
        op = ">" if strictly else ">="
        raise ValueError(f"{fn}: expected {name} {op} {minimum}, got {value!r}")
    return v


def check_choice(fn: str, name: str, value: Any, allowed: Sequence[Any]) -> Any:
    if value not in allowed:
        raise ValueError(f"{fn}: expected {name} to be one of {tuple(allowed)}, got {name}={value!r}")
    return value


def check_groups(fn: str, groups: Any) -> int:
    """K, the batch groups behind every error bar: an integer >= 2."""
    return check_positive_int(fn, "groups (K, the batch groups of the error bars)", groups, minimum=2)


def float_tensor(fn: str, name: str, x: Any, ndims: int | Iterable[int], layout: str) -> torch.Tensor:
    """``x`` as a tensor (:func:`as_tensor`) of a floating dtype with ``ndims`` dimensions."""
    t = as_tensor(fn, name, x)
    check_float(fn, name, t)
    check_ndim(fn, name, t, ndims, layout)
    return t


def counts_tensor(fn: str, name: str, counts: Any, k: int, *, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Batch counts of K groups (a list, a tuple or an array) as a ``[K]`` tensor, each count positive."""
    if isinstance(counts, (list, tuple)):
        t = torch.tensor([float(c) for c in counts])
    else:
        t = as_tensor(fn, name, counts)
    t = t.to(dtype=dtype, device=device)
    if tuple(t.shape) != (k,) or not bool((t > 0).all()):
        raise ValueError(
            f"{fn}: expected {name} of shape [K]=({k},) with positive batch counts, "
            f"got {describe(name, t)} = {t.tolist()}"
        )
    return t


def compute_dtype(fn: str, dtype: torch.dtype | None, *tensors: torch.Tensor | None) -> torch.dtype:
    """The precision to compute in: ``dtype`` (float32 or float64), else float64 when any input is float64."""
    if dtype is None:
        wide = any(x.dtype == torch.float64 for x in tensors if x is not None)
        return torch.float64 if wide else torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{fn}: expected dtype None, torch.float32 or torch.float64, got dtype={dtype}")
    return dtype


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def available_devices() -> list[str]:
    """The devices torch can compute on in this process: ``cpu``, then every CUDA device, then ``mps``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def check_device(label: str, device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that this process can compute on, or one ``ValueError``.

    ``label`` says where the device came from (``"--device"``, ``"load_encoder: device"``); the
    error names the device and the devices that are available. Checked before anything is loaded:
    a missing GPU would otherwise surface as a driver error deep in the first transfer.
    """
    available = available_devices()

    def refuse(problem: str) -> ValueError:
        return ValueError(f"{label} {device}: {problem}; available here: {', '.join(available)}")

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise refuse("not a device name (cpu, cuda, cuda:N, mps)") from None
    kind = parsed.type
    if kind == "cpu":
        return parsed
    if kind == "meta":
        raise refuse("the meta device holds shapes without values, and normfast computes values")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise refuse("no CUDA GPU is visible to torch in this process (torch.cuda.is_available() is False)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise refuse(f"there are {torch.cuda.device_count()} CUDA devices, numbered from 0")
        return parsed
    backend = getattr(torch, kind, None) if kind != "mps" else getattr(torch.backends, "mps", None)
    is_available = getattr(backend, "is_available", None)
    if not (callable(is_available) and is_available()):
        raise refuse(f"torch has no {kind} device in this process")
    return parsed


def check_finite_weights(fn: str, module: torch.nn.Module, label: str = "the model") -> None:
    """Refuse a model with a NaN or infinite parameter (one ``ValueError`` naming it).

    One such value makes every embedding that passes through it, and so every statistic of a
    probe, NaN; said before anything is computed or written. A parameter on the meta device (a
    shape without values) is refused the same way. Buffers are not weights and may hold
    infinities on purpose (an additive attention mask of ``-inf``).
    """
    bad: list[tuple[str, torch.Tensor]] = []
    for name, t in module.named_parameters():
        if t.device.type == "meta":
            raise ValueError(
                f"{fn}: {label}'s parameter {name} is on the meta device (a shape without values); load "
                f"the model with its weights, on a real device"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append((name, t.detach().reshape(-1)))
    if not bad:
        return
    name, flat = bad[0]
    count = int((~torch.isfinite(flat)).sum())
    tests = (("nan", torch.isnan), ("inf", torch.isposinf), ("-inf", torch.isneginf))
    values = ", ".join(word for word, test in tests if bool(test(flat).any()))
    more = ""
    if len(bad) > 1:
        others = [n for n, _ in bad[1:]]
        more = f"; so do {len(others)} more ({', '.join(others[:3])}{' ...' if len(others) > 3 else ''})"
    raise ValueError(
        f"{fn}: {label}'s parameter {name} holds {count} non-finite value{'s' if count != 1 else ''} "
        f"({values}) of {flat.numel()}{more}; every embedding through it, and so every statistic, would "
        f"be NaN. The weights are damaged, or the training that made them diverged: load them again "
        f"from their source, or from a checkpoint saved before the divergence"
    )
