"""Training monitor folders under faults (issue 41): a flipped bit in ``monitor.parquet``, a block of an
unfinished folder whose ``.sha256`` no longer matches, and a monitor never closed. Every reader
(``normfast report``, ``normfast view``, the Python loaders) refuses a damaged file in one line naming
it, exit code 2, no traceback, and writes nothing."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from normfast.cli import main
from normfast.engine.monitor import analyze, load_monitor
from tests.engine.monitor.test_recorder import copy_folder, monitor_folders
from tests.faults.cli_helpers import one_error_line

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return monitor_folders(tmp_path_factory.mktemp("monitor-faults"))


def _flip_a_norm(path: Path) -> float:
    """Flip one bit of a stored ``norm`` value (found by its bytes: a value stored once); returns the value."""
    raw = bytearray(path.read_bytes())
    for value in pq.read_table(path, columns=["norm"]).column("norm").to_pylist():
        pattern = struct.pack("<d", value)
        at = raw.find(pattern)
        if at >= 0 and raw.find(pattern, at + 1) < 0:
            raw[at + 7] ^= 0x08  # an exponent bit: the value moves by orders of magnitude
            path.write_bytes(bytes(raw))
            return value
    raise AssertionError(f"no norm value of {path} is stored once, plainly")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_flipped_bit_in_a_norm_of_monitor_parquet_is_refused_by_every_reader(folders, tmp_path, capsys):
    folder = copy_folder(folders, "finished", tmp_path)
    parquet = folder / "monitor.parquet"
    value = _flip_a_norm(parquet)
    # without its checksums the file still reads, with that norm changed: the silent wrong number
    unchecked = pq.read_table(parquet, columns=["norm"]).column("norm")
    assert not pc.any(pc.equal(unchecked, value)).as_py()
    before = _files(folder)
    assert main(["report", str(folder), "--no-plots"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(parquet) in line and "checksum" in line, line
    assert main(["view", str(folder)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("normfast view: error: ") and str(parquet) in line and "checksum" in line, line
    assert _files(folder) == before  # no page, no report written
    for read in (load_monitor, analyze):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(parquet))} cannot be read \(.*checksum"):
            read(folder)


def test_a_block_whose_sha256_no_longer_matches_is_refused_by_every_reader(folders, tmp_path, capsys):
    folder = copy_folder(folders, "unfinished", tmp_path)
    chunk = folder / "monitor.parquet.parts" / "chunk-0000001.parquet"
    # a whole, valid Parquet file (its page checksums right) whose values are not those written
    table = pq.read_table(chunk)
    norm = table.schema.get_field_index("norm")
    table = table.set_column(norm, "norm", pc.multiply(table.column("norm"), 2.0))
    pq.write_table(table, chunk, write_page_checksum=True)
    before = _files(folder)
    assert main(["report", str(folder), "--no-plots"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(chunk) in line and "SHA-256" in line, line
    assert main(["view", str(folder)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(chunk) in line and "SHA-256" in line, line
    assert _files(folder) == before
    for read in (load_monitor, analyze):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(chunk))} cannot be read \(.*SHA-256"):
            read(folder)


def test_a_monitor_left_unclosed_at_exit_prints_nothing(tmp_path):
    script = f"""
import normfast
from bench.experiments.e1.data import build_encoder, make_concepts
from tests.engine.monitor.test_recorder import TOY, train_toy
data = make_concepts(TOY)
enc = build_encoder("mlp", TOY, data)
mon = normfast.TrainingMonitor(enc, list(range(data.x.shape[0])), every=1, out={str(tmp_path / "m")!r}, flush_every=4)
train_toy("mlp", data, 6, lambda s, before, o: mon.before_step(o) if before else mon.after_step(), encoder=enc)
print("trained")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "trained", done.stderr
    assert "Exception ignored" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert (tmp_path / "m" / "monitor.parquet.parts" / "chunk-0000000.parquet").is_file()  # kept for a resume
