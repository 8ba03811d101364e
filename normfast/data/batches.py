"""Virtual batches: the index sets a run draws from its pair source (:func:`virtual_batches`), and
the check of index sets a user gives (:func:`check_batch_indices`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from normfast.core.checks import check_positive_int

__all__ = ["check_batch_indices", "check_in_source", "virtual_batches"]


def check_batch_indices(
    fn: str,
    name: str,
    batches: Any,
    *,
    n: int | None = None,
    M: int | None = None,
    batch_size: int | None = None,
    M_name: str = "batches",
) -> list[list[int]]:
    """Validate explicit virtual batches; returns them as lists of Python ints.

    ``batches`` is a sequence of batches (lists, tuples, 1-D arrays or tensors, or
    one 2-D array), each a set of distinct integer indices into the pair source.
    Checked: at least two batches, ``M`` of them when ``M`` is given; every batch
    ``batch_size`` long when given (at least two indices in any case); indices are
    integers, distinct within a batch, and lie in ``[0, n)`` when ``n`` is given.
    Errors name ``fn``, ``name``, the offending batch and what was expected.
    """
    if isinstance(batches, (str, bytes)) or not hasattr(batches, "__len__"):
        raise TypeError(
            f"{fn}: expected {name} to be a sequence of batches (each a sequence of "
            f"integer indices), got {type(batches).__name__}"
        )
    if len(batches) < 2:
        raise ValueError(f"{fn}: expected {name} to hold at least 2 batches (a variance needs two), got {len(batches)}")
    if M is not None and len(batches) != M:
        raise ValueError(
            f"{fn}: {name} holds {len(batches)} batches but {M_name}={M}; pass "
            f"{M_name}={len(batches)} (M is the number of virtual batches)"
        )
    out = []
    for b, batch in enumerate(batches):
        idx = np.asarray(batch.detach().cpu() if isinstance(batch, torch.Tensor) else batch)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu") or idx.dtype == bool:
            raise TypeError(
                f"{fn}: expected {name}[{b}] to be a 1-D sequence of integer indices, got "
                f"shape={idx.shape}, dtype={idx.dtype}"
            )
        if batch_size is not None and idx.size != batch_size:
            raise ValueError(
                f"{fn}: {name}[{b}] has {idx.size} indices but batch_size={batch_size}; "
                f"every virtual batch must hold batch_size indices"
            )
        if idx.size < 2:
            raise ValueError(f"{fn}: {name}[{b}] has {idx.size} indices; a contrastive batch needs at least 2")
        if n is not None:
            _check_range(fn, name, b, idx, n)
        if np.unique(idx).size != idx.size:
            dup = int(next(v for v, c in zip(*np.unique(idx, return_counts=True)) if c > 1))
            raise ValueError(f"{fn}: {name}[{b}] repeats index {dup}; the indices of one batch must be distinct")
        out.append([int(i) for i in idx])
    return out


def check_in_source(fn: str, name: str, batches: Any, n: int) -> None:
    """Refuse batches (already checked by :func:`check_batch_indices`) with an index outside a pair
    source of ``n`` elements: an ``IndexError`` naming the batch."""
    for b, idx in enumerate(batches):
        _check_range(fn, name, b, np.asarray(idx), n)


def _check_range(fn: str, name: str, b: int, idx: np.ndarray, n: int) -> None:
    if idx.min() < 0 or idx.max() >= n:
        raise IndexError(
            f"{fn}: {name}[{b}] has indices outside [0, {n}) (the pair source holds {n}): "
            f"min={idx.min()}, max={idx.max()}"
        )


def virtual_batches(n: int, M: int, batch_size: int, seed: int = 0) -> list[np.ndarray]:
    """``M`` index arrays of ``batch_size`` distinct indices in ``[0, n)``.

    Batches are drawn independently (an index may appear in several batches,
    never twice in one), from ``numpy.random.default_rng(seed)``: the same
    arguments always give the same batches.
    """
    fn = "virtual_batches"
    n = check_positive_int(fn, "n (the number of pairs/items in the source)", n)
    M = check_positive_int(fn, "M", M, minimum=2)
    batch_size = check_positive_int(fn, "batch_size", batch_size, minimum=2)
    if batch_size > n:
        raise ValueError(
            f"{fn}: expected batch_size <= n (batches hold distinct indices), got batch_size={batch_size}, n={n}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{fn}: expected seed to be an int, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    return [np.sort(rng.choice(n, size=batch_size, replace=False)).astype(np.int64) for _ in range(M)]
