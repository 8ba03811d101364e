"""The run's shared state (normfast.engine.runner.state): the progress bar counts whole items, a
probed parameter no batch reaches is warned about once per run, and the memory budget holds the
drift's group means as well as the heat's directions."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from normfast.data.pairs import PairSource
from normfast.encoders import ModuleEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.probe import probe
from normfast.engine.runner.state import ProbeRun

pytestmark = pytest.mark.usefixtures("single_thread")


class Unused(nn.Module):
    """A layer whose second Linear never reaches the output (a pooler the embedding does not use)."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(6, 8)
        self.pooler = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def _data(n: int = 12):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), PairSource.from_tensors(torch.randn(32, 6, generator=g), torch.randn(32, 6))


def test_the_progress_bar_counts_whole_items(capsys):
    torch.manual_seed(0)
    items, pairs = _data(5)
    enc = ModuleEncoder([nn.Linear(6, 8), nn.Linear(8, 4)])
    probe(enc, items, "infonce", pairs, ProbeConfig(batches=2, drift_batches=4, batch_size=4, chunk_size=2))
    err = capsys.readouterr().err
    assert "5/5" in err and ".00/" not in err and "5.0" not in err.split("5/5")[0][-6:]


def test_a_parameter_no_batch_reaches_is_warned_about_once_per_run():
    torch.manual_seed(0)
    items, pairs = _data()
    enc = ModuleEncoder([Unused(), nn.Linear(8, 4)])
    # a tiny budget: the directions come in groups (directions-outer), so they are computed three times over
    cfg = ProbeConfig(batches=4, drift_batches=8, batch_size=4, chunk_size=6, memory_budget_mb=0.002)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        probe(enc, items, "infonce", pairs, cfg, progress=False)
    texts = [str(w.message) for w in record]
    unused = [t for t in texts if "receive no gradient" in t]
    assert len(unused) == 1 and "blocks.0.pooler.weight" in unused[0] and "\n" not in unused[0]
    outer = [t for t in texts if "directions-outer" in t]
    assert len(outer) == 1 and "drift's 4 group means" in outer[0] and "--memory-budget-mb" in outer[0]


def test_the_memory_budget_holds_the_drift_group_means():
    torch.manual_seed(0)
    items, pairs = _data()
    enc = ModuleEncoder([nn.Linear(6, 64), nn.Linear(64, 64)])  # 4 608 parameters: 18 KB a direction
    per = sum(p.numel() for p in enc.parameters()) * 4
    budget_mb = 2 * 20 * per / 2**20  # half of it holds 20 directions
    with_drift = ProbeRun(
        enc, None, pairs, ProbeConfig(batches=16, drift_batches=64, memory_budget_mb=budget_mb).resolve(), None, False
    )
    per_batch = ProbeRun(
        enc, None, pairs, ProbeConfig(batches=16, drift_batches=None, memory_budget_mb=budget_mb).resolve(), None, False
    )
    assert with_drift.direction_bytes() == per_batch.direction_bytes() == per
    assert per_batch.direction_group() == 16  # all 16 fit beside nothing
    assert with_drift.drift_bytes() == 8 * per and with_drift.direction_group() == 12  # 20 less the 8 means
