"""The experiment harness: ``python -m bench list | run | tables``, every experiment's quick run, and
the committed quick results that ``--quick`` must reproduce.

Each experiment runs its quick size once in the suite: here, or in its own module (e2:
test_e2.py, e3/e4: test_e3_e4.py, e5: test_e5.py, gpu_check: test_gpu_check.py, throughput:
test_benchmark.py). A deterministic quick run must give the JSON committed in
bench/results/NAME/quick exactly, apart from the fields that describe the clock or the machine
(:func:`bench.harness.comparable`); its command is in ``conftest.QUICK_COMMANDS`` and in
bench/results/README.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import numpy as np
import pytest

from bench import catalog
from bench.harness import EXPERIMENTS, QUICK, RESULTS_DIR, comparable, load, quick_dir
from tests.conftest import QUICK_COMMANDS, assert_reproduces, run_bench

ROOT = Path(__file__).resolve().parents[2]


def quick(tmp_path: Path, name: str, *extra: str) -> tuple[Path, str]:
    """``python -m bench run NAME --quick`` (or its committed quick command) into ``tmp_path``."""
    argv = QUICK_COMMANDS.get(name, (["--quick"], ()))[0]
    printed = run_bench(tmp_path, name, *argv, "--no-progress", "--out", str(tmp_path / name), *extra)
    return tmp_path / name, printed


# ---------------------------------------------------------------------------
# the runner


def test_list_names_every_experiment_and_imports_no_torch():
    done = subprocess.run(
        [sys.executable, "-m", "bench", "list"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line and not line[0].isspace()]
    assert listed == list(EXPERIMENTS)
    check = "import sys, bench; bench.catalog(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", "the catalog imported torch: keep heavy imports inside run()"


def test_catalog_covers_every_committed_file_and_block():
    from bench.tables import EXTRA, render_all

    rows = catalog()
    assert [r["name"] for r in rows] == list(EXPERIMENTS)
    for r in rows:
        assert r["command"] == f"python -m bench run {r['name']} --out bench/results/{r['name']}"
        assert r["title"] and r["protocol"].startswith(r["title"].split(" ")[0]) and len(r["protocol"]) > 200
        assert r["results"] and all(f.endswith(".json") for f in r["results"])
        assert all(f.endswith(".png") for f in r["figures"])
    # two product outputs, no experiment's: what `normfast demo` printed, and the page's screenshot
    # (docs/view.md gives the command that writes it)
    assert "--screenshot bench/results/demo/demo_view.png" in (ROOT / "docs" / "view.md").read_text()
    claimed = {f"{r['name']}/{f}" for r in rows for f in r["results"] + r["figures"]}
    claimed |= {"demo/demo_output.txt", "demo/demo_view.png", "README.md", ".gitignore"}
    # (a study in progress keeps its finished units in OUT/partial/, ignored by git)
    committed = {
        p.relative_to(RESULTS_DIR).as_posix()
        for p in RESULTS_DIR.rglob("*")
        if p.is_file() and p.parent.name not in (QUICK, "partial")
    }
    assert not committed - claimed, f"committed results no experiment writes: {sorted(committed - claimed)}"
    blocks = {b for r in rows for b in r["tables"]}
    assert blocks.isdisjoint(EXTRA) and set(render_all()) <= blocks | set(EXTRA)
    pages = "".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
    for name in render_all():  # every block is shown somewhere: the README or a docs page
        assert f"<!-- results:{name} -->" in pages, name


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_has_the_contract(name):
    from bench.cli import config_parser

    m = load(name)
    assert is_dataclass(m.Config) and callable(m.run)
    full, small = m.Config(), m.Config.quick()
    assert isinstance(small, m.Config)
    assert name == "roofline" or small != full, "quick() must shrink something"
    options = {o for a in config_parser(name, m)._actions for o in a.option_strings}
    for f in fields(m.Config):
        if f.name != "seed":
            assert any(o.lstrip("-").replace("no-", "", 1) == f.name.replace("_", "-") for o in options), f.name
    assert "sys.path" not in Path(m.__file__).read_text()


def test_options_replace_the_quick_config_and_the_printed_command_reproduces_it():
    from bench.cli import build_config, config_parser, reproduce

    m = load("e4")
    args = config_parser("e4", m).parse_args(["--quick", "--queries", "40", "--select-on", "all", "--seed", "5"])
    cfg = build_config(m, args)
    assert (cfg.queries, cfg.distractors, cfg.select_on) == (40, 500, "all")
    command = reproduce("e4", m, cfg, True, 5, None)
    assert command == "python -m bench run e4 --quick --queries 40 --select-on all --seed 5"
    again = build_config(m, config_parser("e4", m).parse_args(command.split()[5:]))
    assert again == cfg
    m = load("gpu_check")
    args = config_parser("gpu_check", m).parse_args(["--inject", "env=hang", "--inject", "kernels=error"])
    assert build_config(m, args).inject == ("env=hang", "kernels=error")
    with pytest.raises(ValueError, match="--inject"):
        build_config(m, config_parser("gpu_check", m).parse_args(["--inject", "nowhere=error"]))


def test_the_quick_results_readme_lists_each_command():
    readme = (RESULTS_DIR / "README.md").read_text()
    for name, (argv, files) in QUICK_COMMANDS.items():
        command = f"python -m bench run {name} {' '.join(argv)} --out bench/results/{name}/quick"
        assert f"| {name} | `{command}` | {', '.join(files)} |" in readme, name
        assert all((quick_dir(name) / f).is_file() for f in files), name


def test_quick_results_compare_with_rounding_tolerance_and_fail_on_a_real_change():
    """Another CPU code path moves the last bits of float32 results: that passes; a result moved by
    1e-3, an integer, a string or a changed structure does not."""
    from bench.harness import QUICK_RTOL, differences

    want = json.loads((quick_dir("e1") / "equilibrium.json").read_text())
    want = comparable(want)
    fit = want["results"][0]["fits"]["full_law"]

    def moved(change):
        got = json.loads(json.dumps(want))
        change(got)
        return differences(got, want)

    assert moved(lambda g: None) == []
    # float32 rounding, as on another machine (the example: 1.2424064874649048 vs 1.2424062490463257)
    assert differences(1.2424064874649048, 1.2424062490463257) == []
    assert moved(lambda g: g["results"][0]["fits"]["full_law"].update(slope=fit["slope"] * (1 + 1e-6))) == []
    assert QUICK_RTOL < 1e-3
    (line,) = moved(lambda g: g["results"][0]["fits"]["full_law"].update(slope=fit["slope"] * (1 + 1e-3)))
    assert line.startswith("/results[0]/fits/full_law/slope: ")
    assert moved(lambda g: g["results"][0].update(variant="mlp_bias"))  # a string
    assert moved(lambda g: g["config"].update(steps=g["config"]["steps"] + 1))  # an integer
    assert moved(lambda g: g["results"].pop())  # the structure
    assert moved(lambda g: g["results"][0]["fits"].pop("full_law"))


def test_run_refuses_unknown_names_and_bad_settings(capsys):
    from bench.cli import main

    assert main(["run", "e9"]) == 2 and "unknown experiment 'e9'" in capsys.readouterr().err
    assert main(["run", "e3", "--words", "1"]) == 2 and "words >= 2" in capsys.readouterr().err


def test_tables_check_finds_a_stale_block(tmp_path):
    from bench import tables
    from bench.cli import main

    good = "".join(f"<!-- results:{n} -->\n{t}\n<!-- /results:{n} -->\n\n" for n, t in tables.render_all().items())
    path = tmp_path / "page.md"
    path.write_text(good)
    assert tables.check(path) == [] and main(["tables", "--check", str(path)]) == 0
    path.write_text(
        good.replace("<!-- /results:quartic -->", "1\n<!-- /results:quartic -->")
        + "<!-- results:nosuch -->\n|x|\n<!-- /results:nosuch -->\n"
    )
    assert tables.check(path) == ["quartic", "nosuch"] and main(["tables", "--check", str(path)]) == 1
    main(["tables", "--write", str(path)])
    assert tables.check(path) == ["nosuch"]


# ---------------------------------------------------------------------------
# quick runs (the experiments without a test module of their own)


@pytest.mark.quick
def test_e1_quick(tmp_path, capsys):
    """E1 through the runner (``python -m bench run e1``)."""
    from bench.cli import main

    # 1000 steps instead of --quick's 3000: what is checked here (κ, the ledger's closure, the files)
    # holds exactly at any length
    rc = main(["run", "e1", *QUICK_COMMANDS["e1"][0], "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert_reproduces("e1", tmp_path)
    assert "| 0 | MLP, no biases | " in printed and "| 0 | embedding table | " in printed and "min CPU" in printed
    summary = json.loads((tmp_path / "equilibrium.json").read_text())
    assert summary["timing"]["cpu_seconds"] > 0
    # the ledger: every variant, every term, and the realized terms add up to the realized change
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert [r["variant"] for r in ledger["results"]] == ["mlp", "table"]
    for r in ledger["results"]:
        assert set(r["terms"]) >= {"task1", "task2", "decay", "remainder"}
        assert r["closure"]["telescoping_max_abs_error"] < 1e-12
    assert (tmp_path / "ledger.png").stat().st_size > 0
    mlp, table = summary["results"]
    assert mlp["variant"] == "mlp" and table["variant"] == "table"
    # bias-free 2-layer ReLU network: kappa = 2 exactly; a free table: kappa = 1 and no drift
    assert mlp["kappa"]["min"] == pytest.approx(2.0, abs=1e-5) and mlp["kappa"]["max"] == pytest.approx(2.0, abs=1e-5)
    assert table["kappa"]["min"] == pytest.approx(1.0, abs=1e-6)
    assert table["drift_over_heat_median"] < 1e-4
    for res in summary["results"]:
        assert len(res["observed"]) == len(res["predicted_full"]) == res["items"]
        assert np.all(np.asarray(res["observed"]) > 0)
    assert (tmp_path / "equilibrium.png").stat().st_size > 0
    assert main(["run", "e1", "--variants", "bogus", "--out", str(tmp_path)]) == 2


def test_roofline_quick_is_the_committed_prediction(tmp_path):
    """Its quick run is the whole prediction: it must equal the committed one."""
    out, printed = quick(tmp_path, "roofline")
    got = json.loads((out / "roofline.json").read_text())
    assert comparable(got) == comparable(json.loads((RESULTS_DIR / "roofline" / "roofline.json").read_text()))
    assert "reproduce with: python -m bench run roofline --quick" in printed


def test_quartic_and_accumulate_quick(tmp_path):
    out, printed = quick(tmp_path, "quartic")
    d = json.loads((out / "quartic.json").read_text())
    for workload in ("general", "biquadratic"):
        a = d["agreement"][workload]
        assert a["rows_compared"] > 0 and a["max_rel_diff"] < 1e-8
        assert a["only_normfast_finds_a_root"] == a["only_baseline_finds_a_root"] == 0
    assert d["rows"] == 2000 and "| general quartic" in printed
    out, printed = quick(tmp_path, "accumulate")
    (case,) = json.loads((out / "accumulate.json").read_text())["cases"]
    assert max(case["errors"]["normfast"].values()) < 1e-5 and case["speedup"] > 0
    assert "| 200 | 8 |" in printed


def test_head_stats_quick(tmp_path):
    out, printed = quick(tmp_path, "head_stats")
    d = json.loads((out / "head_stats.json").read_text())
    r = d["results"]["8"]
    assert max(r["accuracy_max_error"].values()) < 1e-4
    assert set(r["speedup_vs_naive"]) == {"grouped", "S", "per_batch"} and d["config"]["groups"] >= 2
    assert "| grouped, with error bars (the default) |" in printed


@pytest.mark.quick
def test_adaptive_m_quick(tmp_path):
    out, _ = quick(tmp_path, "adaptive_m")
    assert_reproduces("adaptive_m", out)
    d = json.loads((out / "adaptive_m.json").read_text())
    assert d["runs"]["fixed_M16"]["M"] == 16 and d["runs"]["adaptive"]["M"] >= 16
    assert 0 <= d["runs"]["adaptive"]["V2_resolved_to_20pct"] <= 1


@pytest.mark.quick
@pytest.mark.needs_data("wordnet")  # its pairs are WordNet's (lemma, gloss)
def test_monitor_quick(tmp_path):
    """The training monitor's end-to-end example at toy size: SentenceTransformerTrainer fine-tunes a head on
    the real MiniLM with normfast.MonitorCallback on; the report's fits, the monitor's own clock and the
    control run's are in the JSON, the report's figure beside it."""
    from normfast.engine.monitor.readout import check_report

    for extra in ("sentence_transformers", "datasets", "accelerate"):
        pytest.importorskip(extra, reason="the monitor experiment needs normfast[train]")
    out, printed = quick(tmp_path, "monitor")
    assert_reproduces("monitor", out)
    d = json.loads((out / "monitor.json").read_text())
    r = d["report"]
    assert r["optimizer"] == "AdamW" and r["law"] == "adamw" and r["n_items"] == d["config"]["probes"] == 6
    assert r["recorded_steps"] == d["config"]["steps"] // d["config"]["every"] == 3 and r["virtual"] == 2
    assert set(r["fits"]) >= {"realized_law", "virtual_law", "virtual_heat_only", "virtual_last_state"}
    assert len(d["items"]["observed"]) == 6 and np.all(np.asarray(d["items"]["observed"]) > 0)
    clock = d["timing"]["monitor_clock"]
    assert clock["steps"] == 6 and clock["terms_seconds"] > 0 and clock["virtual_seconds"] > 0
    assert d["timing"]["control"]["seconds_per_step_without"] > 0
    assert (tmp_path / "runs" / "monitor" / "quick_monitor" / "monitor.parquet").is_file()
    # with the virtual probe: the report's files hold its columns too, all registered
    report = json.loads((tmp_path / "runs" / "monitor" / "quick_monitor" / "report.json").read_text())
    assert check_report(report) == [] and {"r_eq_virtual", "virtual_kappa"} <= set(report["items"])
    assert (out / "monitor.png").stat().st_size > 10_000
    assert "| law from the realized terms (window means) |" in printed and "| per stored row (s) |" in printed


def quick_in_process(tmp_path: Path, name: str, capsys) -> tuple[Path, str]:
    """:func:`quick` without a new interpreter (no second torch import: the suite's time budget)."""
    from bench.cli import main

    out = tmp_path / name
    assert main(["run", name, *QUICK_COMMANDS[name][0], "--no-progress", "--out", str(out)]) == 0
    return out, capsys.readouterr().out


@pytest.mark.quick
def test_e1_counterfactual_quick(tmp_path, capsys):
    """One change (λ x4) asked of a toy E1 snapshot: the observed continuation moved the norms the way
    more decay does, every T was asked (at least 50 steps), and the verdict and table are written."""
    out, printed = quick_in_process(tmp_path, "e1_counterfactual", capsys)
    assert_reproduces("e1_counterfactual", out)
    d = json.loads((out / "e1_counterfactual.json").read_text())
    (r,) = d["results"]
    (c,) = r["changes"]
    assert r["variant"] == "mlp" and c["change"] == "wd x4" and c["observed_over_present_median"] < 0.9
    assert [a["T_relaxations_asked"] for a in c["answers"]] == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert all(a["steps"] >= 50 and a["T_relaxations"] >= 0.99 * a["T_relaxations_asked"] for a in c["answers"])
    assert d["verdict"]["per_change"][0]["change"] == "wd x4" and "Protocol (v1" not in d["protocol"]
    assert (out / "e1_counterfactual.png").stat().st_size > 10_000
    assert "| 0 | MLP, no biases | wd x4 |" in printed and "`r_eq_snapshot`" in printed


def test_figures_are_redrawn_from_a_result_json(tmp_path, capsys):
    """``python -m bench figures NAME --json FILE --out DIR``: the figure from the committed quick JSON; clear
    errors for a missing file and for an experiment whose figures are not drawn from its JSON."""
    from bench.cli import main

    src = quick_dir("e1_counterfactual") / "e1_counterfactual.json"
    assert main(["figures", "e1_counterfactual", "--json", str(src), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "e1_counterfactual.png").stat().st_size > 10_000
    assert main(["figures", "e1_counterfactual", "--json", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 2
    assert "no such result file" in capsys.readouterr().err
    assert main(["figures", "e1", "--json", str(src), "--out", str(tmp_path)]) == 2  # not an E1 result
    assert "figures need 'observed'" in capsys.readouterr().err
    assert main(["figures", "e1", "--json", str(quick_dir("e1") / "equilibrium.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "equilibrium.png").stat().st_size > 10_000
    assert main(["figures", "e1_adamw", "--json", str(src), "--out", str(tmp_path)]) == 2
    assert "has no figures to redraw" in capsys.readouterr().err


@pytest.mark.quick
def test_e1_adamw_quick(tmp_path, capsys):
    """Two of the AdamW investigation's runs at toy size: each is measured at every step (the meter's
    sample count is the run's length), its own mean norm is a norm of the same model (close to the
    observed), and every read-out is in the JSON and the table."""
    out, printed = quick_in_process(tmp_path, "e1_adamw", capsys)
    assert_reproduces("e1_adamw", out)
    (r,) = json.loads((out / "e1_adamw.json").read_text())["results"]
    assert r["variant"] == "mlp_adamw" and set(r["runs"]) == {"V0", "R1"}
    assert r["runs"]["V0"]["ingredients"]["steps"] == 300 and r["runs"]["R1"]["ingredients"]["steps"] == 200
    for x in r["runs"].values():
        assert 0.8 < x["own_mean_norm_over_observed_median"] < 1.25
        assert np.isfinite([x["law"]["slope"], x["law_with_curvature"]["pearson_r"], x["Q_w_over_real_median"]]).all()
    assert "| 0 | MLP, AdamW β1 = 0.9 | R1 | window start | seeded | 200 | e1 | fresh |" in printed


@pytest.mark.quick
def test_e1_drift_quick(tmp_path):
    out, printed = quick(tmp_path, "e1_drift")
    assert_reproduces("e1_drift", out)
    (r,) = json.loads((out / "e1_drift.json").read_text())["results"]
    assert r["variant"] == "mlp" and r["groups"] == 2 and len(r["precision"]) >= 2
    assert all(np.isfinite([p["slope"], p["pearson_r"]]).all() for p in r["precision"])
    assert "| MLP, no biases |" in printed


@pytest.mark.quick
def test_calibration_quick(tmp_path):
    out, printed = quick(tmp_path, "calibration")
    assert_reproduces("calibration", out)
    d = json.loads((out / "calibration.json").read_text())
    assert set(d["results"]) == {"mlp"} and d["decision"]["default_K"] in (2, 4)
    for k in ("2", "4"):
        for q, c in d["results"]["mlp"][k].items():
            if isinstance(c, dict):
                assert 0 <= c["ci95"][0] <= c["coverage"] <= c["ci95"][1] <= 1, (k, q)
    assert (out / "calibration.png").stat().st_size > 1000 and "| MLP, no biases (jvp) |" in printed


def test_streaming_quick(tmp_path):
    out, printed = quick(tmp_path, "streaming")
    d = json.loads((out / "streaming.json").read_text())
    (r,) = d["runs"]
    assert r["rows"] == r["expected_rows"] >= 2000 and r["chunks_computed"] == r["chunks"]
    assert r["peak_rss_bytes"] > r["rss_before_probe_bytes"] > 0 and d["resume_check"] is None
    assert (out / "streaming.png").stat().st_size > 1000 and "Resume check: not run." in printed


def test_kernel_resources_quick(tmp_path):
    """Compiles for real (TRITON_INTERPRET=0), so in a fresh process, as the README runs it."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "run", "kernel_resources", "--quick", "--no-progress", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("no ptxas available to lower for a CUDA target")
    assert done.returncode == 0, done.stderr[-3000:]
    d = json.loads((tmp_path / "kernel_resources.json").read_text())
    assert len(d["variants"]) == 1 and d["complete"] is False and d["failing"] == 0
    assert all(v["registers"] > 0 and v["problems"] == [] for v in d["variants"])


@pytest.mark.parametrize("name", ["corpus", "judgments"])
def test_gensim_experiments_quick(tmp_path, name):
    pytest.importorskip("gensim")
    out, printed = (
        quick(tmp_path, name, "--probe-dir", str(tmp_path / "probes")) if name == "corpus" else quick(tmp_path, name)
    )
    d = json.loads((out / load(name).RESULTS[0]).read_text())
    assert d["quick"] is True and list(d["models"]) == ["all-MiniLM-L6-v2"]
    assert f"## {name}" in printed


def test_e1_ledger_table_says_na_for_a_lag_the_window_cannot_hold():
    """A short window has too few blocks for the lag-5 autocorrelation: the table says n/a (it used to raise)."""
    from bench.experiments.e1 import table_e1_ledger

    ledger = json.loads((quick_dir("e1") / "ledger.json").read_text())
    for r in ledger["results"]:
        r["drift_time_structure"]["block_autocorrelation_by_lag"].pop("5", None)
    text = table_e1_ledger(ledger)
    assert " / n/a, r " in text and "MLP, no biases" in text


def test_a_resumable_unit_is_kept_until_the_result_is_written(tmp_path):
    """An interrupted study repeats only its unfinished units: a unit's result is kept in
    OUT/partial/, reused for the same key and recomputed for another; drop_partial clears it."""
    from bench.harness import Context, drop_partial, resumable

    ctx = Context(out=tmp_path)
    calls = []

    def compute(value):
        def go():
            calls.append(value)
            return {"model": "mlp", "value": value}

        return go

    key = {"size": "quick", "steps": 600, "seeds": (0, 1)}
    assert resumable(ctx, "mlp", key, compute(1)) == {"model": "mlp", "value": 1}
    assert (tmp_path / "partial" / "mlp.json").is_file()
    assert resumable(ctx, "mlp", dict(key), compute(2)) == {"model": "mlp", "value": 1}  # kept (tuples too)
    assert resumable(ctx, "mlp", {**key, "steps": 700}, compute(3)) == {"model": "mlp", "value": 3}
    (tmp_path / "partial" / "other.json").write_text("{trunc")  # an interrupted write: recomputed
    assert resumable(ctx, "other", key, compute(4)) == {"model": "mlp", "value": 4}
    assert calls == [1, 3, 4]
    drop_partial(ctx, ["mlp", "other"])
    assert not (tmp_path / "partial").exists()
