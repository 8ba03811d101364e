"""Triton kernels behind :mod:`normfast.ops` (installed as ``normfast.kernels``).

One module per fused op, each a ``@triton.jit`` kernel plus its launcher:

* :func:`accumulate` -- fold a block of displacements into the streaming
  per-probe accumulators in one read (:mod:`.accumulate`);
* :func:`head_stats` -- closed-form head mode, S form: tiled ``Ã·Ḡᵀ`` and
  ``Ã·S_c`` with a row-reduction epilogue (:mod:`.head_stats`);
* :func:`project` -- head mode, per-batch form: ``Ã·G̃^cᵀ_B`` tiles reduced
  to radial dots and squared norms over the batches (:mod:`.project`).

Launchers take CUDA tensors; with ``TRITON_INTERPRET=1`` set before triton is
imported they also run on CPU tensors (slowly; that is how the tests run
them). Each launcher names the plain-torch function in
:mod:`normfast.reference` it must match.
"""
from .accumulate import accumulate
from .head_stats import head_stats
from .project import project
from .utils import KERNEL_INPUT_DTYPES, MAX_FUSED_DIM, block_sizes, interpreted

__all__ = [
    "accumulate",
    "head_stats",
    "project",
    "block_sizes",
    "interpreted",
    "KERNEL_INPUT_DTYPES",
    "MAX_FUSED_DIM",
]
