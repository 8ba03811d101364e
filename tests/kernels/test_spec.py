"""One record per kernel (normfast/kernels/spec.py): every registered kernel declares what the rest of
the code reads, and a kernel added the way docs/design.md's recipe says -- its own module, nothing
else edited -- joins every loop: the tile choice, the tolerance table, the resource report, the
roofline and the GPU check.

The toy kernel (y = 3 x, fp32) is written to a temporary folder and imported from there, as a new
kernel module would be; it runs through the interpreter here (TRITON_INTERPRET=1, set by the
conftest before triton is imported), or compiled on a GPU.
"""

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import normfast.kernels as kernels  # noqa: E402
from normfast.core.reference import TOLERANCES, output_errors  # noqa: E402
from normfast.kernels import (  # noqa: E402
    block_sizes,
    capture_launches,
    interpreted,
    kernel_spec,
    kernel_specs,
    kernel_tolerances,
    resources,
)
from normfast.kernels.spec import UNITS, kernel_owner, unregister  # noqa: E402
from tests.kernels._helpers import ON_GPU  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHIPPED = kernel_specs()  # the package's own kernels (the toy registers later, and leaves)
#: the toy kernel runs where kernels can: on a GPU, or in the interpreter
runs_kernels = pytest.mark.skipif(not ON_GPU and not interpreted(), reason="no GPU and TRITON_INTERPRET is off")


def _dims(spec, case: dict) -> dict:
    """The case's sizes that the record's tile function takes."""
    return {k: case[k] for k in inspect.signature(spec.tiles).parameters if k in case}


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.name)
def test_every_record_names_its_launcher_and_the_reference_the_launcher_names(spec):
    assert getattr(kernels, spec.name) is spec.launcher and spec.launcher.__name__ == spec.name
    # the launcher's docstring names the plain-torch reference it must match: the record's
    assert f"normfast.core.reference.{spec.reference.__name__}" in spec.launcher.__doc__
    assert spec.reference.__module__.startswith("normfast.core.reference.")
    for jit in spec.jit_kernels:
        assert kernel_owner(jit.__name__) is spec


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.name)
def test_every_record_gives_tiles_costs_and_labels_for_its_cases(spec):
    for gpu in (False, True):
        cases = [c for width in spec.check_cases(gpu).values() for c in width]
        labels = set()
        assert cases, f"{spec.name} has no GPU-check cases (gpu={gpu})"
        for case in cases:
            assert case["op"] == spec.name and case["n"] > 0 and case["dtype"] in ("float32", "bfloat16", "float16")
            tiles = block_sizes(spec.name, **_dims(spec, case))
            assert tiles == spec.tiles(**_dims(spec, case))
            blocks = [v for k, v in tiles.items() if k.startswith("BLOCK_")]
            assert blocks and all(b >= 1 and b & (b - 1) == 0 for b in blocks), tiles
            assert tiles["num_warps"] >= 1
            cost = spec.cost(case, config=spec.cost_config(case), n=case["n"])
            assert cost["useful_flops"] > 0 and cost["hbm_bytes"] > 0, (case, cost)
            assert spec.units(case) in UNITS
            labels.add(spec.case_label(case))
        assert len(labels) == len(cases), f"{spec.name}: two cases share a label"


def test_the_tolerance_table_covers_every_kernel_and_input_dtype():
    table = kernel_tolerances()
    assert list(table) == [s.name for s in kernel_specs()]
    for name, by_dtype in table.items():
        assert set(kernels.KERNEL_INPUT_DTYPES) <= set(by_dtype), name
        spec = kernel_spec(name)
        assert spec.allowed_error(torch.float32) == TOLERANCES[torch.float32]["rtol"]
        assert spec.allowed_error(torch.bfloat16, 1e-3) == pytest.approx(2 * 1e-3 + 8e-3)
        with pytest.raises(ValueError, match="plain-torch error"):
            spec.allowed_error(torch.float16)


def test_kernels_sharing_a_sweep_share_its_problems():
    parts = {}
    for spec in SHIPPED:
        if spec.resources is not None:
            assert parts.setdefault(spec.resources.sweep_key, spec.resources.sweep) == spec.resources.sweep
    assert resources.SWEEP == {**resources.TARGETS, **dict(sorted(parts.items()))}


