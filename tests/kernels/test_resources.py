"""Every shipped kernel configuration compiles for sm_80 and sm_90 without spills, below the
register cap, with room for two programs per SM -- checked without a GPU.

The full sweep (``python -m bench run kernel_resources --out bench/results/kernel_resources``, about 15 minutes)
compiles every variant the launchers can choose and writes bench/results/kernel_resources/kernel_resources.json.
Here, in a subprocess with ``TRITON_INTERPRET=0`` (the test process runs the interpreter):

1. the launchers are called over the same sweep without compiling anything, and every
   variant they would compile today must be in the committed report, which must record
   no failing variant and the current kernel sources (so a kernel or tile-list change
   without a fresh report fails here);
2. a representative subset is compiled now (the default tile configuration of every
   operand class of the head kernel on odd dimensions with bias, the widest
   ``accumulate`` rows of both branches; Triton's on-disk cache may serve a compile
   it has seen) and must pass on its own, with the registers the report recorded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "bench" / "results" / "kernel_resources" / "kernel_resources.json"

# (kernel, label filter, arch): the variants compiled fresh by the test
SUBSET = [
    (
        "_head_stack_kernel",
        {"op": "head_stack", "dtype": "float32", "precision": "ieee", "d_in": 385, "bias": True},
        90,
    ),
    (
        "_head_stack_kernel",
        {"op": "head_stack", "dtype": "float32", "precision": "ieee", "d_in": 385, "bias": True},
        80,
    ),
    (
        "_head_stack_kernel",
        {"op": "head_stack", "dtype": "float32", "precision": "tf32", "d_in": 385, "bias": True},
        80,
    ),
    ("_head_stack_kernel", {"op": "head_stack", "dtype": "bfloat16", "d_in": 385, "bias": True}, 90),
    ("_head_stack_kernel", {"op": "head_stack", "dtype": "bfloat16", "d_in": 385, "bias": True}, 80),
    ("_accumulate_kernel", {"dtype": "float32", "branch": "uw", "dim": 2048}, 90),
    ("_accumulate_kernel", {"dtype": "bfloat16", "branch": "u", "dim": 384}, 80),
]

SCRIPT = r"""
import json, sys
import triton
from normfast.kernels import resources

subset = json.loads(sys.argv[1])
plan = resources.planned_variants()
fresh = []
for kernel, want, arch in subset:
    for key, entry in sorted(plan.items()):
        first_config = entry["launch"].configs[0]
        if (entry["launch"].kernel.__name__ == kernel and entry["arch"] == arch
                and entry["config"] == first_config
                and any(all(lab.get(k) == v for k, v in want.items()) for lab in entry["labels"])):
            row = resources.compile_launch(entry["launch"], entry["config"], arch)
            row["problems"] = resources.variant_problems(row)
            row["kernel"] = kernel
            fresh.append(row)
            break
    else:
        raise SystemExit(f"no planned variant matches {kernel} {want} sm_{arch}")
print(json.dumps({"planned": sorted(plan), "source_keys": resources.kernel_source_keys(),
                  "triton": triton.__version__, "fresh": fresh}))
"""


@pytest.fixture(scope="module")
def current():
    env = dict(os.environ, TRITON_INTERPRET="0")
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, json.dumps(SUBSET)],
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("planning and compiling the subset took over 420 s")
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("no ptxas available to lower for a CUDA target")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    assert REPORT.exists(), "run: python -m bench run kernel_resources --out bench/results/kernel_resources"
    return json.loads(REPORT.read_text())


def test_the_committed_report_covers_every_variant_the_launchers_would_compile(current, report):
    assert report["complete"], "the committed report was made with --limit"
    assert report["kernel_source_keys"] == current["source_keys"], (
        "the kernels changed since bench/results/kernel_resources/kernel_resources.json was written: "
        "re-run python -m bench run kernel_resources --out bench/results/kernel_resources"
    )
    recorded = {r["key"] for r in report["variants"]}
    missing = sorted(set(current["planned"]) - recorded)
    assert not missing, (
        f"{len(missing)} variants the launchers can compile are not in the "
        f"report (tile lists or the sweep changed): re-run the report"
    )
    assert len(current["planned"]) >= 100


def test_no_shipped_variant_spills_sits_at_the_register_cap_or_runs_alone(report):
    bad = [
        (r["kernel"], r["class"], r["config_label"], r["arch"], r["problems"])
        for r in report["variants"]
        if r["problems"]
    ]
    assert not bad and report["failing"] == 0, bad[:10]
    for r in report["variants"]:
        assert r["stack"] == 0 and r["local"] == 0, r
        assert r["registers"] < report["register_cap"], r
        assert r["programs_per_sm"] >= 2, r
    # bf16/fp16 products run on tensor cores: wgmma on sm_90, mma.sync on sm_80
    for r in report["variants"]:
        if r["kernel"] == "_head_stack_kernel" and r["class"] != "fp32 FMA":
            assert r["tensor_cores"] == ("wgmma" if r["arch"] == "sm_90" else "mma"), r
        if r["class"] == "fp32 FMA":
            assert r["tensor_cores"] is None, r


def test_a_representative_subset_compiles_clean_now(current, report):
    recorded = {r["key"]: r for r in report["variants"]}
    assert len(current["fresh"]) == len(SUBSET)
    for row in current["fresh"]:
        assert row["problems"] == [], row
        assert row["stack"] == 0 and row["registers"] < 255 and row["programs_per_sm"] >= 2, row
        old = recorded.get(row["key"])
        if old is not None and report["toolchain"]["triton"] == current["triton"]:
            assert (old["registers"], old["stack"]) == (row["registers"], row["stack"]), (old, row)
