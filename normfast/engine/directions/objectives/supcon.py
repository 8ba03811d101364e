"""Supervised contrastive loss on class labels."""

from __future__ import annotations

import math

from normfast.engine.directions.objectives.base import SATURATED_BELOW, Chance, Objective, register, temperature


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

    Its chance level is ``log(B - 1)`` (a uniform guess among the other rows). Its floor is
    ``mean_i log|P(i)|``, above 0 when a class appears more than twice in a batch, so the
    loss-to-chance rule calls it saturated only when the batches' classes come in pairs.
    """

    name = "supcon"
    summary = "class labels"
    needs = "labels"
    declared_settings = (temperature(0.1),)
    chance = Chance("log (B-1)", lambda b: math.log(b - 1))
    saturated_below = SATURATED_BELOW

    def loss(self, za, zb=None, labels=None):
        import torch

        from normfast.engine.directions.objectives.functional import check_embeddings, sup_con

        labels = check_embeddings("SupCon.loss", za, zb, labels, need_labels=True)
        z = za if zb is None else torch.cat([za, zb])
        y = labels if zb is None else torch.cat([labels, labels])
        return sup_con(z, y, self.temperature)


register(SupCon)
