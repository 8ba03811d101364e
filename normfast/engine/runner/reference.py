"""The fixed reference of a :class:`~normfast.engine.prober.Prober`'s relative heat.

``heat_rel`` is a row's log heat minus a reference level (:mod:`normfast.engine.diagnostics.relative_heat`).
``normfast.probe`` takes the median over its own rows; a Prober answers many calls, and a row's
``heat_rel`` must not depend on the other items of its call, so its level is fixed with its
directions: the median log heat of the rows of :data:`REFERENCE_ITEMS` items of the pair source
(spread evenly over it), probed once per output kind with the kept directions, and saved with them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from normfast.engine.diagnostics.relative_heat import heat_reference
from normfast.engine.runner.chunks import run_chunks
from normfast.engine.runner.state import ProbeRun

#: pair-source items whose median log heat is a Prober's fixed reference of ``heat_rel``
REFERENCE_ITEMS = 32


def reference_items(pairs: Any, limit: int = REFERENCE_ITEMS) -> Sequence[Any]:
    """Up to ``limit`` items of the pair source, spread evenly over it (the anchors of pairs, the items
    of labelled items)."""
    n = len(pairs)
    idx = np.unique(np.round(np.linspace(0, n - 1, min(n, limit))).astype(np.int64))
    batch = pairs.batch(idx)
    return batch if getattr(pairs, "kind", "items") == "items" else batch[0]


def reference_pass(prober: Any, output: str) -> dict[str, Any]:
    """The reference level for ``output`` rows: the per-item pass of ``prober`` (its kept directions) over
    :func:`reference_items`, without the snapshot, with error bars (the reference's leave-one-group-out
    levels make ``se_heat_rel``). Warnings about these items are not the caller's. A dict as
    :func:`~normfast.engine.diagnostics.relative_heat.heat_reference` returns, with ``source: "pairs"``,
    ``items`` and ``output``."""
    items = reference_items(prober.pairs)
    plan = prober.plan.derived(output=output, snapshot=False, uncertainty=True, radial_spread=False)
    run = ProbeRun(
        prober.encoder,
        prober.objective,
        prober.pairs,
        plan,
        prober.pair_encoder,
        False,
        prober.second_moments,
        n_items=len(items),
        store=prober.store,
    )
    tables: dict[int, pa.Table] = {}
    n_chunks = math.ceil(len(items) / plan.config.chunk_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_chunks(run, items, None, list(range(n_chunks)), tables.__setitem__)
    reference = heat_reference((tables[c] for c in range(n_chunks)), run.heat_level_se)
    reference.update(source="pairs", items=len(items), output=output)
    return reference


def saved_references(prober: Any) -> dict[str, dict[str, Any]]:
    """The references saved beside a Prober's directions: those of its config's output, of the pooled rows
    and (sequence models) of the token rows, so that a load with another output finds its own."""
    outputs = [prober.config.output, "pooled"] + (["tokens"] if prober.encoder.has_tokens else [])
    for output in dict.fromkeys(outputs):
        prober.heat_reference(output)
    return dict(prober.references)


def call_reference(prober: Any) -> dict[str, Any] | None:
    """The reference of one call's ``heat_rel``: the fixed one, or None for the call's own median (with
    ``relative_heat="run"``; or, said once, for loaded directions that hold none and came without their
    pair source)."""
    if prober.relative_heat == "run":
        return None
    reference = prober.heat_reference()
    if reference is None and not prober.reference_warned:
        prober.reference_warned = True
        warnings.warn(
            f"Prober: the directions in {prober.source} hold no heat reference for output="
            f"{prober.config.output!r} and were loaded without their pair source, so heat_rel is relative "
            f"to each call's own median; pass pairs= to Prober.load (or save the directions again)",
            UserWarning,
            stacklevel=4,
        )
    return reference
