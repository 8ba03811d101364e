"""Stage 2 of a probe, transmission: how an update direction ``p_B`` moves each probe embedding.

Per probe item ``i`` the first-order displacement per unit learning rate is
``t_i^B = −J_i p_B`` with ``J_i = ∂z_i/∂P``.

* **jvp mode** -- a forward-mode JVP of the probe forward along ``p_B`` gives
  ``t`` for every item of a chunk at once (every token of a sequence in one
  pass). Several directions share one pass through ``torch.func.vmap`` over
  the tangents (the primal is computed once). Only the tail of the network,
  from the first stage that owns a probed parameter, is differentiated; the
  frozen front comes from a cache.
* **head mode** -- when ``P`` is exactly one final linear map ``z = W a + b``,
  ``t_i^B = −(G_B a_i + g_B)`` in closed form and the statistics follow from
  the probe activations and the stacked directions, without any JVP
  (``normfast.ops.head_mode_stats``).

κ, the effective radial damping, is one more JVP along the decayed parameters
themselves: ``κ_i = ẑ_i · (J_i θ_decayed) / R_i``; ``kappa_exempt`` is the same
along the probed parameters exempt from decay (the regime check,
:mod:`normfast.engine.diagnostics.regime`, compares the two).

Modules: :mod:`.jvp` (the probed tail and its jvp, κ from a jvp) and :mod:`.head` (the closed form
of a linear head: its inputs, directions, stacked products and statistics).
"""

from normfast.engine.transmission.head import HeadDirections, head_flops, head_mode_stats, prepare_head
from normfast.engine.transmission.jvp import Tail, kappa_from_jvp

__all__ = ["HeadDirections", "Tail", "head_flops", "head_mode_stats", "kappa_from_jvp", "prepare_head"]