def test_the_recipe_names_at_most_six_files_and_every_shipped_kernel_has_them():
    """docs/design.md's "A new kernel": the files it names are where each shipped kernel lives."""
    design = (REPO / "docs" / "design.md").read_text()
    recipe = design[design.index("* **A new kernel**") : design.index("* **A new experiment**")]
    steps = re.findall(r"^ +(\d)\. (?:`([^`]+)`)?", recipe, re.M)
    assert [n for n, _ in steps] == ["1", "2", "3", "4", "5", "6"]
    named = [path for _, path in steps if path]
    assert named == [
        "normfast/kernels/NAME.py",
        "normfast/core/reference/NAME.py",
        "tests/kernels/test_NAME.py",
        "normfast/kernels/__init__.py",
        "docs/design.md",
    ]
    init = (REPO / "normfast" / "kernels" / "__init__.py").read_text()
    kernels_section = design[design.index("## Kernels") :]
    for spec in SHIPPED:
        stem = spec.launcher.__module__.rsplit(".", 1)[1]
        assert (REPO / "normfast" / "kernels" / f"{stem}.py").is_file()
        assert (REPO / spec.reference.__module__.replace(".", "/")).with_suffix(".py").is_file()
        assert (REPO / "tests" / "kernels" / f"test_{stem}.py").is_file(), spec.name
        assert f"from .{stem} import" in init and f"`{spec.name}`" in kernels_section, spec.name


def test_an_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match=r"block_sizes: unknown kernel 'nope' \(registered: head_stack"):
        block_sizes("nope", dim=3)


# ---------------------------------------------------------------------------------------------
# the recipe: a kernel in its own module, registered by importing it

TOY = '''
"""A toy kernel: y = 3 x in fp32 (one elementwise pass)."""

from functools import partial

import torch
import triton
import triton.language as tl

from normfast.kernels import KernelSpec, ResourcePlan, register
from normfast.kernels.spec import meta_zeros
from normfast.kernels.utils import KernelLaunch, check_kernel_device, check_kernel_dtype, launch


@triton.jit
def _toy_scale_kernel(
    X_ptr,  # [N] input
    Y_ptr,  # [N] fp32 output
    N,
    BLOCK_N: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    x = tl.load(X_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y_ptr + offs, 3.0 * x, mask=ok)


def toy_tiles(n=None):
    return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1}


def toy_scale(x):
    """y = 3 x in fp32. Must match :func:`toy_scale_reference`."""
    check_kernel_dtype("toy_scale", "x", x)
    check_kernel_device("toy_scale", x)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    launch(
        KernelLaunch(
            name="toy_scale",
            kernel=_toy_scale_kernel,
            grid=lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),),
            args=(x, y, n),
            meta={},
            configs=[toy_tiles(n)],
        )
    )
    return y


def toy_scale_reference(x):
    return 3.0 * x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _launches(part, dtypes):
    for dtype in dtypes:
        for n in part["n"]:
            x = meta_zeros(n, dtype=getattr(torch, dtype))
            yield {"op": "toy_scale", "dtype": dtype, "n": n}, partial(toy_scale, x)


def _roofline(d, protocol, row):
    case = {"op": "toy_scale", "form": "toy_scale", "d_in": d, "d_out": d, "dtype": "float32", "path": "kernel"}
    return [row(case, {"useful_flops": float(d), "hbm_bytes": 8.0 * d}, "fp32_fma")]


SPEC = register(
    KernelSpec(
        name="toy_scale",
        launcher=toy_scale,
        reference=toy_scale_reference,
        tiles=toy_tiles,
        cost=lambda case, config=None, n=None: {"useful_flops": 1.0, "hbm_bytes": 8.0},
        jit_kernels=(_toy_scale_kernel,),
        resources=ResourcePlan("toy_scale", {"n": (1, 1001)}, _launches),
        check_cases=lambda gpu: {384: [{"op": "toy_scale", "n": 2**20 if gpu else 1000, "dtype": "float32"}]},
        example=lambda case, device, gen: (torch.randn(case["n"], device=device, generator=gen),),
        roofline=_roofline,
    )
)
'''


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy_scale.py"
    path.write_text(textwrap.dedent(TOY))
    spec = importlib.util.spec_from_file_location("toy_scale", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        unregister("toy_scale")


@runs_kernels
def test_a_new_kernel_module_joins_the_registry_tiles_and_tolerance_table(toy):
    assert kernel_spec("toy_scale") is toy.SPEC and kernel_specs()[-1] is toy.SPEC
    assert block_sizes("toy_scale", n=5) == toy.toy_tiles()
    assert kernel_tolerances()["toy_scale"][torch.float32]["rtol"] == TOLERANCES[torch.float32]["rtol"]
    # it runs (interpreter or GPU) and matches its reference within its own tolerance
    device = "cuda" if ON_GPU else "cpu"
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)).to(device)
    got = toy.toy_scale(x)
    errors = output_errors(got, toy.toy_scale_reference(x.double()))
    assert max(errors.values()) <= toy.SPEC.allowed_error(torch.float32)
    assert not torch.equal(got.cpu(), x.cpu())  # a kernel that did nothing would fail above, and here


