"""The probed parameters ``P``: which parameters a probe differentiates (:func:`resolve_parameters`),
the last transformer layer's pattern, and AdamW's bias-corrected second moments of a live optimizer."""

from __future__ import annotations

import re
from typing import Sequence

import torch

from normfast.encoders import Encoder


def resolve_parameters(encoder: Encoder, selector: str | Sequence[str] = "all") -> list[str]:
    """Names of the probed parameters ``P``.

    ``selector``: ``"all"`` (every trainable parameter), ``"head"`` (the final
    linear map), ``"last"`` (the last transformer layer, :func:`last_layer_pattern`),
    a regular expression searched in each parameter name, or an explicit list of names.
    """
    fn = "resolve_parameters"
    trainable = [n for n, p in encoder.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"{fn}: the model {type(encoder).__name__} has no trainable parameters "
            f"(all requires_grad=False); nothing can be probed"
        )
    if isinstance(selector, str):
        if selector == "all":
            return trainable
        if selector == "last":
            selector = last_layer_pattern(trainable, fn)
        if selector == "head":
            head = encoder.head()
            if head is None:
                hint = encoder.head_hint() if hasattr(encoder, "head_hint") else ""
                raise ValueError(
                    f"{fn}: params='head' but {type(encoder).__name__} does not end in a linear "
                    f"head (e.g. no projection / Dense layer); use a regex or 'all'" + (f". {hint}" if hint else "")
                )
            return list(head.parameter_names)
        try:
            pattern = re.compile(selector)
        except re.error as exc:
            raise ValueError(f"{fn}: params={selector!r} is not a valid regular expression ({exc})") from None
        names = [n for n in trainable if pattern.search(n)]
        if not names:
            sample = ", ".join(trainable[:6]) + (", ..." if len(trainable) > 6 else "")
            raise ValueError(f"{fn}: params={selector!r} matches no trainable parameter; names look like: {sample}")
        return names
    names = list(selector)
    unknown = [n for n in names if n not in set(trainable)]
    if unknown or not names:
        raise ValueError(f"{fn}: unknown or frozen parameter names {unknown or names}")
    return names


def last_layer_pattern(names: Sequence[str], fn: str = "resolve_parameters") -> str:
    """The regular expression of the last transformer layer among parameter ``names``
    (``encoder\\.layer\\.5\\.`` for all-MiniLM-L6-v2); ``ValueError`` when no name has ``encoder.layer.N.``."""
    found = [int(m.group(1)) for n in names if (m := re.search(r"encoder\.layer\.(\d+)\.", n))]
    if not found:
        raise ValueError(
            f"{fn}: params='last' means the last transformer layer, but no trainable parameter is named "
            f"'encoder.layer.N.' (names look like: {', '.join(list(names)[:4])}); pass params='all' or a regex "
            f"(CLI --params)"
        )
    return rf"encoder\.layer\.{max(found)}\."


def adam_second_moments(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Bias-corrected ``v̂`` per parameter name from a live ``torch.optim.Adam``/``AdamW``."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        beta2 = group["betas"][1]
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            if "exp_avg_sq" not in st or id(p) not in names:
                continue
            step = float(st["step"])
            out[names[id(p)]] = st["exp_avg_sq"].detach() / (1 - beta2**step)
    return out
