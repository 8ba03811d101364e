"""jvp mode: the probed tail of an encoder as a function of the probed parameters
(:class:`Tail`), pushed forward along K update directions at once, and κ from a jvp along the
decayed parameters (:func:`kappa_from_jvp`)."""

from __future__ import annotations

import warnings

import torch
from torch.func import functional_call, jvp, vmap

from normfast.encoders import Encoder, forward_ad_safe


class Tail:
    """The probed tail of an encoder, as a function of the probed parameters.

    ``front`` is the cached state at the cut (``encoder(state, 0, cut)``);
    ``output`` is ``"pooled"`` or ``"tokens"``. ``rows`` (bool ``[B, T]``) picks
    the probe rows of token outputs.
    """

    def __init__(self, encoder: Encoder, names: list[str], cut: int, output: str):
        self.encoder = encoder
        self.names = list(names)
        self.cut = cut
        self.output = output
        self._vmap_ok = True

    def params(self) -> dict[str, torch.Tensor]:
        return {n: self.encoder.get_parameter(n).detach() for n in self.names}

    def _fn(self, front: dict):
        enc, cut, output = self.encoder, self.cut, self.output

        def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(enc, params, (front,), {"start": cut, "output": output}, strict=False)

        return f

    @staticmethod
    def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``[..., B, T, d]`` -> ``[..., n, d]`` (token rows) or unchanged for pooled."""
        if rows is None:
            return x
        return x[..., rows, :]

    def primal(self, front: dict, rows: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            z = self.encoder(front, self.cut, output=self.output)
        return self._rows(z, rows)

    def jvp(self, front: dict, tangents: dict[str, torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor:
        """``J · tangent`` for K stacked tangents ``{name: [K, *shape]}`` -> ``[K, n, d]``."""
        f = self._fn(front)
        params = self.params()
        K = next(iter(tangents.values())).shape[0]
        with forward_ad_safe(), torch.no_grad():
            if K > 1 and self._vmap_ok:
                try:

                    def one(tan: dict[str, torch.Tensor]) -> torch.Tensor:
                        return jvp(f, (params,), (tan,))[1]

                    out = vmap(one)(tangents)
                    return self._rows(out, rows)
                except (RuntimeError, NotImplementedError) as exc:
                    # some ops have no batching rule; fall back to one direction per pass
                    self._vmap_ok = False
                    warnings.warn(
                        f"batched directions unavailable for this model ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160]}); using one direction per pass",
                        stacklevel=2,
                    )
            outs = [jvp(f, (params,), ({n: t[k] for n, t in tangents.items()},))[1] for k in range(K)]
        return self._rows(torch.stack(outs), rows)


def kappa_from_jvp(z: torch.Tensor, j_decay: torch.Tensor) -> torch.Tensor:
    """κ = ẑ·(J θ_d) / R = z·(J θ_d) / R², row-wise (NaN for zero-norm rows)."""
    z64 = z.double()
    r2 = z64.square().sum(-1)
    k = (z64 * j_decay.double()).sum(-1) / r2
    return torch.where(r2 > 0, k, torch.full_like(k, float("nan")))
