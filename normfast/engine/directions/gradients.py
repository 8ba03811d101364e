"""Virtual batches -> update directions ``p_B`` over the probed parameters.

Nothing is trained: each virtual batch only produces a gradient ``ĝ_B`` of the
scale-invariant objective with respect to the probed parameters ``P``, which
an optimizer preset maps to the update direction ``p_B`` (DESIGN §1):

* ``sgd``   -> ``p_B = ĝ_B`` (the scale-invariant branch ``u``); heavy-ball
  momentum β is treated by the documented heuristic ``η -> η / (1 - β)``.
* ``adamw`` -> ``p_B = ĝ_B / (sqrt(v̂) + eps)`` with ``v̂`` from a given
  optimizer state, else the mean of ``ĝ_B²`` over the virtual batches (the
  scale-free branch ``w``).

When the probed parameters sit in the tail of the network, the frozen front is
run under ``no_grad`` and only the tail is differentiated.

Drift from the mean direction. The drift ``D = ẑ·(−s J p̄)`` is linear in the
update direction, so it needs only the mean ``p̄`` of the directions over its
``M_D`` batches, never the batches one by one: the gradients are summed as
they come (one running sum per batch group, batch ``b`` in group ``b mod K``,
so the group means give the standard error) and only the first ``M`` -- the
heat's batches -- are kept whole. AdamW's ``p_B = ĝ_B/(sqrt(v̂)+eps)`` is
linear in ``ĝ_B`` for a fixed ``v̂``, hence ``p̄_g = mean_g(ĝ)/(sqrt(v̂)+eps)``;
``v̂`` (when not given) is the mean of ``ĝ²`` over all ``M_D`` batches, and the
same ``v̂`` maps the heat's directions.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from normfast.encoders import Encoder
from normfast.engine.directions.presets import OptimizerPreset
from normfast.engine.estimators.uncertainty import group_counts


# ----------------------------------------------------------------------------
# virtual batches
# ----------------------------------------------------------------------------
class NonFiniteLoss(ValueError):
    """The objective is NaN or infinite on a virtual batch: no update direction can come from it.

    The same arguments meet it again (the batches are seeded), so a run that raises it has
    nothing to resume."""


def _embed(encoder: Encoder, items: Sequence[Any], cut: int, *, grad: bool) -> torch.Tensor:
    state = encoder.prepare(items)
    with torch.no_grad():
        front = encoder(state, 0, cut) if cut > 0 else state
    if grad:
        return encoder(front, cut, output="pooled")
    with torch.no_grad():
        return encoder(front, cut, output="pooled")


def batch_loss(
    encoder: Encoder,
    objective: Any,
    pairs: Any,
    indices: np.ndarray,
    *,
    cut: int = 0,
    pair_encoder: Encoder | None = None,
) -> torch.Tensor:
    """Objective value on one virtual batch, differentiable w.r.t. the encoder's tail."""
    kind = objective.needs
    if kind == "pairs":
        anchors, positives = pairs.batch(indices)
        za = _embed(encoder, anchors, cut, grad=True)
        if pair_encoder is None:
            zb = _embed(encoder, positives, cut, grad=True)
        else:
            zb = _embed(pair_encoder, positives, 0, grad=False)
        return objective.loss(za, zb)
    if kind == "labels":
        items, labels = pairs.batch(indices)
        za = _embed(encoder, items, cut, grad=True)
        return objective.loss(za, labels=torch.as_tensor(labels, device=za.device))
    if kind == "items":
        items = pairs.batch(indices)
        za = _embed(encoder, items, cut, grad=True)
        zb = _embed(encoder, items, cut, grad=True)
        return objective.loss(za, zb)
    raise ValueError(f"batch_loss: objective {objective!r} needs {kind!r}, expected pairs/labels/items")


