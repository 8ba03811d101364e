"""`normfast solve`: files in, equilibrium norms out, errors without tracebacks."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from normfast.cli import main
from normfast.core.equilibrium import solve_quartic

ROWS = np.array(
    [
        [1.0, -10.0, 35.0, -50.0, 24.0],  # roots 1, 2, 3, 4
        [1.0, 0.0, -5.0, 0.0, 4.0],  # biquadratic: +-1, +-2
        [0.0, 0.0, 1.0, 0.0, 1.0],  # no real root
        [0.0, 0.0, 0.0, 2.0, -1.0],  # linear: 1/2
        [2e-4, 0.0, 2e6, 0.0, -1e-6],  # inward drift >> heat
    ]
)


@pytest.fixture
def expected():
    return solve_quartic(ROWS)


def read_csv_output(path):
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        body = list(reader)
    return header, np.array([float(r[0]) for r in body]), np.array([int(r[1]) for r in body])


def test_npy_in_csv_out(tmp_path, expected):
    src, out = tmp_path / "coeffs.npy", tmp_path / "r_eq.csv"
    np.save(src, ROWS)
    assert main(["solve", str(src), "-o", str(out)]) == 0
    header, r_eq, n_pos = read_csv_output(out)
    assert header == ["r_eq", "n_positive"]
    np.testing.assert_array_equal(r_eq, expected[0])  # repr round-trips exactly; nan stays nan
    np.testing.assert_array_equal(n_pos, [4, 2, 0, 1, 1])
    assert "nan" in out.read_text().splitlines()[3]


def test_csv_with_header_in_npy_out(tmp_path, expected):
    src, out = tmp_path / "coeffs.csv", tmp_path / "r_eq.npy"
    lines = ["a,b,c,d,e"] + [",".join(repr(v) for v in row) for row in ROWS.tolist()]
    src.write_text("\n".join(lines) + "\n")
    assert main(["solve", str(src), "--out", str(out), "--threads", "2"]) == 0
    table = np.load(out)
    assert table.dtype.names == ("r_eq", "n_positive")
    np.testing.assert_array_equal(table["r_eq"], expected[0])
    np.testing.assert_array_equal(table["n_positive"], expected[1])


def test_csv_without_header_in_parquet_out(tmp_path, expected):
    pq = pytest.importorskip("pyarrow.parquet")
    src, out = tmp_path / "coeffs.csv", tmp_path / "r_eq.parquet"
    np.savetxt(src, ROWS, delimiter=",", fmt="%.17g")
    assert main(["solve", str(src), "-o", str(out)]) == 0
    table = pq.read_table(out)
    assert table.column_names == ["r_eq", "n_positive"]
    np.testing.assert_array_equal(table.column("r_eq").to_numpy(), expected[0])
    np.testing.assert_array_equal(table.column("n_positive").to_numpy(), expected[1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_small_input_prints_a_table(tmp_path, capsys, expected):
    src = tmp_path / "coeffs.npy"
    np.save(src, ROWS)
    assert main(["solve", str(src)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["row", "r_eq", "n_positive"]
    assert len(lines) == 1 + len(ROWS)
    assert [float(line.split()[1]) for line in lines[1:]][:2] == [4.0, 2.0]
    assert lines[3].split()[1:] == ["nan", "0"]


def read_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_large_input_needs_out(tmp_path, capsys):
    src = tmp_path / "coeffs.npy"
    np.save(src, np.tile(ROWS, (5, 1)))
    assert main(["solve", str(src)]) == 2
    assert "25 rows: pass -o/--out" in read_error(capsys)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.npy", None, "input file not found"),
        ("coeffs.txt", "1,2,3,4,5\n", "unsupported input extension '.txt'"),
        ("narrow.csv", "1,2,3,4\n", "line 1: expected 5 columns (a,b,c,d,e), got 4"),
        ("words.csv", "a,b,c,d,e\n1,2,x,4,5\n", "line 2: expected 5 numbers"),
    ],
)
def test_input_errors(tmp_path, capsys, name, content, message):
    src = tmp_path / name
    if content is not None:
        src.write_text(content)
    assert main(["solve", str(src)]) == 2
    assert message in read_error(capsys)


def test_npy_errors(tmp_path, capsys):
    src = tmp_path / "wide.npy"
    np.save(src, np.zeros((3, 6)))
    assert main(["solve", str(src)]) == 2
    assert "expected an array of shape [N, 5] (a,b,c,d,e), got shape=(3, 6)" in read_error(capsys)
    np.save(src, np.array([{"a": 1}], dtype=object))
    assert main(["solve", str(src)]) == 2
    assert "not a plain numeric .npy array" in read_error(capsys)


def test_output_errors(tmp_path, capsys):
    src = tmp_path / "coeffs.npy"
    np.save(src, ROWS)
    assert main(["solve", str(src), "-o", str(tmp_path / "r_eq.json")]) == 2
    assert "unsupported output extension '.json'" in read_error(capsys)
    assert main(["solve", str(src), "-o", str(tmp_path / "no_such_dir" / "r.csv")]) == 2
    assert "output directory does not exist" in read_error(capsys)
    assert main(["solve", str(src), "--threads", "0"]) == 2
    assert "--threads must be >= 1" in read_error(capsys)


def test_help_explains_the_law(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "a R^4 + b R^3 + c R^2 + d R + e = 0",
        "a = 2 lambda kappa",
        "e = -eta Q",
        "largest positive real root",
        "bistability",
        "--out",
        "--threads",
    ):
        assert needle in text
