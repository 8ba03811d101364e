"""Triton kernels behind :mod:`normfast.ops` (installed as ``normfast.kernels``).

One module per fused op, each a ``@triton.jit`` kernel plus its launcher, ending
with its record (:class:`KernelSpec`, :mod:`.spec`):

* :func:`head_stack` -- closed-form head mode: the stacked products
  ``z·(G_k ã)``, ``|G_k ã|²``, ``ãᵀ S_k ã`` of every probe row in one pass
  (:mod:`.head_stack`);
* :func:`head_stats` (S form) and :func:`project` (per-batch form) -- the
  head statistics as epilogues over :func:`head_stack` (:mod:`.head_stats`);
* :func:`accumulate` -- fold a block of displacements into the streaming
  per-probe accumulators in one read (:mod:`.accumulate`).

Launchers take CUDA tensors; with ``TRITON_INTERPRET=1`` set before triton is
imported they also run on CPU tensors (slowly; that is how the tests run
them). Each launcher names the plain-torch function in
:mod:`normfast.core.reference` it must match, and so does its record.
:func:`kernel_specs` lists the records; the interpreter's tile choice, the
resource report (:mod:`.resources`: compiles the launches for a CUDA target
without a GPU), the roofline, the GPU check and the tests loop over them.
"""

# isort: off
# Importing a kernel's module registers its record; the order of these imports is the
# registry's, which is the order every report lists the kernels in.
from .head_stack import head_stack
from .head_stats import head_stats, project
from .accumulate import accumulate

# isort: on
from .spec import KernelSpec, ResourcePlan, kernel_spec, kernel_specs, kernel_tolerances, register
from .utils import KERNEL_INPUT_DTYPES, MAX_FUSED_DIM, block_sizes, capture_launches, head_configs, interpreted

__all__ = [
    "accumulate",
    "head_stack",
    "head_stats",
    "project",
    "KernelSpec",
    "ResourcePlan",
    "kernel_spec",
    "kernel_specs",
    "kernel_tolerances",
    "register",
    "block_sizes",
    "head_configs",
    "capture_launches",
    "interpreted",
    "KERNEL_INPUT_DTYPES",
    "MAX_FUSED_DIM",
]
