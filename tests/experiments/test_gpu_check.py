"""The GPU check (``python -m bench run gpu_check``): the CPU dry run (its ``--quick``) writes a
complete report, and failures stay contained.

The check is meant for a GPU machine, which is seldom at hand; these tests
keep it working in between. The dry run runs every stage at tiny sizes on
CPU (Triton interpreter, torch paths) in a subprocess, exactly as the GPU run
would orchestrate them; a second run injects a hang and an error.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.experiments.gpu_check as gc

REPO = Path(__file__).resolve().parents[2]
STAGES = ("build", "tests", "env", "ceilings", "kernels", "e2e")


def _start(out: Path, *extra: str) -> subprocess.Popen:
    # from the repository root, as the README says: `python -m bench` finds the harness there
    return subprocess.Popen(
        [sys.executable, "-m", "bench", "run", "gpu_check", "--quick", "--out", str(out), *extra],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 240):
    stdout, stderr = proc.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    report_path = out / "gpu-check.json"
    assert report_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(report_path.read_text())


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """A dry run of three stages with a hang and an error injected, started before the full dry run
    and read after it: it spends most of its time waiting out the hang (its cap, then the grace)."""
    out = tmp_path_factory.mktemp("gpu-check-failing")
    proc = _start(
        out,
        "--stages",
        "env,ceilings,kernels",
        "--inject",
        "env=hang",
        "--inject",
        "kernels=error",
        "--stage-cap",
        "env=3",
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def dry(tmp_path_factory, failing):
    out = tmp_path_factory.mktemp("gpu-check")
    done, report = _finish(_start(out), out)
    return out, done, report


def test_dry_run_passes_every_stage_and_writes_both_files(dry):
    out, done, report = dry
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert report["schema"] == "normfast-gpu-check/1" and report["dry_run"] is True
    assert list(report["stages"]) == list(STAGES)
    for name, stage in report["stages"].items():
        assert stage["status"] == "ok", (name, stage)
        assert stage["seconds"] >= 0
    assert 0 < report["elapsed_s"] < report["budget_s"]
    assert report["environment"]["device"] == "cpu"
    assert report["environment"]["triton_interpret"] == "1"
    md = (out / "gpu-check.md").read_text()
    assert "| stage | status | s | note |" in md and "| kernels | ok |" in md
    assert "| kernel case |" in md and "minilm_head_10M (extrapolated)" in md
    # the table is printed last, for a reader of the output's tail
    assert done.stdout.rstrip().splitlines()[-1].startswith("wrote ")
    assert "| e2e | ok |" in done.stdout


def test_tests_stage_ran_kernel_tests_under_the_interpreter(dry):
    tests = dry[2]["stages"]["tests"]["result"]
    assert tests["command"].startswith("TRITON_INTERPRET=1 python -m pytest tests/kernels/test_accumulate.py")
    counts = tests["junit"]["counts"]
    assert counts["passed"] >= 5 and counts["failed"] == counts["error"] == 0
    ran = {t["test"] for t in tests["junit"]["slowest"]}
    assert any("test_head_kernels" in t for t in ran) or any("accumulate_kernel" in t for t in ran)


def test_ceilings_and_kernel_cases_are_measured_and_checked(dry):
    stages = dry[2]["stages"]
    ceilings = stages["ceilings"]["result"]
    assert ceilings["copy"]["GBps"] > 0 and ceilings["gemm"]["fp32"]["TFLOPs"] > 0
    assert ceilings["l2_copy"]["GBps"] > 0
    cases = stages["kernels"]["result"]["cases"]
    assert {c["op"] for c in cases} == {"head_stack", "head_stats", "project", "accumulate"}
    for c in cases:
        assert c["check"]["passed"] and 0 <= c["check"]["max_error"] <= c["check"]["tolerance"]
        for timing in (c["kernel"], c["torch_path"]):
            assert 0 < timing["p20_ms"] <= timing["p50_ms"] <= timing["p80_ms"]
        assert c["first_call_s"] > 0 and c["GBps"] > 0 and c["fraction_of_roofline"] > 0
        # the binding ceiling is the one with the larger floor (tiny sizes: either may bind)
        compute = c["fraction_of_compute_ceiling"] or 0.0
        assert c["bound_by"] == ("compute" if compute > c["fraction_of_copy_bandwidth"] else "memory")
        assert c["fraction_of_roofline"] == max(compute, c["fraction_of_copy_bandwidth"])
        assert (c["op"] == "accumulate") == (c["compute_ceiling"] is None)
        assert c["speedup_vs_torch_path"] == pytest.approx(c["torch_path"]["p50_ms"] / c["kernel"]["p50_ms"])
        assert c["config"]["BLOCK_N"] >= 1  # the tile configuration the launch ran with
        if c["op"] != "accumulate":
            assert c["l2_bytes"] > 0 and c["fraction_of_l2_bandwidth"] > 0
    used = stages["kernels"]["result"]["ceilings_used"]
    assert used["copy_GBps"] == pytest.approx(ceilings["copy"]["GBps"])


def test_e2e_measures_both_modes_against_the_forward_and_extrapolates_10m(dry):
    e2e = dry[2]["stages"]["e2e"]["result"]
    runs = e2e["runs"]
    seq = e2e["seq_len"]
    assert runs["bert_head"]["tokens"] == 16 * seq and runs["bert_head"]["mode"] == "head"
    jvp = runs["bert_jvp_last_layer"]
    assert jvp["mode"] == "jvp" and jvp["tokens"] == 8 * seq
    assert jvp["cut_stage"] == e2e["bert"]["layers"]  # embeddings + all but the last layer cached
    for name in ("bert_head", "bert_jvp_last_layer", "minilm_head_128", "minilm_head_256"):
        assert runs[name]["valid_fraction"] == 1.0, name
        assert runs[name]["vs_forward"] > 0
    assert e2e["bert"]["staged"] and not e2e["failed_checks"]
    ten = runs["minilm_head_10M"]
    assert ten["tokens"] == 10_000_000 and ten["measured"] is False
    assert ten["note"].startswith("extrapolated") and ten["tokens_per_s"] > 0
    assert "synthetic" in e2e["token_source"]["minilm"]  # the path a bare GPU machine takes


def test_a_hung_and_a_failing_stage_are_recorded_and_the_others_still_run(failing):
    proc, out = failing
    done, report = _finish(proc, out, timeout=180)
    assert done.returncode == 1
    stages = report["stages"]
    assert stages["env"]["status"] == "timeout" and "cap 3 s" in stages["env"]["error"]
    assert stages["ceilings"]["status"] == "ok"  # a fresh worker after the hang
    assert stages["kernels"]["status"] == "error" and "injected" in stages["kernels"]["error"]
    for name in ("build", "tests", "e2e"):
        assert stages[name] == {"status": "skipped", "seconds": 0.0, "reason": "not selected"}
    md = (out / "gpu-check.md").read_text()
    assert "| env | timeout |" in md and "| kernels | error |" in md


def test_budget_arithmetic_and_roofline():
    caps = {s: 100.0 for s in STAGES}
    floors = {s: 10.0 for s in STAGES}
    # 50 s left with two later stages needing 10 s each: 30 s for this one
    assert gc.stage_timeout("ceilings", list(STAGES), 0.0, 100.0, caps, floors, 50.0) == 30.0
    assert gc.stage_timeout("e2e", list(STAGES), 0.0, 100.0, caps, floors, 0.0) == 100.0
    # 1 GFLOP and 1 GB in 1 ms against 10 TFLOP/s and 2 TB/s: the bytes bind (0.5 ms floor)
    r = gc.roofline(1e9, 1e9, 10.0, 2000.0, 1.0)
    assert r["bound_by"] == "memory" and r["fraction_of_roofline"] == pytest.approx(0.5)
    assert r["fraction_of_compute_ceiling"] == pytest.approx(0.1)
    assert gc.roofline(1e9, 1e9, None, None, 1.0).get("bound_by") is None


def test_gpu_plan_fills_the_chip_and_meets_the_issue():
    cases = gc.kernel_cases(gpu=True)
    assert {c["op"] for c in cases} == {"head_stack", "head_stats", "project", "accumulate"}
    assert cases[0]["op"] == "head_stack" and cases[0]["dtype"] == "bfloat16"  # the new default
    assert {c["dtype"] for c in cases} == {"float32", "bfloat16"}
    assert any(c.get("precision") == "tf32" for c in cases)
    for c in cases:
        rows, width = c["n"], c.get("d_in", c.get("dim"))
        assert rows * width * 4 >= 64 * 2**20, c  # inputs well past the 60 MB L2
    plan = gc.e2e_plan(gpu=True)
    assert plan["bert"]["config"] == {}  # BertConfig() defaults: BERT-base
    assert max(plan["minilm"]["sizes"]) * plan["seq_len"] >= 1_000_000  # the 10M extrapolation base
    assert plan["minilm"]["config"]["hidden_size"] == 384
