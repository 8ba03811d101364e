"""Two runs over the same inputs, compared type by type (`normfast compare`, `ProbeResult.compare`): the
type means and their errors against `normfast aggregate` and the rows, the flag (a run against itself
flags nothing; a changed learning rate flags r_eq and nothing else), the refusals of runs over other
inputs (one line each), the table's columns and files; then the page in a real headless Chromium
(tests/_browser.py): it loads from file:// with no console error and no request, shows the table's
numbers, and a screenshot is not blank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from normfast.cli import main
from normfast.data.corpus import split_sentences
from normfast.data.schema import METADATA_KEY
from normfast.data.word_frequencies import top_words
from normfast.encoders import HFEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.estimators.uncertainty import t_quantile
from normfast.engine.probe import probe
from normfast.engine.report.aggregate import aggregate
from normfast.engine.report.compare import benjamini_hochberg, comparison_info
from normfast.engine.result import ProbeResult
from tests._browser import Tab, assert_screenshot_not_blank, launch
from tests._models import tiny_bert
from tests.data.test_corpus import DOCS

pytestmark = pytest.mark.usefixtures("single_thread")

QUANTITIES = ("heat_rel", "D", "r_eq")


def _config(**changes) -> ProbeConfig:
    changes = {"output": "tokens", **changes}
    return ProbeConfig(
        params=r"encoder\.layer\.1\.",
        mode="jvp",
        batches=4,
        drift_batches=None,
        batch_size=4,
        seed=3,
        chunk_size=8,
        **changes,
    )


def _rewritten(src: Path, out: Path, meta: dict | None = None, table: pa.Table | None = None) -> Path:
    """A copy of a run with its metadata or rows changed."""
    t = pq.read_table(src) if table is None else table
    m = json.loads(pq.read_schema(src).metadata[METADATA_KEY]) if meta is None else meta
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(m).encode()}), out)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, minilm_tokenizer) -> dict[str, Path]:
    """A token run of a tiny BERT (a few sentences and words), the same run at a 100 times larger
    learning rate, a run over other inputs (as many), and copies with a token, the probes'
    fingerprint or the kind of rows changed."""
    tok = minilm_tokenizer
    enc = HFEncoder(tiny_bert(tok), tok, max_length=14)
    folder = tmp_path_factory.mktemp("compare-runs")
    sents = split_sentences(DOCS)
    items = sents[:2] + top_words(13)  # every input within the model's 14 tokens
    out = {name: folder / f"{name}.parquet" for name in ("a", "lr", "other")}
    probe(enc, items, "simcse", sents, _config(), out=out["a"], progress=False)
    probe(enc, items, "simcse", sents, _config(lr=0.1), out=out["lr"], progress=False)
    probe(enc, top_words(15), "simcse", sents, _config(), out=out["other"], progress=False)
    for name, changes in (("pooled_a", {}), ("pooled_lr", {"lr": 0.1})):
        out[name] = folder / f"{name}.parquet"
        probe(enc, items, "simcse", sents, _config(output="pooled", **changes), out=out[name], progress=False)
    meta = json.loads(pq.read_schema(out["a"]).metadata[METADATA_KEY])
    table = pq.read_table(out["a"])
    ids = table.column("token_id").to_numpy().copy()
    ids[5] = 2003
    out["token"] = _rewritten(out["a"], folder / "token.parquet", table=table.set_column(4, "token_id", pa.array(ids)))
    assert table.column_names[4] == "token_id"
    fingerprints = dict(meta["input_fingerprints"], probes="0123456789abcdef")
    out["fingerprint"] = _rewritten(out["a"], folder / "fp.parquet", dict(meta, input_fingerprints=fingerprints))
    out["pooled"] = _rewritten(out["a"], folder / "pooled.parquet", dict(meta, output="pooled"))
    return out


def _load(runs, name: str) -> ProbeResult:
    return ProbeResult.load(runs[name])


def test_type_means_and_errors_are_the_runs(runs):
    """Each run's type means are `normfast aggregate`'s; heat_rel's error is aggregate's jackknife over
    the batch groups; D's and r_eq's the mean of the type's rows' errors."""
    table = _load(runs, "a").compare(_load(runs, "lr"))
    agg = aggregate(runs["a"], by="token")
    at = {k: i for i, k in enumerate(agg.column("token_id").to_pylist())}
    order = [at[k] for k in table.column("token_id").to_pylist()]
    assert sorted(order) == list(range(agg.num_rows))  # the same types
    for x in QUANTITIES:
        np.testing.assert_allclose(table[f"{x}_a"], agg[f"{x}_mean"].to_numpy()[order], rtol=1e-12)
    np.testing.assert_allclose(table["heat_rel_se_a"], agg["heat_rel_se_batches"].to_numpy()[order], rtol=1e-12)
    rows = pq.read_table(runs["a"]).to_pandas()
    rows = rows[(rows.position >= 0) & ~rows.is_special & rows.valid]
    k = json.loads(pq.read_schema(runs["a"]).metadata[METADATA_KEY])["groups"]
    rows["se_r_eq"] = (rows.r_eq_hi - rows.r_eq) / t_quantile(k - 1)
    by = rows.groupby("token_id")
    ids = table.column("token_id").to_pylist()
    np.testing.assert_allclose(table["D_se_a"], by.se_D.mean()[ids].to_numpy(), rtol=1e-12)
    np.testing.assert_allclose(table["r_eq_se_a"], by.se_r_eq.mean()[ids].to_numpy(), rtol=1e-12)
    diff = table["r_eq_b"].to_numpy() - table["r_eq_a"].to_numpy()
    se = np.hypot(table["r_eq_se_a"].to_numpy(), table["r_eq_se_b"].to_numpy())
    np.testing.assert_allclose(table["r_eq_diff"], diff)
    np.testing.assert_allclose(table["r_eq_z"], diff / se)


def test_a_run_against_itself_flags_nothing(runs):
    table = _load(runs, "a").compare(_load(runs, "a"))
    for x in QUANTITIES:
        assert (table[f"{x}_diff"].to_numpy() == 0).all() and not table[f"{x}_changed"].to_numpy().any()
    info = comparison_info(table)
    assert info["differs"] == "nothing: the same settings" and info["flagged"] == 0 and info["tests"] > 30


def test_a_larger_learning_rate_moves_r_eq_and_nothing_else(runs):
    """Same model, same batches, lr 100 times larger: drift and relative heat are the same numbers
    (exactly 0 difference, nothing flagged); the law's r_eq moves and is flagged for most types."""
    table = _load(runs, "a").compare(_load(runs, "lr"))
    for x in ("heat_rel", "D"):
        assert (table[f"{x}_diff"].to_numpy() == 0).all() and not table[f"{x}_changed"].to_numpy().any()
    flagged = table["r_eq_changed"].to_numpy()
    assert flagged.mean() > 0.5, flagged
    assert (table["r_eq_diff"].to_numpy()[flagged] > 0).all()  # a larger step settles at a larger norm
    assert table["changed"].to_pylist() == flagged.tolist()
    assert table["changed"].to_pylist()[: int(flagged.sum())] == [True] * int(flagged.sum())  # changes first
    info = comparison_info(table)
    assert info["differs"] == "config.lr 0.001 -> 0.1"
    assert "Benjamini-Hochberg at false-discovery rate q = 0.05" in info["test"]


