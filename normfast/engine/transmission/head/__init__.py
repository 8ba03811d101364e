"""Head mode: the probe statistics of a linear head in closed form, with error bars.

For a linear head ``z = W a + b`` the displacement of probe ``i`` along
virtual batch ``B`` is ``t_i^B = −G̃_B ã_i`` (``ã = [a, 1]``,
``G̃_B = [G_B | g_B]``). Every statistic is then a row-wise epilogue over
three stacked products (:func:`normfast.core.reference.head_stack_reference`,
computed by :func:`~normfast.engine.transmission.head.products.head_products`): for a stack of direction matrices
``G_k`` the radial dots ``z·(G_k ã)`` and squares ``|G_k ã|²``, for a stack
of symmetric matrices ``S_k`` the quadratic forms ``ãᵀ S_k ã``. The stacks
are formed once from the M directions (cost independent of N); the per-probe
cost is ``N·da·(K1·d_out + K2·da)`` multiply-adds.

Three forms (``s = R`` for the scale-invariant branch "u", ``1`` for "w"):

``grouped`` (the default; ``uncertainty=True``)
    The M heat batches fall into K groups (batch ``b`` in group ``b mod K``;
    sizes differ by at most one); the drift's batches likewise (its own
    M_D batches, or the heat's). Stacks: ``G = [Ḡ_D, Ḡ_D,−1, …, Ḡ_D,−K]``
    (the drift's mean direction and its K leave-one-group-out means) and
    ``S = [S_c, S_c,−1, …, S_c,−K]`` (the heat's covariance of the M
    directions and of the M − n_g left when group g is removed, each about
    its own mean, ``1/(count − 1)``). Then exactly as in the S form
    ``D = −s ẑ·Ḡ_D ã``, ``m2 = s²|Ḡ_D ã|²``, ``V2 = s² ãᵀS_cã``,
    ``Q = m2 + V2``, and from the leave-one-out values: the group drifts
    ``D_g = (M_D D − (M_D − n_g) D_−g)/n_g`` give ``se_D`` (unbiased, K−1
    dof) and ``sign_stability``; the delete-a-group jackknife of
    ``V2_−g`` and ``Q_−g = m2_−g + V2_−g`` gives ``se_V2`` and ``se_Q``
    (:mod:`normfast.engine.estimators.uncertainty`; K−1 dof, on the wide side for
    ``V2``). The leave-one-out values themselves are returned (``loo``) for
    the jackknife of ``R_eq``. Cost ``(K+1)(d_out + da)`` product columns
    per probe, independent of M.
``S`` (``uncertainty=False``: the bare form)
    ``G = [Ḡ_D]``, ``S = [S_c]``: ``D, m2, V2, Q`` only; error bars NaN.
``per_batch`` (``radial_spread=True``)
    ``G = [Ḡ, G̃^c_1, …, G̃^c_M]``: every batch's radial dot, so ``se_D``
    (``std(r, ddof=1)/√M``) and ``sign_stability`` per batch; ``V2`` from
    the squares. Cost grows with M. ``se_V2``/``se_Q`` NaN.

Without the drift's own batches ``Ḡ_D`` is the heat's mean ``Ḡ`` and the
drift groups are the heat groups. Every form equals feeding every ``t_i^B``
through a :class:`~normfast.engine.estimators.accumulator.ProbeAccumulator` (a
``GroupedAccumulator`` for the grouped estimators), which the tests check
against a float64 brute force.

Modules: :mod:`.prepare` (the M directions, centered and grouped once: :func:`prepare_head`),
:mod:`.products` (the three stacked products), :mod:`.epilogues` (the statistics from them),
:mod:`.flops` (the FLOP model of the forms) and :mod:`.dispatch` (:func:`head_mode_stats`: checks,
the form and the backend).
"""

from normfast.engine.transmission.head.dispatch import FORMS, head_mode_stats
from normfast.engine.transmission.head.flops import head_flops
from normfast.engine.transmission.head.prepare import HeadDirections, prepare_head
from normfast.engine.transmission.head.products import fold_quadratic, head_products, stack_plan

__all__ = [
    "FORMS",
    "HeadDirections",
    "fold_quadratic",
    "head_flops",
    "head_products",
    "head_mode_stats",
    "prepare_head",
    "stack_plan",
]