def test_a_new_kernel_module_joins_the_resource_report(toy):
    assert resources.SWEEP["toy_scale"] == {"n": (1, 1001)}
    assert kernel_owner("_toy_scale_kernel") is toy.SPEC
    part, dtypes = resources.SWEEP["toy_scale"], resources.SWEEP["dtypes"]
    labels = []
    for lab, call in toy.SPEC.resources.launches(part, dtypes):
        with capture_launches() as launches:
            call()
        assert [launch.name for launch in launches] == ["toy_scale"]
        labels.append(lab)
    assert len(labels) == 2 * len(dtypes)
    # and the report itself plans it: the compile-only planning in a process that compiles for real
    script = textwrap.dedent(
        """
        import importlib.util, json, sys
        from normfast.kernels import kernel_spec, resources
        spec = importlib.util.spec_from_file_location("toy_scale", sys.argv[1])
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        plan = resources.planned_variants(specs=(kernel_spec("toy_scale"),))
        rows = [resources.describe_variant(e) for e in plan.values()]
        print(json.dumps({"keys": sorted(resources.kernel_source_keys()), "rows": resources.to_json(rows)}))
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", script, toy.__file__], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "_toy_scale_kernel" in out["keys"] and "_head_stack_kernel" in out["keys"]
    # 1001 is odd, 1 is specialized: two variants per dtype and target
    assert len(out["rows"]) == 2 * len(dtypes) * len(resources.TARGETS["archs"])
    assert {r["kernel"] for r in out["rows"]} == {"_toy_scale_kernel"}
    assert {r["ops"][0] for r in out["rows"]} == {"toy_scale"}


@runs_kernels
def test_a_new_kernel_module_joins_the_roofline_and_the_gpu_check(toy, tmp_path):
    from bench.experiments import roofline
    from bench.experiments.gpu_check.context import StageContext
    from bench.experiments.gpu_check.kernel_stage import BENCHMARKS, generic_case, kernel_cases

    p = roofline.protocol()
    assert [r["op"] for r in roofline.kernel_rows(384, p)][-1] == "toy_scale"
    checked = {r["label"]: r for r in roofline.check_case_rows()}
    label = toy.SPEC.case_label({"op": "toy_scale", "n": 2**20, "dtype": "float32"})
    assert checked[label]["op"] == "toy_scale" and checked[label]["predicted_ms"] > 0
    # the GPU check times it at its width, after the other kernels of that width
    cases = kernel_cases(gpu=True)
    at = [c["op"] for c in cases].index("toy_scale")
    assert all(c.get("d_in", c.get("dim")) == 384 for c in cases[:at])
    assert all(c.get("d_in", c.get("dim")) == 768 for c in cases[at + 1 :])
    # and, having no benchmark of its own, through the record: launcher vs reference vs float64
    assert "toy_scale" not in BENCHMARKS
    (case,) = [c for c in kernel_cases(gpu=False) if c["op"] == "toy_scale"]
    ctx = StageContext("kernels", time.time() + 120, tmp_path, dry_run=not ON_GPU)
    res = generic_case(ctx, case, None)
    assert res["check"]["passed"] and res["check"]["max_error"] <= res["check"]["tolerance"]
    assert res["config"] == toy.toy_tiles() and res["kernel"]["p50_ms"] > 0 and res["bytes"] == 8.0 * case["n"]
