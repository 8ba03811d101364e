"""``normfast report FOLDER`` on a monitor folder it cannot fully trust (issue 33): a newer monitor format
is refused with one line (its version, the versions read here, upgrade normfast), damaged metadata is
one line naming the file, and an unreadable ``summary.json`` (timing only) still gives the report,
which says that the timing is unreadable."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from normfast.cli import main
from normfast.data.schema import METADATA_KEY
from normfast.engine.monitor.layout import MONITOR_VERSION
from tests.engine.monitor.test_recorder import copy_folder, monitor_folders

pytestmark = pytest.mark.usefixtures("single_thread")


def _one_error_line(err: str) -> str:
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return monitor_folders(tmp_path_factory.mktemp("monitor-report"))


def _set_metadata(path: Path, blob: bytes) -> None:
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: blob}), path)


def _changed(path: Path, **changes) -> bytes:
    meta = json.loads(pq.read_schema(path).metadata[METADATA_KEY])
    for k, v in changes.items():
        meta.pop(k) if v is None else meta.__setitem__(k, v)
    return json.dumps(meta).encode()


def test_the_folders_report_as_they_are(folders, tmp_path, capsys):
    for name in folders:
        assert main(["report", str(copy_folder(folders, name, tmp_path)), "--no-plots"]) == 0
        assert "recorded steps" in capsys.readouterr().out


def test_a_monitor_of_a_newer_format_is_refused(folders, tmp_path, capsys):
    folder = copy_folder(folders, "finished", tmp_path)
    final = folder / "monitor.parquet"
    _set_metadata(final, _changed(final, monitor_version=99))
    assert main(["report", str(folder), "--no-plots"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{final}: monitor format version 99, written by a newer normfast" in err, err
    assert f"reads versions up to {MONITOR_VERSION}: upgrade normfast" in err, err
    # an unfinished folder: the version its work folder records
    folder = copy_folder(folders, "unfinished", tmp_path)
    run = folder / "monitor.parquet.parts" / "run.json"
    blob = json.loads(run.read_text())
    blob["spec"]["monitor_version"] = 99
    run.write_text(json.dumps(blob))
    assert main(["report", str(folder), "--no-plots"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{run}: monitor format version 99" in err and "upgrade normfast" in err, err


@pytest.mark.parametrize(
    "change, said",
    [
        ({"monitor_version": "x"}, "its metadata's monitor_version is 'x', not an integer version"),
        ({"monitor_version": None}, "its metadata has no monitor_version"),
        (b"[1, 2]", "its normfast metadata is a list, not a JSON object"),
        (b"{oops", "its normfast metadata is not JSON"),
    ],
    ids=["version-x", "no-version", "list", "not-json"],
)
def test_damaged_monitor_metadata_is_one_line_naming_the_file(folders, tmp_path, change, said, capsys):
    folder = copy_folder(folders, "finished", tmp_path)
    final = folder / "monitor.parquet"
    _set_metadata(final, change if isinstance(change, bytes) else _changed(final, **change))
    assert main(["report", str(folder), "--no-plots"]) == 2
    assert f"{final}: {said}" in _one_error_line(capsys.readouterr().err)


def test_a_damaged_run_json_of_an_unfinished_folder_is_one_line(folders, tmp_path, capsys):
    folder = copy_folder(folders, "unfinished", tmp_path)
    run = folder / "monitor.parquet.parts" / "run.json"
    run.write_text("{half")
    assert main(["report", str(folder), "--no-plots"]) == 2
    assert f"{run} is not JSON" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "summary", ["{not json", "[1, 2]", json.dumps({"steps": 8, "overhead_terms": "fast"})], ids=["text", "list", "type"]
)
def test_an_unreadable_timing_still_gives_the_report(folders, tmp_path, summary, capsys):
    folder = copy_folder(folders, "finished", tmp_path)
    (folder / "summary.json").write_text(summary)
    assert main(["report", str(folder), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "note: the timing in summary.json is unreadable (" in printed and "monitor overhead" not in printed
    report = json.loads((folder / "report.json").read_text())
    assert report["timing"] is None and report["recorded_steps"] == 8


def test_the_report_files_hold_what_is_registered(folders, tmp_path):
    """report.json and report_items.csv hold exactly the keys and columns of
    normfast.engine.monitor.readout (the docs render them from there), in its order; a key the
    registry does not know is named."""
    import csv

    from normfast.engine.monitor.readout import ITEM_COLUMNS, REPORT_KEYS, check_items, check_report

    folder = copy_folder(folders, "finished", tmp_path)
    assert main(["report", str(folder), "--no-plots"]) == 0
    report = json.loads((folder / "report.json").read_text())
    assert check_report(report) == []
    with open(folder / "report_items.csv", newline="") as fh:
        header = next(csv.reader(fh))
    assert check_items(header) == [] and header == list(report["items"])
    # SGD with realized terms and weight decay, no virtual probe: every column that applies, and only those
    assert header == [
        c.name
        for c in ITEM_COLUMNS
        if c.when in ("always", "with realized terms", "with realized terms and weight decay") or c.name == "dominant"
    ]
    top = {k.name for k in REPORT_KEYS if "." not in k.name}
    assert set(report) == top
    report["window"]["width"] = 3
    report["surprise"] = 1
    report["items"]["extra"] = [0]
    problems = check_report(report)
    assert any("'window.width'" in p for p in problems) and any("'surprise'" in p for p in problems)
    assert any("'extra' is not registered" in p for p in problems)
