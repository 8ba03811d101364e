"""Pair sources: file round trips, virtual batches, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from normfast.data.batches import virtual_batches
from normfast.data.pairs import PairSource

PAIRS = [("a cat", "a kitten"), ("a dog", "a puppy"), ("the sea", "the ocean"), ("red", "crimson"), ("fast", "quick")]


def write_jsonl(path, records, blank_lines=False):
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
            if blank_lines:
                fh.write("\n")
    return path


def test_jsonl_pairs_round_trip(tmp_path):
    records = [{"anchor": a, "positive": p, "extra": 1} for a, p in PAIRS]
    path = write_jsonl(tmp_path / "p.jsonl", records, blank_lines=True)
    src = PairSource.from_jsonl(path)
    assert src.kind == "pairs" and len(src) == len(PAIRS)
    anchors, positives = src.batch([3, 0])
    assert anchors == ["red", "a cat"] and positives == ["crimson", "a kitten"]


def test_jsonl_custom_keys_labels_and_items(tmp_path):
    records = [{"sentence": "x", "y": "b"}, {"sentence": "y", "y": "a"}, {"sentence": "z", "y": "b"}]
    path = write_jsonl(tmp_path / "l.jsonl", records)
    src = PairSource.from_jsonl(path, label_key="y", text_key="sentence")
    assert src.kind == "labels" and src.classes == ["b", "a"]
    items, labels = src.batch(np.array([0, 1, 2]))
    assert items == ["x", "y", "z"]
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 1, 0]
    items_only = PairSource.from_jsonl(path, text_key="sentence", kind="items")
    assert items_only.kind == "items" and items_only.batch([2, 1]) == ["z", "y"]
    swapped = PairSource.from_jsonl(path, anchor_key="y", positive_key="sentence")
    assert swapped.batch([1]) == (["a"], ["y"])


def test_tsv_round_trip_by_index_and_by_name(tmp_path):
    path = tmp_path / "p.tsv"
    rows = "".join(f"{i}\t{a}\t{p}\n" for i, (a, p) in enumerate(PAIRS))
    path.write_text(rows + "\n", encoding="utf-8")
    src = PairSource.from_tsv(path, columns=(1, 2))
    assert src.kind == "pairs" and len(src) == 5
    assert src.batch([4]) == (["fast"], ["quick"])
    items = PairSource.from_tsv(path, columns=(2,))
    assert items.kind == "items" and items.batch([0, 1]) == ["a kitten", "a puppy"]

    named = tmp_path / "h.tsv"
    rows = "".join(f"{a}\t{p}\t{i % 2}\n" for i, (a, p) in enumerate(PAIRS))
    named.write_text("query\tdoc\tlabel\n" + rows, encoding="utf-8")
    src = PairSource.from_tsv(named, columns=("doc", "query"))
    assert src.batch([1]) == (["a puppy"], ["a dog"])
    labelled = PairSource.from_tsv(named, columns=("query", "label"), kind="labels")
    assert labelled.batch([0, 1, 2])[1].tolist() == [0, 1, 0]


def test_from_iterable_kinds():
    pairs = PairSource.from_iterable(PAIRS)
    assert pairs.kind == "pairs" and pairs.batch([2]) == (["the sea"], ["the ocean"])
    items = PairSource.from_iterable(["u", "v", "w"])
    assert items.kind == "items" and len(items) == 3
    labelled = PairSource.from_iterable(["u", "v", "w"], labels=[5, 7, 5])
    assert labelled.kind == "labels" and labelled.batch([0, 1, 2])[1].tolist() == [0, 1, 0]
    assert labelled.classes == [5, 7]
    tuples = PairSource.from_iterable([("u", 1), ("v", 2)], kind="labels")
    assert tuples.batch([1])[0] == ["v"]
    images = PairSource.from_iterable([torch.zeros(3), torch.ones(3)], labels=torch.tensor([0, 1]))
    assert torch.equal(images.batch([1])[0][0], torch.ones(3))


def test_virtual_batches_are_deterministic_and_distinct():
    a = virtual_batches(50, 6, 8, seed=3)
    b = virtual_batches(50, 6, 8, seed=3)
    c = virtual_batches(50, 6, 8, seed=4)
    assert len(a) == 6
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    for batch in a:
        assert batch.shape == (8,) and batch.dtype == np.int64
        assert len(set(batch.tolist())) == 8 and batch.min() >= 0 and batch.max() < 50
    assert not all(np.array_equal(a[0], x) for x in a[1:])
    full = virtual_batches(5, 2, 5, seed=0)
    assert all(sorted(x.tolist()) == [0, 1, 2, 3, 4] for x in full)
    src = PairSource.from_iterable(PAIRS)
    assert all(
        np.array_equal(x, y) for x, y in zip(src.virtual_batches(3, 2, seed=9), virtual_batches(5, 3, 2, seed=9))
    )


def test_virtual_batches_errors():
    with pytest.raises(ValueError, match="batch_size <= n"):
        virtual_batches(4, 3, 5)
    with pytest.raises(ValueError, match="M"):
        virtual_batches(10, 1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        virtual_batches(10, 3, 1)
    with pytest.raises(ValueError, match="n "):
        virtual_batches(0, 3, 2)
    with pytest.raises(TypeError, match="seed"):
        virtual_batches(10, 3, 2, seed=1.5)


def test_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        PairSource.from_jsonl(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match="no records"):
        PairSource.from_jsonl(blank)
    with pytest.raises(FileNotFoundError):
        PairSource.from_jsonl(tmp_path / "missing.jsonl")

    records = [{"anchor": "a", "positive": "b"}, {"anchor": "c"}]
    missing_key = write_jsonl(tmp_path / "m.jsonl", records)
    with pytest.raises(ValueError, match=r"m\.jsonl:2: missing field 'positive'"):
        PairSource.from_jsonl(missing_key)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"anchor": "a", "positive": "b"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        PairSource.from_jsonl(bad)
    not_object = tmp_path / "list.jsonl"
    not_object.write_text('["a", "b"]\n')
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        PairSource.from_jsonl(not_object)

    short = tmp_path / "short.tsv"
    short.write_text("a\tb\nc\n")
    with pytest.raises(ValueError, match=r"short\.tsv:2: expected at least 2"):
        PairSource.from_tsv(short)
    header = tmp_path / "header.tsv"
    header.write_text("query\tdoc\nq\td\n")
    with pytest.raises(ValueError, match="'passage'"):
        PairSource.from_tsv(header, columns=("query", "passage"))
    only_header = tmp_path / "only_header.tsv"
    only_header.write_text("query\tdoc\n")
    with pytest.raises(ValueError, match="no rows"):
        PairSource.from_tsv(only_header, columns=("query", "doc"))
    with pytest.raises(ValueError, match="one or two columns"):
        PairSource.from_tsv(header, columns=(0, 1, 2))


def test_construction_and_batch_errors():
    with pytest.raises(ValueError, match="empty"):
        PairSource.from_iterable([])
    with pytest.raises(ValueError, match="at least one"):
        PairSource("items", [])
    with pytest.raises(ValueError, match="kind"):
        PairSource("triples", ["a"])
    with pytest.raises(ValueError, match="as many labels"):
        PairSource.from_iterable(["a", "b"], labels=[1])
    with pytest.raises(ValueError, match="2-tuples"):
        PairSource.from_iterable(["a", ("b", "c")], kind="pairs")
    with pytest.raises(TypeError, match="hashable"):
        PairSource.from_iterable(["a", "b"], labels=[[1], [2]])
    src = PairSource.from_iterable(PAIRS)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        src.batch([0, 5])
    with pytest.raises(ValueError, match="integer indices"):
        src.batch([0.5])
