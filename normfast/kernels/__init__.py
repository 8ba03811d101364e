"""Triton kernels behind :mod:`normfast.ops` (installed as ``normfast.kernels``).

One module per fused op, each a ``@triton.jit`` kernel plus its launcher:

* :func:`accumulate` -- fold a block of displacements into the streaming
  per-probe accumulators in one read (:mod:`.accumulate`);
* :func:`head_stack` -- closed-form head mode: the stacked products
  ``z·(G_k ã)``, ``|G_k ã|²``, ``ãᵀ S_k ã`` of every probe row in one pass
  (:mod:`.head_stack`);
* :func:`head_stats` (S form) and :func:`project` (per-batch form) -- the
  head statistics as epilogues over :func:`head_stack` (:mod:`.head_stats`).

Launchers take CUDA tensors; with ``TRITON_INTERPRET=1`` set before triton is
imported they also run on CPU tensors (slowly; that is how the tests run
them). Each launcher names the plain-torch function in
:mod:`normfast.core.reference` it must match. :mod:`.resources` compiles the
launches for a CUDA target without a GPU and reports what they cost the SM.
"""

from .accumulate import accumulate
from .head_stack import head_stack
from .head_stats import head_stats, project
from .utils import KERNEL_INPUT_DTYPES, MAX_FUSED_DIM, block_sizes, capture_launches, head_configs, interpreted

__all__ = [
    "accumulate",
    "head_stack",
    "head_stats",
    "project",
    "block_sizes",
    "head_configs",
    "capture_launches",
    "interpreted",
    "KERNEL_INPUT_DTYPES",
    "MAX_FUSED_DIM",
]
