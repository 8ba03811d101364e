"""normfast.data.records: the one reader of JSON-lines and tab-separated files."""

from __future__ import annotations

import pytest

from normfast.data.corpus import read_documents
from normfast.data.records import RecordError, read_jsonl, read_tsv


def test_jsonl_skips_blank_lines_and_counts_every_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "a", "id": 7}\n\n  \n{"text": "b"}\n')
    assert list(read_jsonl(path, fn="f", text_fields=("text",))) == [(1, {"text": "a", "id": 7}), (4, {"text": "b"})]


@pytest.mark.parametrize(
    "content, pattern",
    [
        ('{"text": "a"}\n{"text": null}\n', r"f: .*r\.jsonl:2: field 'text' must be a string, got NoneType"),
        ('{"text": "a"}\n{"text": 3}\n', r"r\.jsonl:2: field 'text' must be a string, got int"),
        ('{"text": "a"}\n{"body": "b"}\n', r"r\.jsonl:2: missing field 'text' \(fields present: \['body'\]\)"),
        ('{"text": "a"}\n{"text": \n', r"r\.jsonl:2: not valid JSON"),
        ('"a"\n', r"r\.jsonl:1: expected a JSON object, got str"),
    ],
)
def test_jsonl_errors_name_the_file_the_line_and_the_field(tmp_path, content, pattern):
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    with pytest.raises(RecordError, match=pattern):
        list(read_jsonl(path, fn="f", text_fields=("text",)))


def test_a_null_text_is_an_error_for_every_text_reader(tmp_path, capsys):
    from normfast.cli import main

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"docs\.jsonl:2: field 'text' must be a string"):
        read_documents(path)
    rc = main(["probe", "minilm", "--probes", str(path), "--out", str(tmp_path / "x.parquet")])
    assert rc == 2 and "docs.jsonl:2: field 'text' must be a string, got NoneType" in capsys.readouterr().err


def test_tsv_columns_by_index_by_name_and_comments(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("# a comment\nq\tdoc\tscore\n\nx\ty\t1\n")
    assert list(read_tsv(path, fn="f", comment="#", columns=("score", "q"))) == [(4, ["1", "x"])]
    assert list(read_tsv(path, fn="f", comment="#", columns=(1,))) == [(2, ["doc"]), (4, ["y"])]
    with pytest.raises(RecordError, match=r"t\.tsv:1: expected 3 tab-separated fields, got 1"):
        list(read_tsv(path, fn="f", n_fields=3))
    with pytest.raises(RecordError, match=r"t\.tsv:2: header lacks column\(s\) \['label'\]"):
        list(read_tsv(path, fn="f", comment="#", columns=("label",)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_tsv(tmp_path / "missing.tsv", fn="f"))
