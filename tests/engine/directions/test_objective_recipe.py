"""A new objective, added the way docs/design.md's recipe says -- its own module ending with
``register(...)``, nothing else edited -- is usable everywhere the objectives are: by name, on the
command line with its own setting as a flag (and a run of ``normfast probe``), in the health check,
in the run's metadata and in the docs' table of objectives.

The toy objective (a cosine margin between two dropout views of each item, with its own ``margin``
and no temperature) is written to a temporary folder and imported from there, as the package's
``objectives/__init__.py`` imports a new module; it leaves the registry after each test. Its loss
has no chance level: a margin loss near 0 has done its work, it is not saturated.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import normfast
from normfast.cli import build_parser, main
from normfast.engine.diagnostics.health import health_line, objective_health
from normfast.engine.directions.objectives import (
    SimCSE,
    check_scale_invariance,
    get_objective,
    objective_classes,
    unregister,
)

ROOT = Path(__file__).resolve().parents[3]

TOY = '''\
"""A toy objective: a cosine margin between two dropout views of each item."""

from normfast.engine.directions.objectives.base import Objective, Setting, register


class Toy(Objective):
    """``mean_{i != j} max(0, margin - cos(a_i, b_i) + cos(a_i, b_j))``: each view must be nearer its
    own other view than any other item's by ``margin``."""

    name = "toy"
    summary = "two dropout views of items, a cosine margin"
    needs = "items"
    uses_dropout = True
    views = "two dropout views of each"
    declared_settings = (Setting("margin", 0.2, "the cosine margin a positive must win by", minimum=0.0),)

    def loss(self, za, zb=None, labels=None):
        import torch
        import torch.nn.functional as F

        a, b = F.normalize(za, dim=-1), F.normalize(zb, dim=-1)
        cos = a @ b.T
        gap = torch.relu(self.margin - cos.diagonal()[:, None] + cos)
        others = ~torch.eye(a.shape[0], dtype=torch.bool, device=a.device)
        return gap[others].mean()


register(Toy)
'''


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy_objective.py"
    path.write_text(textwrap.dedent(TOY))
    spec = importlib.util.spec_from_file_location("toy_objective", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_objective"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        unregister("toy")
        sys.modules.pop("toy_objective", None)


def _parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_a_new_objective_module_joins_the_registry_and_every_commands_options(toy):
    assert objective_classes()["toy"] is toy.Toy and list(objective_classes())[-1] == "toy"
    made = get_objective("toy", margin=0.3)
    assert isinstance(made, toy.Toy) and made.margin == 0.3 and made.settings() == {"margin": 0.3}
    assert get_objective("toy").margin == 0.2 and repr(made) == "Toy(margin=0.3)"
    with pytest.raises(ValueError, match="margin >= 0.0"):
        get_objective("toy", margin=-1)
    with pytest.raises(TypeError, match="its settings are: margin"):
        get_objective("toy", temperature=0.1)
    gen = torch.Generator().manual_seed(0)
    za = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    assert check_scale_invariance(made, za, za + 0.3 * torch.randn(6, 5, generator=gen, dtype=torch.float64))
    for command in ("probe", "directions", "serve"):
        parser = _parser(command)
        assert "toy" in _option(parser, "--objective").choices, command
        assert "toy (two dropout views of items, a cosine margin)" in _option(parser, "--objective").help
        margin = _option(parser, "--margin")
        assert margin.type is float and margin.default is None, command
        assert margin.help == "toy: the cosine margin a positive must win by (default 0.2)", margin.help
        # the temperature is the softmax objectives': its help names theirs, not the toy
        assert "toy" not in _option(parser, "--temperature").help
    assert "--margin" in _parser("probe").format_help()


def test_a_new_objective_runs_from_the_command_line_with_its_own_setting(toy, tiny_bert_folder, tmp_path, capsys):
    words = tmp_path / "words.txt"
    words.write_text("apple\nriver\nthe\ndemocracy\nblue\nquantum\n")
    out = tmp_path / "toy.parquet"
    common = ["probe", str(tiny_bert_folder), "--probes", str(words), "--params", r"encoder\.layer\.1\."]
    common += ["--batches", "2", "--drift-batches", "0", "--groups", "2", "--batch-size", "4", "--no-progress"]
    assert main([*common, "--objective", "toy", "--margin", "0.3", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "objective toy (margin=0.3)" in printed
    meta = normfast.read_metadata(out)
    assert meta["objective"] == "toy" and meta["objective_settings"] == {"margin": 0.3}
    assert meta["temperature"] is None  # no temperature invented for a loss that has none
    health = meta["objective_health"]
    assert health["batches"] >= 2 and health["chance"] is None and health["saturated_below"] is None
    assert health["saturated"] is False and math.isnan(health["loss_to_chance"])
    assert "not saturated; saturated: never by the loss-to-chance rule" in health_line(health)
    assert health_line(health) in printed
    # the toy's flag is refused for another objective, and another's flag for the toy: one line each
    assert main([*common, "--objective", "simcse", "--margin", "0.3", "--out", str(tmp_path / "x.parquet")]) == 2
    assert "--margin applies to --objective toy, got --objective simcse" in capsys.readouterr().err
    assert main([*common, "--objective", "toy", "--temperature", "0.1", "--out", str(tmp_path / "y.parquet")]) == 2
    err = capsys.readouterr().err
    assert "--temperature applies to --objective simcse, infonce, clip, supcon, got --objective toy" in err
    assert "Traceback" not in err and "TypeError" not in err


def test_the_health_check_reads_the_new_objectives_own_facts(toy):
    # a margin loss near 0 has done its work: the loss-to-chance rule, which calls a softmax loss that
    # low saturated, does not apply to a loss without a chance level
    stats = {b: (1e-6, 1e-4) for b in range(8)}
    assert objective_health(stats, batch_size=32, groups=8, objective=SimCSE())["saturated"]
    health = objective_health(stats, batch_size=32, groups=8, objective=toy.Toy())
    assert not health["saturated"] and health["chance"] is None
    assert health["saturation"] == "never by the loss-to-chance rule (the loss has no chance level)"


def test_the_docs_table_of_objectives_lists_the_new_one(toy):
    spec = importlib.util.spec_from_file_location("normfast_docs_hooks_recipe", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    table = hooks.expand("<!-- objectives:table -->\n", "test.md")
    row = next(line for line in table.splitlines() if line.startswith("| `toy` |"))
    assert "`Toy`" in row and "items: two dropout views of items, a cosine margin" in row
    assert "`--margin` (0.2): the cosine margin a positive must win by" in row
    assert "| none | never by the loss-to-chance rule (the loss has no chance level) | the probed encoder |" in row
    assert "| `simcse` |" in table  # the shipped ones stay
