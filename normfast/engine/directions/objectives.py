"""Virtual objectives: scale-invariant contrastive losses that only produce update directions.

Every objective here depends on the embeddings only through their directions
(each row is L2-normalized before anything else), so rescaling a row by a
positive factor leaves the loss unchanged. The equilibrium law relies on that:
it is what makes the gradient orthogonal to ``z`` and shrink like ``1/R``.
:func:`check_scale_invariance` tests the property numerically for objectives
users bring themselves.

An objective declares what a virtual batch must hold (``needs``):

``"pairs"``
    ``(anchors, positives)``; ``loss(za, zb)`` with row ``i`` of ``za`` and ``zb``
    a positive pair (InfoNCE, CLIP).
``"labels"``
    ``(items, labels)``; ``loss(za, labels=labels)`` (supervised contrastive).
``"items"``
    items only; the engine encodes them twice with dropout active
    (``uses_dropout``) and passes the two views as ``za, zb`` (SimCSE).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from normfast.core.checks import check_finite_scalar, describe

NEEDS = ("pairs", "labels", "items")


def _check_embeddings(
    fn: str, za: Any, zb: Any = None, labels: Any = None, *, need_zb: bool = False, need_labels: bool = False
) -> torch.Tensor | None:
    """Validate a loss call; returns ``labels`` as a 1-D integer tensor on ``za``'s device."""
    if not isinstance(za, torch.Tensor):
        raise TypeError(f"{fn}: expected za to be a torch.Tensor, got {type(za).__name__}")
    if za.dim() != 2:
        raise ValueError(f"{fn}: expected za to be 2-D [B, d], got {describe('za', za)}")
    if not za.is_floating_point():
        raise TypeError(f"{fn}: expected za to have a floating dtype, got {describe('za', za)}")
    if za.shape[0] < 2:
        raise ValueError(f"{fn}: expected a batch of at least 2 rows (in-batch negatives), got {describe('za', za)}")
    if need_zb and zb is None:
        raise ValueError(f"{fn}: expected zb (the second side of each pair), got None")
    if zb is not None:
        if not isinstance(zb, torch.Tensor):
            raise TypeError(f"{fn}: expected zb to be a torch.Tensor, got {type(zb).__name__}")
        if zb.shape != za.shape:
            raise ValueError(f"{fn}: expected zb to match za.shape={tuple(za.shape)}, got {describe('zb', zb)}")
        if zb.device != za.device:
            raise ValueError(f"{fn}: expected za and zb on one device, got za on {za.device}, zb on {zb.device}")
    if labels is None:
        if need_labels:
            raise ValueError(f"{fn}: expected labels (one class per row of za), got None")
        return None
    labels = torch.as_tensor(labels, device=za.device)
    if labels.dim() != 1 or labels.shape[0] != za.shape[0]:
        raise ValueError(
            f"{fn}: expected labels to be 1-D with {za.shape[0]} entries "
            f"(one per row of za), got {describe('labels', labels)}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{fn}: expected integer class labels, got {describe('labels', labels)}")
    return labels


