"""normfast.data.atomic: files written atomically get the mode every other file gets (the umask's)."""

from __future__ import annotations

import os
import stat

import pyarrow as pa
import pytest

from normfast.cli import main
from normfast.data.atomic import write_file_atomically, write_text_atomically
from normfast.data.runwriter import ChunkedParquetWriter
from normfast.engine.report.aggregate import write_table


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_honour_the_umask(tmp_path, umask):
    plain = tmp_path / "plain.json"
    plain.write_text("{}")  # what open() gives: the reference
    assert _mode(plain) == 0o666 & ~umask
    write_text_atomically("{}", tmp_path / "a.json")
    write_file_atomically(b"x", tmp_path / "b.bin")
    table = pa.table({"x": [1, 2, 3]})
    write_table(table, tmp_path / "agg.parquet")
    writer = ChunkedParquetWriter(tmp_path / "run.parquet", {"a": 1})
    writer.write_chunk(0, table)
    (tmp_path / "plain").mkdir()
    assert _mode(tmp_path / "run.parquet.parts") == _mode(tmp_path / "plain") == 0o777 & ~umask  # the work folder
    writer.write_part([0], tmp_path / "run.parquet", {"a": 1})
    writer.cleanup()
    coeffs = tmp_path / "c.csv"
    coeffs.write_text("1,-10,35,-50,24\n")
    assert main(["solve", str(coeffs), "-o", str(tmp_path / "r.csv")]) == 0
    for name in ("a.json", "b.bin", "agg.parquet", "run.parquet", "r.csv"):
        assert _mode(tmp_path / name) == _mode(plain), (name, oct(_mode(tmp_path / name)))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
