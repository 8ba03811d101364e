"""One resolved plan per call: a probe call checks its ProbeConfig once, at its entry point, into a
frozen ProbePlan that every stage receives; the weights are scanned, the presets built and the
objective and pair source resolved once; the user's config is never rewritten, and a change made to it
between two calls is seen by the second (no cache keyed by the config's identity)."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

import normfast
from normfast.core import checks
from normfast.data import pairs as pairs_module
from normfast.engine.config import ProbeConfig, ProbePlan
from normfast.engine.directions import objectives
from normfast.engine.directions.presets import OptimizerPreset

pytestmark = pytest.mark.usefixtures("single_thread")


def _data():
    g = torch.Generator().manual_seed(3)
    items = torch.randn(6, 6, generator=g)
    src = normfast.PairSource.from_tensors(torch.randn(20, 6, generator=g), torch.randn(20, 6, generator=g))
    torch.manual_seed(0)
    return normfast.ModuleEncoder(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))), items, src


def _probe(enc, items, src, cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # toy model: scale-invariance notes
        return normfast.probe(enc, items, "infonce", src, cfg, progress=False, **kw)


def _count(monkeypatch, counts: Counter, name: str, func):
    """Count the calls of ``func`` wherever a loaded normfast module holds it (imported by name or not)."""

    def counted(*args, **kwargs):
        counts[name] += 1
        return func(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("normfast") and getattr(module, func.__name__, None) is func:
            monkeypatch.setattr(module, func.__name__, counted)


@pytest.fixture
def counts(monkeypatch):
    # loaded before the counting starts, so that no module takes a counting function as its own
    import normfast.engine.probe  # noqa: F401
    import normfast.engine.trajectory.snapshot  # noqa: F401

    counts: Counter = Counter()
    resolve = ProbeConfig.resolve
    monkeypatch.setattr(ProbeConfig, "resolve", lambda self: (counts.update(["resolve"]), resolve(self))[1])
    post_init = OptimizerPreset.__post_init__
    monkeypatch.setattr(
        OptimizerPreset, "__post_init__", lambda self: (counts.update([f"preset {self.name}"]), post_init(self))[1]
    )
    _count(monkeypatch, counts, "weight scan", checks.check_finite_weights)
    _count(monkeypatch, counts, "get_objective", objectives.get_objective)
    _count(monkeypatch, counts, "as_pair_source", pairs_module.as_pair_source)
    return counts


@pytest.mark.parametrize("snapshot", [False, True], ids=["plain", "snapshot"])
def test_one_probe_call_checks_its_config_once(tmp_path, counts, snapshot):
    """Following ``config`` through one call that writes a file (and, with ``snapshot=True``, runs the
    virtual trajectory and its meter): one check, one weight scan, one preset, one objective and pair
    source; the config itself is left as it was given."""
    enc, items, src = _data()
    given = [np.array([0, 1, 2, 3]), (4, 5, 6, 7), [8, 9, 10, 11]]
    rows = [list(b) for b in given]
    extra = dict(snapshot=True, snapshot_steps=50) if snapshot else {}
    cfg = ProbeConfig(batches=3, drift_batches=None, batch_size=4, chunk_size=4, batch_indices=given, **extra)
    result = _probe(enc, items, src, cfg, out=tmp_path / "run.parquet")
    assert counts == Counter(
        {"resolve": 1, "preset sgd": 1, "weight scan": 1, "get_objective": 1, "as_pair_source": 1}
    ), counts
    # the user's batch_indices are not rewritten: the same list, the same objects, the same values
    assert cfg.batch_indices is given and cfg.batch_indices[0] is given[0] and cfg.batch_indices[1] == (4, 5, 6, 7)
    assert [list(b) for b in cfg.batch_indices] == rows
    assert result.metadata["config"]["batch_indices"] == rows  # recorded as checked
    assert ("r_eq_snapshot" in result.column_names) == snapshot


def test_a_prober_checks_once_and_its_settings_cannot_change(counts):
    enc, items, src = _data()
    cfg = ProbeConfig(
        batches=3, drift_batches=8, groups=2, batch_size=4, optimizer={r"\.0\.": "sgd", r"\.2\.": "adamw"}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pairs = list(zip(*src.batch(np.arange(len(src)))))  # an iterable of pairs: made a source once
        prober = normfast.Prober(enc, "infonce", pairs, cfg, progress=False)
        for _ in range(2):
            prober.probe(items)
    # one check, one preset object per preset named (shared by every parameter of its group), one scan
    assert counts == Counter(
        {"resolve": 1, "preset sgd": 1, "preset adamw": 1, "weight scan": 1, "get_objective": 1, "as_pair_source": 1}
    ), counts
    assert isinstance(prober.plan, ProbePlan) and prober.config == prober.plan.config
    with pytest.raises(dataclasses.FrozenInstanceError, match="a plan's settings are fixed"):
        prober.config.lr = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        prober.plan.config = cfg
    cfg.lr = 0.5  # the user's own config stays theirs
    assert prober.config.lr == 1e-3


def test_an_in_place_change_between_two_calls_is_seen_by_the_second():
    """The optimizer dict and the batch_indices are changed in place (the config object is the same, its
    fields are not reassigned): the second call checks them afresh and refuses them. A check cached by
    the config's identity let both through (momentum silently dropped; a batch of 5 with batch_size=4)."""
    enc, items, src = _data()
    cfg = ProbeConfig(batches=3, drift_batches=None, batch_size=4, optimizer={".": "sgd"}, momentum=0.5)
    first = _probe(enc, items, src, cfg)
    assert first.metadata["momentum"] == 0.5
    cfg.optimizer["."] = "adamw"
    with pytest.raises(ValueError, match=r"momentum \(heavy-ball beta\) applies to the sgd preset only"):
        _probe(enc, items, src, cfg)
    cfg.optimizer["."] = "sgd"
    cfg.batch_indices = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    _probe(enc, items, src, cfg)
    cfg.batch_indices[0].append(12)
    with pytest.raises(ValueError, match=r"batch_indices\[0\] has 5 indices but batch_size=4"):
        _probe(enc, items, src, cfg)


