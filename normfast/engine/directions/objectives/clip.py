"""CLIP's symmetric image-text contrastive loss."""

from __future__ import annotations

from normfast.engine.directions.objectives.base import LOG_B, SATURATED_BELOW, Objective, register, temperature


class CLIPLoss(Objective):
    """Symmetric image-text contrastive loss (``za`` images, ``zb`` texts).

    The mean of image->text and text->image cross-entropies over cosine logits
    divided by a fixed temperature (CLIP's learned logit scale is not a
    parameter of the probe). On an open_clip model the positives go through the
    other tower (``needs_pair_encoder``).
    """

    name = "clip"
    summary = "symmetric, image-text pairs; the other tower encodes the positives"
    needs = "pairs"
    needs_pair_encoder = True
    declared_settings = (temperature(0.07),)
    fixed_settings = {"symmetric": True}
    chance = LOG_B
    saturated_below = SATURATED_BELOW

    def loss(self, za, zb=None, labels=None):
        from normfast.engine.directions.objectives.functional import check_embeddings, info_nce

        check_embeddings("CLIPLoss.loss", za, zb, need_zb=True)
        return info_nce(za, zb, self.temperature, symmetric=True)


register(CLIPLoss)
