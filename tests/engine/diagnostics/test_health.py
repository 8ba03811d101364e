"""The virtual objective's health (normfast.engine.diagnostics.health): the loss against its chance
level and the gradient scale are measured, stored and said, and a saturated objective is its own
regime class, on models built to saturate or not."""

from __future__ import annotations

import html
import math

import numpy as np
import pytest
import torch
from torch import nn

from normfast.data import schema
from normfast.encoders import ModuleEncoder
from normfast.engine.diagnostics.health import health_line, objective_health
from normfast.engine.diagnostics.regime import LAW, NOT_APPLICABLE, SATURATED, classify_rows, headline
from normfast.engine.directions.objectives import SATURATED_BELOW, InfoNCE, Objective, SimCSE, SupCon
from normfast.engine.probe import ProbeConfig, probe

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_loss_is_averaged_with_its_error_over_the_batch_groups():
    losses = {b: 1.0 + (b % 4) for b in range(16)}  # group g always gives 1 + g
    stats = {b: (v, 2.0 * v) for b, v in losses.items()}
    h = objective_health(stats, batch_size=32, groups=4, objective=SimCSE())
    assert h["batches"] == 16 and h["loss_mean"] == pytest.approx(2.5)
    assert h["loss_se"] == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)  # over the 4 group means
    assert h["chance"] == pytest.approx(math.log(32)) and h["loss_to_chance"] == pytest.approx(2.5 / math.log(32))
    assert h["grad_norm"]["median"] == pytest.approx(5.0) and not h["saturated"]
    tiny = objective_health({b: (1e-5, 1e-3) for b in range(8)}, batch_size=16, groups=8, objective=SimCSE())
    assert tiny["saturated"] and tiny["saturated_below"] == SimCSE.saturated_below == SATURATED_BELOW
    assert "SATURATED" in health_line(tiny) and "log 16" in health_line(tiny)
    assert objective_health({}, 32, 8, SimCSE()) == {"batches": 0} and health_line({"batches": 0}) is None


def test_the_chance_level_and_the_saturation_rule_are_the_objectives():
    stats = {b: (1e-5, 1e-3) for b in range(8)}
    # SupCon's uniform guess is among the B - 1 other rows
    supcon = objective_health(stats, batch_size=16, groups=8, objective=SupCon())
    assert supcon["chance"] == pytest.approx(math.log(15)) and supcon["chance_formula"] == "log (16-1)"
    assert "log (16-1) = 2.71" in health_line(supcon)

    class Margin(Objective):  # a hinge loss: no chance level, near 0 when it has done its work
        name, summary, needs = "margin", "pairs", "pairs"

    for objective in (Margin(), lambda za, zb=None, labels=None: za.sum()):  # declared none, or a bare loss
        h = objective_health(stats, batch_size=16, groups=8, objective=objective)
        assert h["chance"] is None and h["saturated_below"] is None and not h["saturated"], h
        assert math.isnan(h["loss_to_chance"]) and "no chance level" in h["saturation"]
        line = health_line(h)
        assert "of chance" not in line and "not saturated; saturated: never by the loss-to-chance rule" in line


def test_a_saturated_objective_is_its_own_class_after_the_structural_checks():
    cols = {
        "valid": [True, True, True, False],
        "kappa": [1.0, 0.1, 1.0, 1.0],
        "kappa_exempt": [0.0, 0.0, 0.0, 0.0],
        "D": [5.0, 5.0, 1e-6, 1.0],
        "se_D": [0.1, 0.1, 0.1, 0.1],
        "Q": [1.0] * 4,
    }
    plain = classify_rows(cols, lr=0.1, weight_decay=0.1)
    saturated = classify_rows(cols, lr=0.1, weight_decay=0.1, saturated=True)
    assert list(plain["regime"])[0] == LAW
    assert list(saturated["regime_reason"]) == ["objective_saturated", "kappa_small", "objective_saturated", "invalid"]
    assert list(saturated["regime"]) == [SATURATED, NOT_APPLICABLE, SATURATED, NOT_APPLICABLE]


def _encoder(x: torch.Tensor) -> ModuleEncoder:
    torch.manual_seed(0)
    return ModuleEncoder([nn.Linear(x.shape[1], 16), nn.Linear(16, 8)], collate=lambda ids: x[torch.as_tensor(ids)])


def _run(pairs, temperature: float, tmp_path, name: str):
    n = 24
    x = torch.eye(n) * 5.0  # distinct items, far apart
    cfg = ProbeConfig(lr=0.05, weight_decay=0.01, batches=4, drift_batches=16, batch_size=12, chunk_size=24)
    return probe(
        _encoder(x),
        list(range(n)),
        InfoNCE(temperature=temperature),
        pairs(n),
        cfg,
        out=tmp_path / f"{name}.parquet",
        progress=False,
    )


def test_an_objective_with_no_task_left_is_reported_saturated(tmp_path):
    # each item its own positive, at a low temperature: the loss is ~0 and the gradients with it
    saturated = _run(lambda n: [(i, i) for i in range(n)], 0.005, tmp_path, "saturated")
    health = saturated.metadata["objective_health"]
    assert health["batches"] == 16 and health["saturated"], health
    assert health["loss_to_chance"] < InfoNCE.saturated_below
    assert saturated.metadata["regime"]["regime"] == SATURATED
    assert set(saturated.column("regime")) <= {SATURATED, NOT_APPLICABLE}
    text = saturated.format_summary()
    lines = text.splitlines()
    assert lines[1].startswith("regime: OBJECTIVE SATURATED for")
    assert lines[4].startswith("virtual objective: loss") and "SATURATED" in lines[4] and "(log 12 =" in lines[4]
    assert "Here the virtual objective is saturated: the fit tests nothing" in text
    assert not schema.check_metadata(saturated.metadata)
    # the run's page says it too, with what to change, and the stored loss
    page = saturated.to_html(tmp_path / "saturated.html").read_text()
    assert "regime: OBJECTIVE SATURATED for" in page and "A higher --temperature" in page
    assert html.escape(lines[4]) in page
    # pairs of different items: a task, and a loss near its chance level
    healthy = _run(lambda n: [(i, (i + 1) % n) for i in range(n)], 0.1, tmp_path, "healthy")
    h = healthy.metadata["objective_health"]
    assert not h["saturated"] and h["loss_to_chance"] > 0.1
    assert h["grad_norm"]["median"] > 1e3 * health["grad_norm"]["median"]
    assert SATURATED not in set(healthy.column("regime"))
    assert "objective saturated" not in healthy.format_summary().splitlines()[1]


def test_the_headline_of_a_saturated_run_says_what_to_change():
    regime = {
        "regime": SATURATED,
        "reason": "objective_saturated",
        "fractions": {LAW: 0.0, SATURATED: 1.0, NOT_APPLICABLE: 0.0},
        "explanation": "the virtual objective is saturated (...); a higher --temperature ...",
    }
    lines = headline(regime)
    assert lines[0] == "regime: OBJECTIVE SATURATED for 100% of rows (law applicable 0%, not applicable 0%)"
    assert "--temperature" in lines[1] and "not predictions" in lines[2]
    healthy = dict(regime, regime=LAW, fractions={LAW: 1.0, SATURATED: 0.0, NOT_APPLICABLE: 0.0})
    assert "saturated" not in headline(healthy)[0]  # the class is named only when it is there
