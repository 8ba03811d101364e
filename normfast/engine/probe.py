"""The probe engine: ``probe(encoder, probes, objective, pairs, config) -> ProbeResult``.

``probe`` is one call of a fresh :class:`~normfast.engine.prober.Prober`, which holds the run
itself: a Prober keeps the directions for its next calls, ``probe`` pays them on every call.

For every probe item (a whole input with ``output="pooled"``, or every token
position with ``output="tokens"``) it measures drift ``D``, heat ``V²``,
``m2``, ``Q``, the radial damping ``κ``, the standard error and sign stability
of ``D``, and solves the equilibrium law for ``R_eq`` (full law) and
``R_eq`` with ``D = 0`` (heat-only law) -- see DESIGN §1.

The drift comes from the mean update direction over its own ``M_D =
config.drift_batches`` virtual batches (the first ``M`` of them are the
heat's): the gradients are summed per batch group as they are computed, and
each chunk takes K more directional derivatives (jvp mode) or one more GEMM
(head mode) along the K group means; ``D`` and ``m2`` are those of the
overall mean, ``se_D`` and ``sign_stability`` come from the group drifts
(:func:`normfast.engine.estimators.drift.drift_from_groups`). ``drift_batches=None``
keeps the per-batch drift of the M heat batches.

Loop structure
--------------
1. Resolve the probed parameters ``P`` and the *cut*: the first encoder stage
   that owns a parameter of ``P``. Everything before it is frozen.
2. Virtual batches -> update directions ``p_B`` (``normfast.engine.directions.gradients``).
   With the mean-direction drift, one pass over all ``M_D`` batches keeps the
   first ``M`` directions and sums the rest per group.
3. Probe items in chunks. Per chunk the frozen front runs once (``no_grad``),
   then either head mode (closed form, ``normfast.ops.head_mode_stats``) or jvp
   mode (``normfast.engine.transmission.jvp.Tail``, K directions per pass) feeds
   ``normfast.ops.ProbeAccumulator``; κ by one JVP along the decayed
   parameters; the equilibrium quartic is solved by the C++ extension.
4. Each finished chunk is written to Parquet at once (``normfast.data.runwriter``); an
   interrupted run restarted with ``resume=True`` skips finished chunks.

Loop order and memory: when all ``M`` directions fit in ``memory_budget_mb``
the chunks are the outer loop (output streams chunk by chunk). Otherwise the
directions are computed in groups that fit and become the outer loop, with
one accumulator per chunk kept across groups (results are identical: the
accumulators merge exactly); output is then written at the end, and AdamW
needs a first pass over the batches for ``v̂``.

Memory at scale: in the chunks-outer order (the default whenever the
directions fit) nothing is kept per chunk once it is written: peak memory is
set by the model, the directions and one chunk, not by the number of probe
rows, and ``probe(..., out=...)`` returns a result that reads the Parquet file
lazily. The directions-outer order keeps every chunk's accumulator (and
embeddings) until the last group, so its memory grows with the probe rows.
The progress bar counts probe items, so its ETA holds for uneven chunks.

Scale-out: inside a ``torch.distributed`` process group (e.g. under
``torchrun``) the chunks are sharded over the ranks, the directions computed
once on rank 0 and broadcast, and the output is a manifest over one Parquet
part per rank -- see ``normfast.engine.runner.distributed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from normfast.data.pairs import as_pair_source, check_batch_size
from normfast.encoders import Encoder
from normfast.engine.config import ProbeConfig, ProbePlan, as_plan
from normfast.engine.prober import Prober
from normfast.engine.result import ProbeResult
from normfast.engine.runner.chunks import as_probe_sequence

__all__ = ["ProbeConfig", "ProbeResult", "Prober", "probe"]


def probe(
    encoder: Encoder | str | torch.nn.Module,
    probes: Sequence[Any],
    objective: Any = "simcse",
    pairs: Any = None,
    config: ProbeConfig | ProbePlan | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    pair_encoder: Encoder | None = None,
    ids: Sequence[str] | None = None,
    progress: bool = True,
    model_name: str | None = None,
    second_moments: Mapping[str, torch.Tensor] | None = None,
    distributed: bool = True,
) -> ProbeResult:
    """Measure drift, heat and damping for every probe item and predict its equilibrium norm.

    Args:
        encoder: an :class:`~normfast.encoders.Encoder`, an ``nn.Module``, or a spec string for
            :func:`normfast.encoders.load_encoder` (hub id, local folder, ``open_clip:ARCH``).
        probes: the probe inputs (texts, images, tensors). With ``config.output="tokens"``
            every token position of every input becomes a row. Any object with ``len`` and
            slicing (``probes[a:b]``) is read chunk by chunk and never copied whole (e.g. one
            that reads items from disk on demand); other iterables are collected into a list.
            Items may carry their own token ids and per-position columns (``token_columns()``),
            which then join the token rows: :class:`normfast.data.corpus.CorpusWindows` probes
            every token of a corpus in context this way (its ``fingerprint()`` and
            ``describe()`` go into the run's resume key and metadata).
        objective: an objective object or name (``"infonce"``, ``"clip"``, ``"supcon"``, ``"simcse"``).
        pairs: the virtual-batch source: a ``PairSource`` or an iterable of pairs /
            (item, label) tuples / items. SimCSE without pairs uses the probes themselves
            (then held in memory as a list; pass ``pairs`` for a huge on-demand probe set).
        config: a :class:`ProbeConfig` (defaults otherwise), checked once here into the call's
            :class:`~normfast.engine.config.ProbePlan`, which every stage receives; or such a plan,
            made (and checked) before by ``config.resolve()``. The config itself is not changed.
        out: Parquet path to stream rows to (one row group per chunk). The result then reads
            the file lazily: memory does not grow with the number of probe rows.
        resume: continue an interrupted run at ``out`` (same arguments required; a finished
            run with the same arguments is returned as is).
        pair_encoder: encoder for the positive side when it is a different model (e.g. the
            text tower when probing the image tower of a CLIP model); its parameters are not probed.
        ids: optional string id per probe item (default: the item's index).
        model_name: recorded in the metadata (default: the spec string or class name).
        second_moments: AdamW's bias-corrected ``v̂`` per parameter name (e.g. from
            :func:`normfast.engine.directions.gradients.adam_second_moments` of the real optimizer); without
            it ``v̂`` is the mean of ``ĝ²`` over the virtual batches.
        distributed: inside an initialized ``torch.distributed`` default group of two or more
            ranks, shard the probe items over the ranks (every rank calls ``probe`` with the same
            arguments; see :mod:`normfast.engine.runner.distributed`). With ``out`` a sharded run writes
            ``OUT.manifest.json`` and one part per rank instead of one file. ``False``: this
            process runs alone.

    Returns:
        :class:`ProbeResult` (on every rank of a sharded run). The same arguments and seed
        give the same table, sharded or not.

    Raises:
        ValueError: among others, for a NaN or infinite parameter of ``encoder`` or
            ``pair_encoder`` (named; before ``out`` is touched), and for a NaN or infinite
            objective on a virtual batch (:class:`~normfast.engine.directions.gradients.NonFiniteLoss`,
            naming the batch; the run's work folder is removed when this call made it).
    """
    from normfast.encoders import load_encoder
    from normfast.engine.directions.objectives import get_objective

    plan = as_plan(config)  # checked once: the stages receive the plan and never check it again
    if isinstance(objective, str):
        objective = get_objective(objective)
    probes = as_probe_sequence(probes)
    if len(probes) == 0:
        raise ValueError("probe: expected at least one probe item, got an empty probe set")
    # SimCSE without pairs draws its batches from the probes: this call's Prober is bound to them.
    # The source, and whether a batch fits in it, are said before the model is touched.
    pairs = as_pair_source(pairs, objective, probes)
    if plan.batch_indices is None:
        check_batch_size("probe", plan.config.batch_size, pairs)
    if not isinstance(encoder, Encoder):
        encoder = load_encoder(encoder)
    if model_name is None:
        model_name = encoder.spec or type(encoder).__name__
    # the Prober refuses NaN or infinite weights (once), before the run's folder exists
    prober = Prober(
        encoder,
        objective,
        pairs,
        plan,
        pair_encoder=pair_encoder,
        second_moments=second_moments,
        model_name=str(model_name),
        progress=progress,
        relative_heat="run",  # one run, one set of items: heat_rel against the run's own median
    )
    return prober.probe(probes, out, resume=resume, overwrite=overwrite, ids=ids, distributed=distributed)
