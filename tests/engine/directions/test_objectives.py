"""Virtual objectives: scale invariance, brute-force values, validation, the registry and what every
objective declares (its settings, its chance level, its saturation rule)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from normfast.engine.directions.objectives import (
    NEEDS,
    CLIPLoss,
    InfoNCE,
    Objective,
    Setting,
    SimCSE,
    SupCon,
    check_scale_invariance,
    get_objective,
    objective_classes,
    register,
)

B, D = 7, 5


@pytest.fixture
def embeddings(gen):
    za = torch.randn(B, D, generator=gen, dtype=torch.float64)
    zb = za + 0.5 * torch.randn(B, D, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 3])  # class 2 and 3 appear once
    return za, zb, labels


ALL = [
    (InfoNCE(), False),
    (InfoNCE(temperature=0.2, symmetric=True), False),
    (CLIPLoss(), False),
    (SupCon(), True),
    (SimCSE(), False),
]


def call(objective, za, zb, labels, needs_labels):
    if needs_labels:
        return objective.loss(za, labels=labels)
    return objective.loss(za, zb)


@pytest.mark.parametrize("objective,needs_labels", ALL, ids=lambda o: repr(o))
def test_random_row_scaling_leaves_loss_unchanged(embeddings, gen, objective, needs_labels):
    za, zb, labels = embeddings
    base = call(objective, za, zb, labels, needs_labels)
    for _ in range(3):
        sa = torch.exp(3 * torch.randn(B, 1, generator=gen, dtype=torch.float64))
        sb = torch.exp(3 * torch.randn(B, 1, generator=gen, dtype=torch.float64))
        scaled = call(objective, za * sa, zb * sb, labels, needs_labels)
        assert abs(scaled.item() - base.item()) <= 1e-5 * abs(base.item())
    assert check_scale_invariance(objective, za, None if needs_labels else zb, labels if needs_labels else None)


@pytest.mark.parametrize("objective,needs_labels", ALL, ids=lambda o: repr(o))
def test_gradient_is_orthogonal_to_each_embedding(embeddings, objective, needs_labels):
    # d/ds L(s z_i) = z_i . grad_i = 0 for a scale-invariant loss
    za, zb, labels = embeddings
    za = za.clone().requires_grad_(True)
    zb = zb.clone().requires_grad_(True)
    loss = call(objective, za, zb, labels, needs_labels)
    loss.backward()
    radial = (za.grad * za).sum(1)
    assert radial.abs().max() < 1e-10 * za.grad.norm()
    assert za.grad.norm() > 0


def test_check_scale_invariance_warns_for_raw_dot_products(embeddings):
    za, zb, _ = embeddings

    def dot_infonce(a, b, labels=None):
        logits = a @ b.T
        return torch.nn.functional.cross_entropy(logits, torch.arange(a.shape[0]))

    with pytest.warns(UserWarning, match="dot_infonce"):
        assert check_scale_invariance(dot_infonce, za, zb) is False

    class RawDot(Objective):
        name = "raw-dot"

        def loss(self, za, zb=None, labels=None):
            return dot_infonce(za, zb)

    with pytest.warns(UserWarning, match="raw-dot"):
        assert not check_scale_invariance(RawDot(), za, zb)


def test_check_scale_invariance_is_silent_when_invariant(embeddings):
    za, zb, _ = embeddings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_scale_invariance(InfoNCE(), za.float(), zb.float())


def brute_info_nce(za, zb, t):
    a = [za[i] / za[i].norm() for i in range(len(za))]
    b = [zb[i] / zb[i].norm() for i in range(len(zb))]
    total = 0.0
    for i in range(len(a)):
        logits = [float(a[i] @ b[j]) / t for j in range(len(b))]
        total += -(logits[i] - math.log(sum(math.exp(x) for x in logits)))
    return total / len(a)


def test_infonce_and_clip_against_brute_force(embeddings):
    za, zb, _ = embeddings
    t = 0.07
    forward = brute_info_nce(za, zb, t)
    backward = brute_info_nce(zb, za, t)
    assert InfoNCE(t).loss(za, zb).item() == pytest.approx(forward, rel=1e-10)
    both = (forward + backward) / 2
    assert InfoNCE(t, symmetric=True).loss(za, zb).item() == pytest.approx(both, rel=1e-10)
    assert CLIPLoss(t).loss(za, zb).item() == pytest.approx(both, rel=1e-10)
    assert SimCSE(t).loss(za, zb).item() == pytest.approx(forward, rel=1e-10)


def brute_supcon(z, y, t):
    u = [z[i] / z[i].norm() for i in range(len(z))]
    terms = []
    for i in range(len(u)):
        others = [a for a in range(len(u)) if a != i]
        positives = [p for p in others if y[p] == y[i]]
        if not positives:
            continue
        denom = sum(math.exp(float(u[i] @ u[a]) / t) for a in others)
        total = sum(float(u[i] @ u[p]) / t - math.log(denom) for p in positives)
        terms.append(-total / len(positives))
    return sum(terms) / len(terms)


def test_supcon_against_brute_force(embeddings):
    za, zb, labels = embeddings
    y = labels.tolist()
    expected = brute_supcon(za, y, 0.1)
    assert SupCon(0.1).loss(za, labels=labels).item() == pytest.approx(expected, rel=1e-10)
    # two views: stacked, labels repeated
    both = torch.cat([za, zb])
    expected = brute_supcon(both, y + y, 0.3)
    assert SupCon(0.3).loss(za, zb, labels).item() == pytest.approx(expected, rel=1e-10)


def test_supcon_anchor_without_positive_only_acts_as_negative(embeddings):
    za, _, labels = embeddings
    # moving the singleton (class 3, row 6) changes the others' denominators, so the loss
    moved = za.clone()
    moved[6] = -moved[6]
    before = SupCon().loss(za, labels=labels).item()
    assert SupCon().loss(moved, labels=labels).item() != pytest.approx(before)


def test_supcon_without_any_positive_warns_and_is_zero(gen):
    za = torch.randn(4, 3, generator=gen, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="no anchor"):
        loss = SupCon().loss(za, labels=torch.arange(4))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(za.grad, torch.zeros_like(za))


def test_validation_errors(embeddings):
    za, zb, labels = embeddings
    with pytest.raises(ValueError, match="at least 2"):
        InfoNCE().loss(za[:1], zb[:1])
    with pytest.raises(ValueError, match="2-D"):
        InfoNCE().loss(za[0], zb[0])
    with pytest.raises(ValueError, match="zb"):
        InfoNCE().loss(za, zb[:, :3])
    with pytest.raises(ValueError, match="zb"):
        CLIPLoss().loss(za)
    with pytest.raises(ValueError, match="labels"):
        SupCon().loss(za)
    with pytest.raises(ValueError, match=f"{B} entries"):
        SupCon().loss(za, labels=labels[:-1])
    with pytest.raises(TypeError, match="integer"):
        SupCon().loss(za, labels=labels.double())
    with pytest.raises(TypeError, match="floating"):
        InfoNCE().loss(torch.ones(3, 2, dtype=torch.int64), torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        InfoNCE(temperature=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        check_scale_invariance(InfoNCE(), za[:1], zb[:1])
    with pytest.raises(TypeError, match="callable"):
        check_scale_invariance(42, za, zb)


def test_registry_and_attributes():
    assert isinstance(get_objective("infonce"), InfoNCE)
    assert isinstance(get_objective("InfoNCE", temperature=0.1), InfoNCE)
    assert get_objective("info_nce").temperature == 0.05
    clip = get_objective("clip")
    assert isinstance(clip, CLIPLoss) and clip.temperature == 0.07
    assert isinstance(get_objective("sup-con"), SupCon)
    simcse = get_objective("simcse")
    assert simcse.needs == "items" and simcse.uses_dropout
    assert get_objective("supcon").needs == "labels" and not get_objective("supcon").uses_dropout
    assert get_objective("clip").needs == "pairs"
    obj = SupCon()
    assert get_objective(obj) is obj
    with pytest.raises(ValueError, match="unknown objective"):
        get_objective("triplet")
    with pytest.raises(TypeError):
        get_objective(3)


@pytest.mark.parametrize("name", list(objective_classes()))
def test_every_registered_objective_declares_what_the_code_reads(name):
    cls = objective_classes()[name]
    made = cls()
    assert cls.name == name and cls.summary and cls.needs in NEEDS
    assert set(made.settings()) == {s.name for s in cls.declared_settings} | set(cls.fixed_settings)
    for setting in cls.declared_settings:
        assert setting.help and setting.flag == "--" + setting.name.replace("_", "-")
        assert getattr(made, setting.name) == setting.default
    # a softmax loss: chance is the loss of a uniform guess, and saturation the loss-to-chance rule
    za = torch.zeros(16, 4, dtype=torch.float64)
    za[:, 0] = 1.0  # every row the same direction: the loss cannot tell them apart
    labels = torch.tensor([0, 1] * 8)
    uniform = made.loss(za, labels=labels) if cls.needs == "labels" else made.loss(za, za.clone())
    assert float(uniform) == pytest.approx(made.chance_level(16))
    assert made.is_saturated(1e-3 * made.chance_level(16), 16) is False
    assert made.is_saturated(1e-5 * made.chance_level(16), 16) is True


def test_settings_are_checked_and_taken_in_order():
    assert InfoNCE(0.2, True).settings() == {"temperature": 0.2, "symmetric": True}
    assert CLIPLoss().settings() == {"temperature": 0.07, "symmetric": True}
    with pytest.raises(TypeError, match="unexpected setting"):
        CLIPLoss(symmetric=True)  # always symmetric: not a setting
    with pytest.raises(TypeError, match="True or False"):
        InfoNCE(symmetric="yes")
    with pytest.raises(TypeError, match="at most 1"):
        SimCSE(0.1, 0.2)


def test_register_refuses_an_objective_that_does_not_declare_enough():
    class Nameless(Objective):
        name, summary = "Nameless", "x"

    class Unsaid(Objective):
        name = "unsaid"

    class Clash(Objective):  # a temperature of another type than the shipped objectives' one flag
        name, summary = "clash", "x"
        declared_settings = (Setting("temperature", 1, "t", type=int),)

    with pytest.raises(ValueError, match="lower-case key"):
        register(Nameless)
    with pytest.raises(ValueError, match="summary is empty"):
        register(Unsaid)
    with pytest.raises(ValueError, match="one command-line flag serves both"):
        register(Clash)
    with pytest.raises(ValueError, match="already registered"):
        register(type("Other", (InfoNCE,), {}))
    assert "clash" not in objective_classes() and objective_classes()["infonce"] is InfoNCE