class Objective:
    """Base class of virtual objectives.

    Subclasses set ``name`` and ``needs`` and implement :meth:`loss`. A loss
    must be invariant to rescaling each embedding row by a positive factor
    (normalize first); the engine checks user objectives with
    :func:`check_scale_invariance`.

    Attributes:
        name: short identifier, used in run metadata.
        needs: what a virtual batch holds: ``"pairs"``, ``"labels"`` or ``"items"``.
        uses_dropout: run the batch forward in train mode (dropout active).
        temperature: softmax temperature of the similarity logits.
    """

    name: str = "objective"
    needs: str = "pairs"
    uses_dropout: bool = False
    temperature: float = 1.0

    def loss(
        self, za: torch.Tensor, zb: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scalar loss of one virtual batch."""
        raise NotImplementedError

    def __call__(
        self, za: torch.Tensor, zb: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.loss(za, zb, labels)

    def settings(self) -> dict[str, Any]:
        """Every setting that changes the loss (run metadata, summary header); extend in subclasses."""
        return {"temperature": self.temperature}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(temperature={self.temperature})"


def _temperature(fn: str, value: Any) -> float:
    return check_finite_scalar(fn, "temperature", value, minimum=0.0, strictly=True)


def _info_nce(za: torch.Tensor, zb: torch.Tensor, temperature: float, symmetric: bool) -> torch.Tensor:
    a = F.normalize(za, dim=-1)
    b = F.normalize(zb, dim=-1)
    logits = a @ b.T / temperature
    target = torch.arange(za.shape[0], device=za.device)
    loss = F.cross_entropy(logits, target)
    if symmetric:
        loss = 0.5 * (loss + F.cross_entropy(logits.T, target))
    return loss


class InfoNCE(Objective):
    """InfoNCE on ``(anchor, positive)`` pairs with in-batch negatives.

    ``loss = mean_i -log softmax_j(cos(a_i, b_j) / T)[i]``; with ``symmetric=True``
    the average of that and the same loss with the roles of ``a`` and ``b``
    swapped.
    """

    name = "infonce"
    needs = "pairs"

    def __init__(self, temperature: float = 0.05, symmetric: bool = False):
        self.temperature = _temperature("InfoNCE", temperature)
        self.symmetric = bool(symmetric)

    def loss(self, za, zb=None, labels=None):
        _check_embeddings("InfoNCE.loss", za, zb, need_zb=True)
        return _info_nce(za, zb, self.temperature, self.symmetric)

    def settings(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "symmetric": self.symmetric}

    def __repr__(self) -> str:
        return f"InfoNCE(temperature={self.temperature}, symmetric={self.symmetric})"


class CLIPLoss(Objective):
    """Symmetric image-text contrastive loss (``za`` images, ``zb`` texts).

    The mean of image->text and text->image cross-entropies over cosine logits
    divided by a fixed temperature (CLIP's learned logit scale is not a
    parameter of the probe).
    """

    name = "clip"
    needs = "pairs"

    def __init__(self, temperature: float = 0.07):
        self.temperature = _temperature("CLIPLoss", temperature)

    def settings(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "symmetric": True}

    def loss(self, za, zb=None, labels=None):
        _check_embeddings("CLIPLoss.loss", za, zb, need_zb=True)
        return _info_nce(za, zb, self.temperature, symmetric=True)


class SupCon(Objective):
    """Supervised contrastive loss on class labels (Khosla et al. 2020, the "L_out" form).

    For anchor ``i`` with positives ``P(i) = {p != i : y_p = y_i}`` and all other
    rows ``A(i) = {a != i}``::

        l_i = -1/|P(i)| * sum_{p in P(i)} log( exp(s_ip / T) / sum_{a in A(i)} exp(s_ia / T) )

    with ``s`` the cosine similarity; the loss is the mean of ``l_i`` over anchors
    that have at least one positive. Anchors whose class appears once in the
    batch have no positive: they still serve as negatives for the others but
    contribute no term of their own. When no anchor has a positive the loss is
    a zero that still depends on ``za`` (zero gradient), with a ``RuntimeWarning``.

    When ``zb`` is given (two views of the same items) the views are stacked and
    the labels repeated, the multi-view form of the paper.
    """

    name = "supcon"
    needs = "labels"

    def __init__(self, temperature: float = 0.1):
        self.temperature = _temperature("SupCon", temperature)

    def loss(self, za, zb=None, labels=None):
        labels = _check_embeddings("SupCon.loss", za, zb, labels, need_labels=True)
        z = za if zb is None else torch.cat([za, zb])
        y = labels if zb is None else torch.cat([labels, labels])
        n = z.shape[0]
        u = F.normalize(z, dim=-1)
        logits = u @ u.T / self.temperature
        self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
        # log-softmax over A(i): every row but the anchor itself
        logits = logits.masked_fill(self_mask, float("-inf"))
        log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        positives = (y[:, None] == y[None, :]) & ~self_mask
        n_pos = positives.sum(dim=1)
        has_pos = n_pos > 0
        if not bool(has_pos.any()):
            warnings.warn(
                "SupCon: no anchor in this batch has a positive (every label appears once); the loss is zero",
                RuntimeWarning,
                stacklevel=2,
            )
            return (z * 0.0).sum()
        pos_log_prob = torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
        per_anchor = -pos_log_prob[has_pos] / n_pos[has_pos].to(z.dtype)
        return per_anchor.mean()


class SimCSE(Objective):
    """Unsupervised SimCSE: InfoNCE between two dropout views of the same items.

    ``needs = "items"`` and ``uses_dropout = True``: the engine encodes each batch
    twice in train mode and passes the views as ``za, zb``.
    """

    name = "simcse"
    needs = "items"
    uses_dropout = True

    def __init__(self, temperature: float = 0.05):
        self.temperature = _temperature("SimCSE", temperature)

    def loss(self, za, zb=None, labels=None):
        _check_embeddings("SimCSE.loss", za, zb, need_zb=True)
        return _info_nce(za, zb, self.temperature, symmetric=False)


_REGISTRY: dict[str, type[Objective]] = {"infonce": InfoNCE, "clip": CLIPLoss, "supcon": SupCon, "simcse": SimCSE}


def get_objective(name: str | Objective, **kwargs: Any) -> Objective:
    """Objective by name: ``"infonce"``, ``"clip"``, ``"supcon"``, ``"simcse"``.

    Case, ``-`` and ``_`` are ignored. Keyword arguments go to the constructor
    (``temperature``, ``symmetric``). An :class:`Objective` instance is returned as is.
    """
    if isinstance(name, Objective):
        if kwargs:
            raise ValueError(f"get_objective: got an Objective instance and constructor arguments {sorted(kwargs)}")
        return name
    if not isinstance(name, str):
        raise TypeError(f"get_objective: expected a name or an Objective, got {type(name).__name__}")
    key = name.lower().replace("-", "").replace("_", "")
    if key not in _REGISTRY:
        raise ValueError(f"get_objective: unknown objective {name!r}; expected one of {sorted(_REGISTRY)}")
    return _REGISTRY[key](**kwargs)


def objective_settings(objective: Any) -> dict[str, Any]:
    """The settings of any objective: :meth:`Objective.settings`, else its temperature if it has one."""
    if isinstance(objective, Objective):
        return dict(objective.settings())
    t = getattr(objective, "temperature", None)
    return {} if t is None else {"temperature": t}


def check_scale_invariance(
    objective: Objective | Callable[..., torch.Tensor],
    za: torch.Tensor,
    zb: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    rtol: float = 1e-4,
    *,
    trials: int = 2,
    seed: int = 0,
) -> bool:
    """Whether ``objective`` is unchanged when each embedding row is rescaled by a positive factor.

    Rows of ``za`` (and ``zb``) are multiplied by independent factors drawn
    log-uniformly from [0.1, 10] (``trials`` draws, seeded); the loss must stay
    within ``rtol`` (relative, plus a tiny absolute floor) of the unscaled loss.
    ``objective`` is an :class:`Objective` or a callable ``loss(za, zb, labels)``.
    Returns the verdict and emits a ``UserWarning`` naming the objective when it
    is not scale-invariant (the equilibrium law then does not apply as derived).
    """
    fn = "check_scale_invariance"
    loss_fn = objective.loss if isinstance(objective, Objective) else objective
    if not callable(loss_fn):
        raise TypeError(
            f"{fn}: expected an Objective or a callable loss(za, zb, labels), got {type(objective).__name__}"
        )
    label_tensor = _check_embeddings(fn, za, zb, labels)
    rtol = check_finite_scalar(fn, "rtol", rtol, minimum=0.0, strictly=True)
    name = getattr(objective, "name", None) or getattr(objective, "__name__", None) or type(objective).__name__
    gen = torch.Generator().manual_seed(int(seed))

    def factors(n: int, like: torch.Tensor) -> torch.Tensor:
        log_s = (torch.rand(n, generator=gen, dtype=torch.float64) * 2.0 - 1.0) * math.log(10.0)
        return log_s.exp().to(device=like.device, dtype=like.dtype)[:, None]

    with torch.no_grad():
        base = loss_fn(za, zb, label_tensor)
        base_value = float(base)
        invariant = math.isfinite(base_value)
        for _ in range(max(1, int(trials))):
            if not invariant:
                break
            za_s = za * factors(za.shape[0], za)
            zb_s = None if zb is None else zb * factors(zb.shape[0], zb)
            value = float(loss_fn(za_s, zb_s, label_tensor))
            tolerance = rtol * abs(base_value) + 1e-6 * rtol
            invariant = math.isfinite(value) and abs(value - base_value) <= tolerance
    if not invariant:
        warnings.warn(
            f"objective {name!r} is not scale-invariant: rescaling embedding rows "
            "changes the loss. The equilibrium-norm law assumes a loss that depends "
            "only on directions (normalize embeddings before the similarity).",
            UserWarning,
            stacklevel=2,
        )
    return invariant