def test_pooled_runs_are_compared_input_by_input(runs, tmp_path):
    a, b = _load(runs, "pooled_a"), _load(runs, "pooled_lr")
    table = a.compare(b)
    rows = a.table
    assert table.column_names[:2] == ["item", "id"] and table.num_rows == rows.num_rows
    at = {k: i for i, k in enumerate(table["item"].to_pylist())}
    order = [at[i] for i in rows["item"].to_pylist()]
    np.testing.assert_allclose(table["D_a"].to_numpy()[order], rows["D"].to_numpy(), rtol=1e-12)
    np.testing.assert_allclose(table["D_se_a"].to_numpy()[order], rows["se_D"].to_numpy(), rtol=1e-12)
    assert table["r_eq_changed"].to_numpy().all() and not table["D_changed"].to_numpy().any()
    assert main(["compare", str(runs["pooled_a"]), str(runs["pooled_lr"]), "--out", str(tmp_path / "p.html")]) == 0


def test_benjamini_hochberg():
    p = np.array([0.01, 0.04, 0.03, 0.2, np.nan])
    assert benjamini_hochberg(p, 0.05).tolist() == [True, False, False, False, False]
    assert benjamini_hochberg(np.array([0.04, 0.01, 0.03, 0.02]), 0.05).all()  # step-up: all under q
    assert benjamini_hochberg(np.array([0.04, 0.01, 0.03, 0.02]), 0.01).tolist() == [False, False, False, False]
    assert not benjamini_hochberg(np.array([np.nan]), 0.05).any()


