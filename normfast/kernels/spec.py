"""One record per kernel, and the registry that everything else loops over.

A kernel module ends with ``register(KernelSpec(...))``: its launcher, the
plain-torch reference the launcher must match, its tile configuration, its
cost model, its tolerance, what the resource report compiles and what the
GPU check times. The interpreter's tile choice (:func:`~normfast.kernels.utils.block_sizes`),
the resource report (:mod:`normfast.kernels.resources`), the roofline, the
GPU check and the tests read these records; none of them names a kernel.
Adding a kernel is its module and the import that registers it
(``normfast/kernels/__init__.py``); the registry keeps the order of
registration, which is the order every report lists the kernels in.

Cases (the GPU check's timed problems, the roofline's rows) are plain dicts:
``op`` is the kernel's name, the other keys are the kernel's own (sizes,
``dtype`` as a torch dtype name, flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from normfast.core.reference.errors import TOLERANCES, allowed_error

__all__ = [
    "UNITS",
    "KernelSpec",
    "ResourcePlan",
    "kernel_owner",
    "kernel_spec",
    "kernel_specs",
    "kernel_tolerances",
    "meta_zeros",
    "register",
    "unregister",
]

#: The arithmetic units a kernel's products can run on (their peak rates are the roofline's):
#: fp32 FMA, TF32 tensor cores, bf16/fp16 tensor cores.
UNITS = ("fp32_fma", "tf32_dense", "bf16_dense")

#: Labels of a resource-report launch and the call that makes it (inside ``capture_launches``).
Launches = Iterable[tuple[dict, Callable[[], Any]]]


@dataclass(frozen=True)
class ResourcePlan:
    """What the resource report compiles for one launcher, without a GPU.

    ``launches(part, dtypes)`` calls the launcher on meta tensors
    (:func:`meta_zeros`) over ``part``, its section of the report's sweep,
    for every input dtype name in ``dtypes``, yielding ``(labels, call)``;
    the report captures each call's launches and compiles every tile
    configuration they may choose on a GPU. Launchers that share a sweep
    (epilogues over one kernel) name the same ``sweep_key``.
    """

    sweep_key: str
    sweep: dict
    launches: Callable[[dict, tuple[str, ...]], Launches]


def _no_cases(gpu: bool) -> dict[int, list[dict]]:
    return {}


def _no_rows(d: int, protocol: dict, row: Callable[[dict, dict, str], dict]) -> list[dict]:
    return []


def _generic_label(case: dict) -> str:
    return " ".join([case["op"]] + [f"{k}={v}" for k, v in case.items() if k != "op"])


@dataclass(frozen=True)
class KernelSpec:
    """Everything the rest of the code needs to know about one kernel launcher.

    Required: ``name`` (the launcher's name: the registry key and a case's
    ``op``), ``launcher``, ``reference`` (the plain-torch function of
    :mod:`normfast.core.reference` the launcher must match; float64 inputs
    give the float64 truth), ``tiles`` (the interpreter's tile configuration
    from the launch's dimensions, as keywords: ``BLOCK_*``, ``num_warps``,
    ``num_stages``) and ``cost`` (``cost(case, config=None, n=None)``: FLOPs
    and bytes per row, see :mod:`normfast.kernels.costs`; ``config`` a tile
    configuration for the L2 and padding figures, ``n`` the rows the right
    factors are amortized over).

    The rest has defaults:

    * ``units(case)``: the arithmetic units its products run on (:data:`UNITS`);
      ``cost_config(case)``: the tile configuration a GPU case's cost is
      computed for (``None`` when the tiles do not change it);
    * ``tolerances``: allowed error by input dtype, in the form of
      :data:`normfast.core.reference.TOLERANCES` (the default);
    * ``jit_kernels``: the ``@triton.jit`` functions it owns (their source
      hashes go into the resource report); ``variant_class(labels)``,
      ``summary_class(cls)`` and ``scalar_products`` say how the report
      names a compiled variant of them, groups it in its summary, and what
      runs its products when no tensor-core instruction is found ("FMA", or
      "-" for a kernel without products);
    * ``resources``: the :class:`ResourcePlan` of the launcher (``None``: nothing to compile);
    * ``check_cases(gpu)``: the GPU check's timed cases (``gpu=False``: the
      CPU dry run's tiny ones) by problem width; the check runs each width
      over every kernel, narrowest first, most informative case first;
      ``case_label(case)`` names a case in the reports; ``example(case,
      device, generator)``: the launcher's positional arguments for a case
      (the reference takes the same), for kernels the GPU check times
      without a benchmark of their own;
    * ``roofline(d, protocol, row)``: its rows of the paper roofline at width
      ``d``; ``row(case, cost, unit)`` turns a case and its cost into a row.
    """

    name: str
    launcher: Callable[..., Any]
    reference: Callable[..., Any]
    tiles: Callable[..., dict]
    cost: Callable[..., dict]
    units: Callable[[dict], str] = lambda case: "fp32_fma"
    cost_config: Callable[[dict], dict | None] = lambda case: None
    tolerances: dict[torch.dtype, dict] = field(default_factory=lambda: dict(TOLERANCES))
    jit_kernels: tuple = ()
    variant_class: Callable[[dict], str] = lambda labels: labels["dtype"]
    summary_class: Callable[[str], str] = lambda cls: cls
    scalar_products: str = "-"
    resources: ResourcePlan | None = None
    check_cases: Callable[[bool], dict[int, list[dict]]] = _no_cases
    case_label: Callable[[dict], str] = _generic_label
    example: Callable[..., tuple] | None = None
    roofline: Callable[[int, dict, Callable[[dict, dict, str], dict]], list[dict]] = _no_rows

    def allowed_error(self, dtype: torch.dtype, plain_error: float | None = None) -> float:
        """This kernel's tolerance for inputs of ``dtype`` (low precision needs the plain-torch error)."""
        return allowed_error(dtype, plain_error, table=self.tolerances)


_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Add a kernel's record (a module registers its kernels when imported); returns it."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"register: expected a KernelSpec, got {type(spec).__name__}")
    known = _REGISTRY.get(spec.name)
    if known is not None and known.launcher is not spec.launcher:
        raise ValueError(f"register: a kernel named {spec.name!r} is already registered ({known.launcher.__module__})")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a kernel's record (a test's temporary kernel)."""
    _REGISTRY.pop(name, None)


def kernel_specs() -> tuple[KernelSpec, ...]:
    """Every registered kernel, in the order of registration."""
    return tuple(_REGISTRY.values())


def kernel_spec(name: str) -> KernelSpec:
    """The record of kernel ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r} (registered: {', '.join(_REGISTRY)})") from None


def kernel_owner(jit_name: str) -> KernelSpec | None:
    """The record that owns the ``@triton.jit`` function named ``jit_name`` (``None``: no registered kernel)."""
    for spec in _REGISTRY.values():
        if any(k.__name__ == jit_name for k in spec.jit_kernels):
            return spec
    return None


def kernel_tolerances() -> dict[str, dict[torch.dtype, dict]]:
    """The tolerance table of every registered kernel: name -> input dtype -> rtol / factor / atol."""
    return {name: dict(spec.tolerances) for name, spec in _REGISTRY.items()}


def meta_zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor with shape, strides and dtype but no storage: what a resource-report launch is made of.

    ``data_ptr()`` is 0, i.e. aligned, like a fresh CUDA allocation.
    """
    return torch.zeros(*shape, dtype=dtype, device=torch.device("meta"))
