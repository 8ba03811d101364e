"""normfast.data.textfiles: every user text file is read one way -- a byte-order mark dropped, NUL
bytes refused, old Mac line endings read as line breaks, a line longer than the cap refused while it
is read (bounded memory), each error one line naming the file and the line."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from normfast.data.records import read_jsonl, read_lines, read_tsv
from normfast.data.textfiles import BLOCK_BYTES, MAX_LINE_BYTES, iter_lines, read_text

BOM = b"\xef\xbb\xbf"


def test_a_byte_order_mark_is_dropped_from_txt_jsonl_and_tsv_alike(tmp_path):
    txt, jsonl, tsv = tmp_path / "w.txt", tmp_path / "w.jsonl", tmp_path / "w.tsv"
    txt.write_bytes(BOM + b"apple\nriver\n")
    jsonl.write_bytes(BOM + b'{"text": "apple"}\n{"text": "river"}\n')
    tsv.write_bytes(BOM + b"text\tlabel\napple\t1\n")
    assert list(read_lines(txt, fn="f")) == [(1, "apple"), (2, "river")]
    assert [rec["text"] for _, rec in read_jsonl(jsonl, fn="f", text_fields=("text",))] == ["apple", "river"]
    assert list(read_tsv(tsv, fn="f", columns=("text",))) == [(2, ["apple"])]
    assert read_text(txt) == "apple\nriver\n"
    # only the first bytes of a file are a mark; U+FEFF inside a text is the text's own
    txt.write_bytes(b"apple\n" + BOM + b"river\n")
    assert list(read_lines(txt, fn="f"))[1] == (2, "\ufeffriver")


@pytest.mark.parametrize("reader", ["lines", "text"])
def test_a_nul_byte_is_refused_naming_the_file_and_the_line(tmp_path, reader):
    path = tmp_path / "w.txt"
    path.write_bytes(b"apple\nriver\nst\x00one\n")
    with pytest.raises(ValueError, match=r"probes file: .*w\.txt: line 3 \(byte 14\) holds a NUL byte") as err:
        list(iter_lines(path, "probes file:")) if reader == "lines" else read_text(path, "probes file:")
    assert "\n" not in str(err.value) and "UTF-16" in str(err.value)


@pytest.mark.parametrize(
    "content",
    [b"apple\rriver\rthe\r", b"apple\r\nriver\r\nthe\r\n", b"apple\nriver\nthe", b"apple\r\nriver\rthe\n"],
    ids=["cr", "crlf", "lf", "mixed"],
)
def test_cr_crlf_and_lf_are_all_line_breaks(tmp_path, content):
    path = tmp_path / "w.txt"
    path.write_bytes(content)
    assert list(read_lines(path, fn="f")) == [(1, "apple"), (2, "river"), (3, "the")]


def test_a_crlf_split_between_two_blocks_is_one_line_break(tmp_path):
    path = tmp_path / "w.txt"
    first = "x" * (BLOCK_BYTES - 1)  # its \r is the block's last byte, its \n the next block's first
    path.write_bytes(first.encode() + b"\r\nriver\r\n\xc3")
    with pytest.raises(ValueError, match=rf"line 3 \(byte {BLOCK_BYTES + 8}\) is not UTF-8"):
        list(read_lines(path, fn="f"))
    path.write_bytes(first.encode() + b"\r\nriver\r\n")
    assert list(read_lines(path, fn="f")) == [(1, first), (2, "river")]


def test_a_line_over_the_cap_is_refused_fast_and_in_bounded_memory(tmp_path):
    path = tmp_path / "w.txt"
    with open(path, "wb") as fh:
        fh.write(b"apple\n")
        fh.write(b"river " * (4 * MAX_LINE_BYTES // 6))  # a 4 MiB line
        fh.write(b"\nthe\n")
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=rf"f: .*w\.txt: line 2 is longer than {MAX_LINE_BYTES} bytes") as err:
            list(read_lines(path, fn="f"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2
    assert peak < 2 * MAX_LINE_BYTES + 4 * BLOCK_BYTES, peak  # never the whole line
    assert "\n" not in str(err.value) and "split" in str(err.value)
    # a line of exactly the cap is read; a corpus reader may lift the cap
    path.write_bytes(b"a" * MAX_LINE_BYTES + b"\n")
    assert len(next(read_lines(path, fn="f"))[1]) == MAX_LINE_BYTES
    path.write_bytes(b"a" * (MAX_LINE_BYTES + 1) + b"\r\n")
    assert len(next(iter_lines(path, max_bytes=None))[1]) == MAX_LINE_BYTES + 1


def test_a_folder_is_named_as_a_folder_and_a_missing_file_as_missing(tmp_path):
    with pytest.raises(ValueError, match=r"f: .* is a folder; expected a file \(a text file, one item per line\)"):
        list(read_lines(tmp_path, fn="f"))
    with pytest.raises(ValueError, match=r"f: .* is a folder; expected a file \(a JSON-lines file"):
        list(read_jsonl(tmp_path, fn="f"))
    with pytest.raises(ValueError, match=r"input .* is a folder; expected a file"):
        read_text(tmp_path, "input")
    with pytest.raises(FileNotFoundError, match=r"f: .*nothing\.txt does not exist"):
        list(read_lines(tmp_path / "nothing.txt", fn="f"))