def test_runs_over_other_inputs_are_refused_in_one_line(runs, capsys):
    cases = {
        "other": "the runs probe different inputs (input_fingerprints.probes",
        "fingerprint": "input_fingerprints.probes",
        "token": "the runs' inputs differ at row 5 (item 0, position 5): token",
        "pooled": "run A has tokens rows and run B pooled rows",
    }
    for name, message in cases.items():
        assert main(["compare", str(runs["a"]), str(runs[name]), "--out", str(runs["a"].with_name("x.html"))]) == 2
        err = capsys.readouterr().err
        assert err.startswith("normfast compare: error: ") and message in err and err.count("\n") == 1, (name, err)
    with pytest.raises(ValueError, match="expected q"):
        _load(runs, "a").compare(_load(runs, "a"), q=1.5)


def test_the_command_writes_the_page_and_the_table(runs, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert main(["compare", str(runs["a"]), str(runs["lr"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = pq.read_table(tmp_path / "page.compare.parquet")
    assert "what differs between the runs' settings: config.lr 0.001 -> 0.1" in printed
    assert f"wrote {tmp_path / 'page.compare.parquet'} (Parquet, {table.num_rows} types)" in printed
    expected = ["token_id", "token", "occurrences", "count_a", "count_b"]
    for x in QUANTITIES:
        expected += [f"{x}_{s}" for s in ("a", "se_a", "b", "se_b", "diff", "se", "z", "p")]
    expected += [f"{x}_changed" for x in QUANTITIES] + ["changed"]
    assert table.column_names == expected
    assert table.equals(_load(runs, "a").compare(_load(runs, "lr")))
    assert comparison_info(table)["b"] == str(runs["lr"])
    csv = tmp_path / "t.csv"
    assert main(["compare", str(runs["a"]), str(runs["lr"]), "--out", str(out), "--table", str(csv)]) == 0
    assert csv.read_text().splitlines()[0].split(",")[:3] == ['"token_id"', '"token"', '"occurrences"']
    default = runs["lr"].with_name("lr-vs-a.html")  # beside run B
    assert main(["compare", str(runs["a"]), str(runs["lr"])]) == 0
    assert default.exists() and default.with_name("lr-vs-a.compare.parquet").exists()
    html = out.read_text("utf-8")  # one file that loads nothing
    assert not re.search(r"<(link|img|iframe|object|embed)\b", html, re.I)
    assert not re.search(r"\b(src|href)\s*=", html, re.I)


# ---------------------------------------------------------------------------
# in a real browser


@pytest.fixture(scope="module")
def browser():
    yield from launch()


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare-html") / "lr-vs-a.html"
    assert main(["compare", str(runs["a"]), str(runs["lr"]), "--out", str(out)]) == 0
    return out


def test_the_page_loads_and_shows_the_tables_numbers(browser, page):
    table = pq.read_table(page.with_name("lr-vs-a.compare.parquet"))
    tab = Tab(browser)
    try:
        p = tab.open(page)
        n, flagged = table.num_rows, int(table["r_eq_changed"].to_numpy().sum())
        assert p.locator("#nf-fig-r_eq .nf-title").text_content() == f"r_eq: {flagged} of {n} token types changed"
        assert p.locator("#nf-fig-D .nf-title").text_content() == f"D: 0 of {n} token types changed"
        assert "config.lr 0.001 -> 0.1" in p.inner_text("#nf-header")
        p.click("#nf-types th[data-key='r_eq_diff']")  # the largest increase of r_eq first
        top = int(np.argmax(table["r_eq_diff"].to_numpy()))
        first = p.locator("#nf-types tbody tr").first
        assert first.locator("td").first.inner_text() == table["token"][top].as_py()
        cell = first.locator("td[data-key='r_eq_diff']")
        assert float(cell.get_attribute("data-value")) == pytest.approx(table["r_eq_diff"][top].as_py(), rel=1e-5)
        assert "±" in cell.inner_text()
        p.check("#nf-changed-only")
        assert p.locator("#nf-types tbody tr").count() == int(table["changed"].to_numpy().sum())
        assert tab.errors == []
    finally:
        tab.page.close()


def test_the_screenshot_is_not_blank(browser, page):
    assert_screenshot_not_blank(page, "compare", browser)
