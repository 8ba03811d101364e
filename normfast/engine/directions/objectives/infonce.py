"""InfoNCE on ``(anchor, positive)`` pairs with in-batch negatives."""

from __future__ import annotations

from normfast.engine.directions.objectives.base import LOG_B, SATURATED_BELOW, Objective, Setting, register, temperature


class InfoNCE(Objective):
    """InfoNCE on ``(anchor, positive)`` pairs with in-batch negatives.

    ``loss = mean_i -log softmax_j(cos(a_i, b_j) / T)[i]``; with ``symmetric=True``
    the average of that and the same loss with the roles of ``a`` and ``b``
    swapped.
    """

    name = "infonce"
    summary = "(anchor, positive) pairs, in-batch negatives"
    needs = "pairs"
    declared_settings = (
        temperature(0.05),
        Setting("symmetric", False, "average the anchor->positive and positive->anchor losses", type=bool),
    )
    chance = LOG_B
    saturated_below = SATURATED_BELOW

    def loss(self, za, zb=None, labels=None):
        from normfast.engine.directions.objectives.functional import check_embeddings, info_nce

        check_embeddings("InfoNCE.loss", za, zb, need_zb=True)
        return info_nce(za, zb, self.temperature, self.symmetric)


register(InfoNCE)
