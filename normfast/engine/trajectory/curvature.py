"""The curvature heat: what the law's linearization of a step misses, estimated from virtual steps.

The law balances ``E[ΔR²]`` with ``Δz = J Δθ`` (DESIGN §1). The realized change
also holds the remainder ``|f(θ + Δθ)|² − |z + J Δθ|²``: second order in the
step like the heat ``|J Δθ|²`` (the network's curvature along the step and,
for ReLU networks, the activation patterns the step flips), and of the same
sign on average. The radial-budget ledger of E1 measures it during training
(``python -m bench run e1 --ledger``); this module estimates it from virtual steps,
the same way the heat is: for each of the ``M`` heat batches take the step a
momentum-free optimizer would take, ``Δθ_B = −η' p_B``, and measure the
remainder exactly, by one more forward pass at ``θ + Δθ_B``::

    c_i = mean_B ( |f_i(θ − η' p_B)|² − |z_i − η' J_i p_B|² )

``η'`` is the long-run step: ``lr / (1 − momentum)`` for heavy-ball SGD (a
gradient's total displacement), ``lr`` for AdamW whatever β1 (an EMA spreads a
gradient over steps without changing its total). ``c`` is a per-step term in
the units of ``R²``; the law takes it as heat in its own branch's units:

* SGD (scale-invariant branch):  ``Q_curv = R² c / η'²``, added to ``Q``
  (the heat term of one step is ``η'² Q / R²``);
* AdamW (scale-free branch):     ``Q_curv_w = c / η'²``, added to ``Q_w``
  (the heat term of one step is ``η'² Q_w``).

Adding it as heat assumes it scales with ``R`` like the heat does; measured
at the state the law is solved near (a trajectory average), the scaling does
not matter (DESIGN §1, "Diagnosing a law that misses").
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.func import functional_call, jvp

from normfast.engine.config import ProbeConfig, ProbePlan, as_plan


def curvature_heat(
    encoder: Any,
    probes: Sequence[Any],
    objective: Any,
    pairs: Any,
    config: ProbeConfig | ProbePlan,
    *,
    second_moments: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, np.ndarray]:
    """Per probe row: the remainder ``c`` of a virtual step (see the module docstring) and the law's
    ``Q_curv`` (SGD) or ``Q_curv_w`` (AdamW); pooled output, jvp over the probed parameters.

    Uses the configuration's ``M`` heat batches (``config.batches``) from its seed. The
    remainder is a small difference of squared norms: the probed tail is evaluated in
    ``dtype`` (float64 by default; the model's own parameters are not changed).
    Returns ``{"c": [n], "norm": [n], "Q_curv" or "Q_curv_w": [n]}``.
    """
    from normfast.data.batches import virtual_batches
    from normfast.data.pairs import PairSource, as_pair_source
    from normfast.encoders import forward_ad_safe
    from normfast.engine.directions.gradients import compute_directions
    from normfast.engine.directions.objectives import get_objective
    from normfast.engine.directions.parameters import resolve_parameters

    fn = "curvature_heat"
    plan = as_plan(config)  # a plan as its caller checked it; a config checked here, once
    config = plan.config
    if not isinstance(config.optimizer, str):
        raise ValueError(
            f"{fn}: expected one optimizer preset for all probed parameters, got optimizer={config.optimizer!r}"
        )
    if config.output != "pooled":
        raise ValueError(f"{fn}: expected config.output='pooled', got {config.output!r}")
    if isinstance(objective, str):
        objective = get_objective(objective)
    probes = list(probes)
    if not probes:
        raise ValueError(f"{fn}: expected at least one probe item, got none")
    if not isinstance(pairs, PairSource):
        pairs = as_pair_source(pairs, objective, probes)
    names = resolve_parameters(encoder, config.params)
    cut = min(encoder.stage_of_parameters()[n] for n in names)
    adam = config.optimizer == "adamw"
    presets = plan.presets_for(names)
    rng = np.random.default_rng(config.seed)
    batches = virtual_batches(len(pairs), config.batches, config.batch_size, int(rng.integers(2**31)))
    was_training = encoder.training
    try:
        dirs = compute_directions(
            encoder,
            objective,
            pairs,
            names,
            presets,
            batches,
            cut=cut,
            no_decay=config.no_decay,
            seed=config.seed,
            progress=False,
            check_invariance=False,
            second_moments=second_moments,
        )
        encoder.eval()
        step = config.lr if adam else config.lr / (1.0 - config.momentum)
        state = encoder.prepare(probes)
        with torch.no_grad():
            front = encoder(state, 0, cut) if cut > 0 else state
        front = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in front.items()}

        chosen = set(names)
        frozen = {n: p.detach().to(dtype) for n, p in encoder.named_parameters() if n not in chosen}

        def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(
                encoder, {**frozen, **params}, (front,), {"start": cut, "output": "pooled"}, strict=False
            )

        params = {n: encoder.get_parameter(n).detach().to(dtype) for n in names}
        total = None
        with forward_ad_safe(), torch.no_grad():
            for b in range(dirs.M):
                p = {n: dirs.directions[b][n].to(dtype) for n in names}
                z, jp = jvp(f, (params,), (p,))
                lin = z - step * jp
                z_new = f({n: params[n] - step * p[n] for n in names})
                rem = z_new.square().sum(-1) - lin.square().sum(-1)
                total = rem if total is None else total + rem
    finally:
        encoder.train(was_training)
    c = (total / dirs.M).double().cpu().numpy()
    norm = z.double().norm(dim=-1).cpu().numpy()
    out = {"c": c, "norm": norm}
    if adam:
        out["Q_curv_w"] = c / step**2
    else:
        out["Q_curv"] = norm**2 * c / step**2
    return out
