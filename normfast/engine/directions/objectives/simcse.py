"""Unsupervised SimCSE: InfoNCE between two dropout views of the same items."""

from __future__ import annotations

from normfast.engine.directions.objectives.base import LOG_B, SATURATED_BELOW, Objective, register, temperature


class SimCSE(Objective):
    """Unsupervised SimCSE: InfoNCE between two dropout views of the same items.

    ``needs = "items"`` and ``uses_dropout = True``: the engine encodes each batch
    twice in train mode and passes the views as ``za, zb``.
    """

    name = "simcse"
    summary = "dropout views of items, no labels"
    needs = "items"
    uses_dropout = True
    views = "two dropout views of each"
    declared_settings = (temperature(0.05),)
    chance = LOG_B
    saturated_below = SATURATED_BELOW

    def loss(self, za, zb=None, labels=None):
        from normfast.engine.directions.objectives.functional import check_embeddings, info_nce

        check_embeddings("SimCSE.loss", za, zb, need_zb=True)
        return info_nce(za, zb, self.temperature, symmetric=False)


register(SimCSE)