def test_validate_changes_nothing_and_keeps_nothing():
    cfg = ProbeConfig(batches=2, drift_batches=None, batch_size=4, batch_indices=(np.arange(4), np.arange(4, 8)))
    before = cfg.batch_indices
    cfg.validate()
    cfg.validate()
    assert cfg.batch_indices is before and isinstance(before, tuple)
    assert not hasattr(normfast.engine.config, "_CHECKED")
    plan = cfg.resolve()
    assert plan.config.batch_indices == [[0, 1, 2, 3], [4, 5, 6, 7]] and plan.config is not cfg
    assert [b.dtype for b in plan.batch_indices] == [np.int64, np.int64]
    with pytest.raises(ValueError, match="resolve a ProbeConfig"):
        plan.derived(lr=0.1)


def test_the_command_line_checks_once_before_the_model_loads(tmp_path, tiny_bert_folder, counts, capsys):
    """``normfast probe`` resolves its settings before it loads the model and hands the plan on: one
    check for the whole command, and a bad setting is still refused in one line."""
    from normfast.cli import main

    words = tmp_path / "words.txt"
    words.write_text("apple\nriver\nthe\nblue\n")
    argv = ["probe", str(tiny_bert_folder), "--probes", str(words), "--params", r"encoder\.layer\.1\."]
    argv += ["--batches", "3", "--drift-batches", "0", "--batch-size", "2", "--out", str(tmp_path / "run.parquet")]
    assert main([*argv, "--no-progress"]) == 0
    assert counts["resolve"] == 1 and counts["preset sgd"] == 1 and counts["weight scan"] == 1, counts
    bad = [*argv[:-1], str(tmp_path / "bad.parquet"), "--chunk-size", "0", "--no-progress"]
    assert main(bad) == 2 and "chunk_size must be a positive integer" in capsys.readouterr().err