@dataclass
class DriftMeans:
    """The mean update direction of each of K batch groups over the drift's M_D batches.

    ``means[g]`` maps every probed parameter name to the mean of ``p_B`` over the
    batches of group ``g`` (batch ``b`` in group ``b mod K``); ``counts[g]`` is
    that group's number of batches (they differ by at most one when K does not
    divide M_D). The overall mean direction is ``Σ_g counts[g] means[g] / M_D``.
    """

    means: list[dict[str, torch.Tensor]]
    counts: list[int]

    @property
    def K(self) -> int:
        return len(self.means)

    @property
    def M(self) -> int:
        return int(sum(self.counts))

    def stacked(
        self, names: Sequence[str], branch_of: Mapping[str, str], branch: str, groups: Sequence[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """``{name: [k, *shape]}``: the means of ``groups`` (default all K), zeros for the other branch's parameters."""
        means = self.means if groups is None else [self.means[g] for g in groups]
        out = {}
        for n in names:
            stack = torch.stack([m[n] for m in means])
            out[n] = stack if branch_of[n] == branch else torch.zeros_like(stack)
        return out


@dataclass
class Directions:
    """The M update directions over the probed parameters, per optimizer branch.

    ``drift`` (when the drift comes from its own M_D batches) holds the group
    mean directions over those batches; ``second_moments`` the AdamW ``v̂`` that
    mapped them (estimated ones only; None when given or for SGD); ``first_batch``
    the global index of the first direction (batch ``b`` is in group ``b mod K``).
    """

    names: list[str]
    branch_of: dict[str, str]  # parameter name -> "u" | "w"
    directions: list[dict[str, torch.Tensor]]
    decayed: dict[str, torch.Tensor]  # θ_decayed (the κ tangent); absent names are not decayed
    losses: list[float]
    drift: DriftMeans | None = None
    second_moments: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    first_batch: int = 0  # global index of directions[0] (it sets the batch's group)
    #: global batch index -> (objective value, gradient norm over the probed parameters), for every
    #: batch the pass went through (the drift's M_D included): the virtual objective's health
    batch_stats: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: probed parameters that no batch of this pass reached (their displacement is zero)
    unused: list[str] = field(default_factory=list)
    #: the heat's batches drawn by their energy (:mod:`normfast.engine.directions.sampling`): the
    #: directions are then ``sqrt(w_i) (p_{b_i} - p̄)``, draw ``i`` being ``first_batch + i``; None: the
    #: plain draw, ``directions[j]`` the direction of batch ``first_batch + j``
    heat: Any = None

    @property
    def M(self) -> int:
        return len(self.directions)

    @property
    def branches(self) -> tuple[str, ...]:
        return tuple(b for b in ("u", "w") if b in self.branch_of.values())

    def stacked(self, batches: Sequence[int], branch: str) -> dict[str, torch.Tensor]:
        """``{name: [K, *shape]}`` for the given batches; zeros for parameters of the other branch."""
        out = {}
        for n in self.names:
            if self.branch_of[n] == branch:
                out[n] = torch.stack([self.directions[b][n] for b in batches])
            else:
                ref = self.directions[batches[0]][n]
                out[n] = ref.new_zeros((len(batches), *ref.shape))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.directions for t in d.values())


def iter_gradients(
    encoder: Encoder,
    objective: Any,
    pairs: Any,
    names: Sequence[str],
    batches: Sequence[np.ndarray],
    *,
    cut: int = 0,
    pair_encoder: Encoder | None = None,
    seed: int = 0,
    batch_offset: int = 0,
    progress: bool = True,
    check_invariance: bool = True,
    global_ids: Sequence[int] | None = None,
):
    """Yield ``(b, {name: ĝ_B}, loss)`` for each virtual batch, one backward pass each.

    Only the probed parameters require grad during the passes (flags restored
    after). Dropout is active only when the objective needs it (SimCSE); each
    batch's randomness is seeded from ``seed`` and its global index
    ``batch_offset + b`` (or ``global_ids[b]``, for batches that are not consecutive), so results do
    not depend on how batches are grouped. A NaN or infinite objective raises :class:`NonFiniteLoss`
    naming the batch.
    """
    params = [encoder.get_parameter(n) for n in names]
    saved_flags = {n: p.requires_grad for n, p in encoder.named_parameters()}
    was_training = encoder.training
    pair_training = pair_encoder.training if pair_encoder is not None else None
    chosen = set(names)
    try:
        for n, p in encoder.named_parameters():
            p.requires_grad_(n in chosen)
        encoder.train(bool(getattr(objective, "uses_dropout", False)))
        if pair_encoder is not None:
            pair_encoder.eval()
        it = tqdm(range(len(batches)), desc="virtual batches", unit="batch", disable=not progress, leave=False)
        for b in it:
            gb = batch_offset + b if global_ids is None else int(global_ids[b])
            with torch.random.fork_rng(devices=[encoder.device] if encoder.device.type == "cuda" else []):
                torch.manual_seed(seed * 1_000_003 + gb)
                loss = batch_loss(encoder, objective, pairs, batches[b], cut=cut, pair_encoder=pair_encoder)
                if not torch.isfinite(loss):  # before the scale check, which a NaN would fail for no reason of its own
                    raise NonFiniteLoss(
                        f"compute_directions: the objective is {loss.item()} on virtual batch {gb}, so it gives "
                        f"no update direction; the embeddings of that batch's items, or the objective, overflowed: "
                        f"check those items and the objective's temperature (a very small one overflows the "
                        f"similarity logits)"
                    )
                if gb == 0 and check_invariance:
                    _warn_if_not_scale_invariant(encoder, objective, pairs, batches[b], cut, pair_encoder)
            g = torch.autograd.grad(loss, params, allow_unused=True)
            yield (
                gb,
                {n: (gi.detach() if gi is not None else torch.zeros_like(p)) for n, gi, p in zip(names, g, params)},
                float(loss.detach()),
            )
    finally:
        for n, p in encoder.named_parameters():
            p.requires_grad_(saved_flags[n])
        encoder.train(was_training)
        if pair_encoder is not None:
            pair_encoder.train(pair_training)


def estimate_second_moments(
    encoder: Encoder, objective: Any, pairs: Any, names: Sequence[str], batches: Sequence[np.ndarray], **kwargs: Any
) -> dict[str, torch.Tensor]:
    """AdamW's ``v̂`` as the mean of ``ĝ_B²`` over the virtual batches, streaming (one gradient in memory)."""
    total: dict[str, torch.Tensor] = {}
    for _, g, _ in iter_gradients(encoder, objective, pairs, names, batches, **kwargs):
        for n, gi in g.items():
            total[n] = total[n] + gi.square() if n in total else gi.square()
    return {n: t / len(batches) for n, t in total.items()}


def compute_directions(
    encoder: Encoder,
    objective: Any,
    pairs: Any,
    names: Sequence[str],
    presets: Mapping[str, OptimizerPreset],
    batches: Sequence[np.ndarray],
    *,
    cut: int = 0,
    pair_encoder: Encoder | None = None,
    no_decay: str | None = None,
    seed: int = 0,
    batch_offset: int = 0,
    progress: bool = True,
    check_invariance: bool = True,
    second_moments: Mapping[str, torch.Tensor] | None = None,
    keep: int | None = None,
    drift_groups: int = 0,
    warn_unused: bool = True,
    global_ids: Sequence[int] | None = None,
) -> Directions:
    """Gradients of the objective on each virtual batch, mapped to update directions.

    ``presets`` maps each probed name to its optimizer preset (one preset for
    all in the common case). AdamW's ``v̂`` comes, in order of preference, from
    the preset's ``second_moments``, from ``second_moments`` here (e.g.
    estimated over all batches when they are processed in groups), or from the
    batches given (the mean of ``ĝ²`` over all of them).

    ``keep``: how many of the batches (the first ones) are kept as directions
    (default: all). ``drift_groups`` K > 0: also sum the directions of ALL the
    batches per group (batch ``batch_offset + b`` in group ``(batch_offset + b)
    mod K``) into :attr:`Directions.drift`, one running sum per group, so that
    ``M_D`` batches cost K gradients of memory, not ``M_D``. ``warn_unused``: warn here about probed
    parameters no batch reaches (a run that computes directions several times warns once itself,
    from :attr:`Directions.unused`). ``global_ids``: each batch's global index, for batches that are
    not consecutive (their dropout seeds; no drift groups then).
    """
    keep = len(batches) if keep is None else keep
    if global_ids is not None and drift_groups:
        raise ValueError("compute_directions: global_ids (batches that are not consecutive) has no drift groups")
    if drift_groups:
        counts = group_counts(len(batches), drift_groups, batch_offset)
        if min(counts) == 0:
            raise ValueError(
                f"compute_directions: expected at least one batch per drift group, got "
                f"{len(batches)} batches for drift_groups={drift_groups}"
            )
    adam = [n for n in names if presets[n].preconditioned]
    need_v = [
        n
        for n in adam
        if not (
            (presets[n].second_moments is not None and n in presets[n].second_moments)
            or (second_moments is not None and n in second_moments)
        )
    ]
    grads: list[dict[str, torch.Tensor]] = []
    losses: list[float] = []
    sums: list[dict[str, torch.Tensor]] = [dict() for _ in range(drift_groups)]
    square_sum: dict[str, torch.Tensor] = {}
    touched: set[str] = set()
    batch_stats: dict[int, tuple[float, float]] = {}
    for b, (gb, g, loss) in enumerate(
        iter_gradients(
            encoder,
            objective,
            pairs,
            names,
            batches,
            cut=cut,
            pair_encoder=pair_encoder,
            seed=seed,
            batch_offset=batch_offset,
            progress=progress,
            check_invariance=check_invariance,
            global_ids=global_ids,
        )
    ):  # b: the batch's position in ``batches``
        batch_stats[gb] = (loss, gradient_norm(g))
        if b < keep:
            grads.append(g)
            losses.append(loss)
        for n in need_v:
            square_sum[n] = square_sum[n].addcmul_(g[n], g[n]) if n in square_sum else g[n].square()
        if drift_groups:
            acc = sums[gb % drift_groups]
            for n, gi in g.items():
                if n in acc:
                    acc[n].add_(gi)
                else:
                    acc[n] = gi.clone()
        for n, gi in g.items():
            if n not in touched and bool(gi.any()):
                touched.add(n)

    unused = [n for n in names if n not in touched]
    if unused and warn_unused:
        warnings.warn(unused_warning(unused), stacklevel=2)

    estimated: dict[str, torch.Tensor] = {}
    for n in adam:
        pre = presets[n]
        if pre.second_moments is not None and n in pre.second_moments:
            v = pre.second_moments[n]
        elif second_moments is not None and n in second_moments:
            v = second_moments[n]
        else:
            v = estimated[n] = square_sum[n] / len(batches)
        ref = grads[0][n] if grads else sums[0][n]
        denom = v.to(ref).sqrt().add_(pre.eps)
        for g in grads:
            g[n] = g[n] / denom
        for acc in sums:
            acc[n] = acc[n] / denom  # linear in ĝ for a fixed v̂: mean p = mean ĝ / (sqrt(v̂)+eps)
    drift = None
    if drift_groups:
        for acc, c in zip(sums, counts):
            for n in acc:
                acc[n].div_(c)
        drift = DriftMeans(sums, counts)

    decayed = decayed_parameters(encoder, names, no_decay)
    branch_of = {n: presets[n].branch for n in names}
    return Directions(
        list(names), branch_of, grads, decayed, losses, drift, estimated or None, batch_offset, batch_stats, unused
    )


def decayed_parameters(encoder: Encoder, names: Sequence[str], no_decay: str | None) -> dict[str, torch.Tensor]:
    """θ_decayed, the κ tangent: a copy of every probed parameter that ``no_decay`` does not exempt."""
    decay_re = re.compile(no_decay) if no_decay else None
    decayed = {n: encoder.get_parameter(n).detach().clone() for n in names if not (decay_re and decay_re.search(n))}
    if not decayed:
        raise ValueError(
            f"compute_directions: no_decay={no_decay!r} excludes every probed parameter from weight "
            f"decay; the equilibrium law needs decay (kappa would be 0)"
        )
    return decayed


def gradient_norm(grads: Mapping[str, torch.Tensor]) -> float:
    """``‖ĝ_B‖``: the Euclidean norm of one batch's gradient over all the probed parameters (float64)."""
    total = 0.0
    for g in grads.values():
        total += float(g.double().square().sum())
    return total**0.5


def unused_warning(unused: Sequence[str]) -> str:
    """The one-line warning for probed parameters no virtual batch reaches."""
    shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    return (
        f"probe: {len(unused)} probed parameter(s) receive no gradient from the objective ({shown}); their "
        f"displacement is zero (e.g. a pooler the embedding does not use: leave it out of params)"
    )


def _warn_if_not_scale_invariant(
    encoder: Encoder, objective: Any, pairs: Any, indices: np.ndarray, cut: int, pair_encoder: Encoder | None
) -> None:
    from normfast.engine.directions.objectives import check_scale_invariance

    with torch.no_grad():
        kind = objective.needs
        if kind == "pairs":
            a, p = pairs.batch(indices)
            za = _embed(encoder, a, cut, grad=False)
            zb = _embed(pair_encoder or encoder, p, 0 if pair_encoder is not None else cut, grad=False)
            check_scale_invariance(objective, za, zb)
        elif kind == "labels":
            items, labels = pairs.batch(indices)
            za = _embed(encoder, items, cut, grad=False)
            check_scale_invariance(objective, za, labels=torch.as_tensor(labels, device=za.device))
        else:
            items = pairs.batch(indices)
            za = _embed(encoder, items, cut, grad=False)
            check_scale_invariance(objective, za, za.clone())
