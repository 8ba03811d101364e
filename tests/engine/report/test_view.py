"""The run's page (`normfast view`, `ProbeResult.to_html`): what it holds, checked against the
run's Parquet and `normfast aggregate`, on small real runs (a tiny BERT with MiniLM's tokenizer
probing the demo's words, a few sentences, a corpus and its sharded form); then in a real
headless Chromium (playwright driving the system browser): it loads from file:// with no
console error and no network request, sorts, shows a token's values on hover, recolors, and
a screenshot of it is not blank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from normfast.cli import main
from normfast.data.corpus import CorpusWindows, split_sentences
from normfast.data.io import read_metadata
from normfast.data.manifest import manifest_path, part_path, write_manifest
from normfast.data.runwriter import ChunkedParquetWriter
from normfast.data.word_frequencies import top_words
from normfast.encoders import HFEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.probe import probe
from normfast.engine.report.aggregate import aggregate
from normfast.engine.report.page import page_data
from normfast.engine.result import ProbeResult
from normfast.engine.runner.distributed import part_blocks
from tests._browser import Tab, assert_screenshot_not_blank, launch
from tests._models import tiny_bert
from tests.data.test_corpus import DOCS  # a few sentences: words of several pieces, punctuation, an apostrophe

pytestmark = pytest.mark.usefixtures("single_thread")


def _config(output: str, chunk_size: int = 3) -> ProbeConfig:
    return ProbeConfig(
        params=r"encoder\.layer\.1\.",
        mode="jvp",
        output=output,
        batches=4,
        drift_batches=None,
        batch_size=4,
        seed=3,
        chunk_size=chunk_size,
    )


def shard_run(src: Path, out: Path, n_parts: int, chunk_items: int | None = None) -> Path:
    """A sharded run's files made from a finished run with the writer's own steps: its chunks (its
    row groups, or ``chunk_items`` items each) in the work folder, one part per rank (a contiguous
    block of chunks), the manifest. The files a torchrun of the run writes."""
    meta = read_metadata(src)
    pf = pq.ParquetFile(src)
    if chunk_items is None:
        chunks = [pf.read_row_group(g) for g in range(pf.metadata.num_row_groups)]
    else:
        table = pf.read()
        items = table.column("item").to_numpy()
        chunks = [
            table.filter(pa.array((items >= a) & (items < a + chunk_items)))
            for a in range(0, int(items.max()) + 1, chunk_items)
        ]
    n = len(chunks)
    writer = ChunkedParquetWriter(out, {"sharded copy of": str(src)}, overwrite=True)
    for g, chunk in enumerate(chunks):
        writer.write_chunk(g, chunk)
    parts = []
    for r, block in enumerate(part_blocks(n, n_parts)):
        path = part_path(out, r, n_parts)
        rows = writer.write_part(block, path, meta)
        parts.append({"path": str(path), "rows": rows, "chunks": [block.start, block.stop]})
    writer.cleanup()
    return write_manifest(manifest_path(out), parts, meta, writer.key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, minilm_tokenizer) -> dict[str, Path]:
    """Small real runs: the demo's words (tokens), a corpus (tokens, overlapping windows), sentences
    (pooled), and the corpus again as a sharded run of three parts."""
    tok = minilm_tokenizer
    enc = HFEncoder(tiny_bert(tok), tok, max_length=14)
    folder = tmp_path_factory.mktemp("view-runs")
    sents = split_sentences(DOCS)
    out = {
        "words": folder / "words" / "words.parquet",
        "corpus": folder / "corpus.parquet",
        "pooled": folder / "pooled.parquet",
    }
    probe(enc, top_words(40), "simcse", sents, _config("tokens", 16), out=out["words"], progress=False)
    probe(
        enc,
        CorpusWindows(DOCS, tok, max_length=14, stride=7),
        "simcse",
        sents,
        _config("tokens"),
        out=out["corpus"],
        progress=False,
    )
    probe(enc, sents + top_words(12), "simcse", sents, _config("pooled", 8), out=out["pooled"], progress=False)
    out["sharded"] = shard_run(out["corpus"], folder / "sharded" / "corpus.parquet", 3)
    return out


def embedded(page: Path) -> dict:
    text = page.read_text(encoding="utf-8")
    m = re.search(r'<script id="nf-data" type="application/json">(.*?)</script>', text, re.S)
    assert m, "the page has no data element"
    return json.loads(m.group(1))


def _view(*args: str) -> int:
    return main(["view", *map(str, args)])


# ---------------------------------------------------------------------------
# the page's data against the run


@pytest.mark.parametrize("kind", ["words", "corpus", "pooled", "sharded"])
def test_view_writes_the_page_of_every_kind_of_run(runs, kind, tmp_path, capsys):
    out = tmp_path / f"{kind}.html"
    assert _view(runs[kind], "--out", out) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = embedded(out)
    run = ProbeResult.load(runs[kind])
    table = run.table
    assert data["totals"]["rows"] == len(run) and data["rows"]["n"] == len(run)  # small runs: every row shown
    assert data["stat"] == "V2" and data["kind"] == {"words": "tokens", "pooled": "pooled"}.get(kind, "corpus")
    # every row's heat, in the run's order, as the Parquet holds it (4 significant digits on the page)
    np.testing.assert_allclose(np.array(data["rows"]["v"]["V2"], float), table.column("V2").to_numpy(), rtol=6e-4)
    assert data["rows"]["item"] == table.column("item").to_pylist()
    header = " ".join(data["header"]["lines"])
    assert header.startswith("probe run: ") and "regime: " in header
    assert "where each norm would settle" in data["header"]["reading"]
    if kind == "pooled":
        assert data["types"] == {} and data["rows"]["text"][0] == table.column("text")[0].as_py()
        return
    by = ["token", "word"] if kind in ("corpus", "sharded") else ["token"]
    assert sorted(data["types"]) == sorted(by)
    for b in by:
        agg = aggregate(runs[kind], by=b)
        got = data["types"][b]
        assert got["label"] == agg.column("token" if b == "token" else "word").to_pylist()
        assert got["count"] == agg.column("count").to_pylist()
        np.testing.assert_allclose(np.array(got["q"]["V2"]["mean"], float), agg.column("V2_mean").to_numpy(), rtol=1e-5)
    # the text view: every document token once (corpus runs: duplicates of overlapping windows left out)
    if kind != "words":
        primary = table.column("primary").to_numpy(zero_copy_only=False)
        special = table.column("is_special").to_numpy(zero_copy_only=False)
        assert sum(len(d["view"]) for d in data["docs"]) == int((primary & ~special).sum())
        assert [d["label"].split(":")[0] for d in data["docs"]] == ["0", "1", "2", "3"]
        assert data["docs"][0]["label"].startswith("0: The river flooded the valley.")
        shown = " ".join(data["rows"]["tok"][i] for i in data["docs"][1]["view"])
        assert "Extraordinarily" in shown.replace(" ", "") and "committee" in shown


def test_a_sharded_run_and_a_folder_give_the_single_files_page(runs, tmp_path):
    single, sharded = page_data(ProbeResult.load(runs["corpus"])), page_data(ProbeResult.load(runs["sharded"]))
    folder = page_data(ProbeResult.load(runs["words"].parent))  # the folder holding one run
    assert folder["rows"] == page_data(ProbeResult.load(runs["words"]))["rows"]
    for key in ("rows", "docs", "types", "hist", "totals"):
        assert single[key] == sharded[key], key


def test_to_html_view_and_the_notebook_summary(runs, tmp_path):
    run = ProbeResult.load(runs["corpus"])
    path = run.to_html(tmp_path / "page.html", stat="D", docs=2, seed=1)
    data = embedded(path)
    assert path.exists() and data["stat"] == "D" and len(data["docs"]) == 2 and data["sample"]["of"] == 4
    assert "2 of the run's 4 documents, drawn at random (seed 1)" in data["header"]["sample"]
    assert embedded(run.to_html(tmp_path / "again.html", stat="D", docs=2, seed=1)) == data  # seeded
    inline = run.view(height=500)._repr_html_()
    assert inline.startswith("<iframe srcdoc=") and "height:500px" in inline and "&lt;script" in inline
    summary = run._repr_html_()
    assert "<table>" in summary and "probe run: " in summary and "median" in summary
    assert (
        "regime: LAW APPLICABLE" in summary
        or "regime: HEAT-DOMINATED" in summary
        or "regime: NOT APPLICABLE" in summary
    )
    # an in-memory result (probe without out=) has the same page as its file
    memory = ProbeResult(run.table, run.metadata)
    assert page_data(memory)["types"] == page_data(run)["types"]


def test_large_runs_are_sampled_to_a_bounded_page(runs, tmp_path):
    """A run 200 times the words run: the page keeps a seeded sample of inputs under the row limit
    and the most frequent types, so its size does not grow with the run."""
    small = tiled(runs["words"], 100, tmp_path / "tiled100.parquet")
    large = tiled(runs["words"], 200, tmp_path / "tiled200.parquet")
    sizes = []
    for path in (small, large):
        out = path.with_suffix(".html")
        assert _view(path, "--docs", "300", "--max-rows", "600", "--max-types", "25") == 0
        data = embedded(out)
        assert data["rows"]["n"] <= 600 and len(data["docs"]) <= 300 and data["types"]["token"]["n"] == 25
        assert not data["sample"]["all"] and data["totals"]["rows"] == pq.ParquetFile(path).metadata.num_rows
        t = pq.read_table(path, columns=["V2", "valid", "is_special"]).to_pandas()
        assert data["hist"]["total"] == int((t.valid & ~t.is_special & (t.V2 > 0)).sum())  # every row
        assert data["types"]["token"]["total"] == aggregate(path).num_rows
        sizes.append(out.stat().st_size)
    assert abs(sizes[1] / sizes[0] - 1) < 0.05, sizes


def test_the_page_is_cut_to_its_size_limit(runs, monkeypatch):
    """Whatever the labels' lengths, the data never exceeds the page's byte budget: whole documents
    and the least frequent types are cut, and the page says so."""
    import normfast.engine.report.page.build as build

    run = ProbeResult.load(runs["corpus"])
    full = page_data(run)
    budget = int(build._size(full) * 0.6)
    monkeypatch.setattr(build, "MAX_DATA_BYTES", budget)
    cut = page_data(run)
    assert build._size(cut) <= budget < build._size(full)
    assert "Cut to fit the page's size limit" in cut["header"]["sample"]
    n = cut["rows"]["n"]
    assert n < full["rows"]["n"] and all(len(v) == n for v in cut["rows"]["v"].values())
    assert cut["rows"]["tok"] == full["rows"]["tok"][:n] and cut["docs"] == full["docs"][: len(cut["docs"])]


def test_refuses_what_is_not_a_run(runs, tmp_path, capsys):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), plain)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    both = tmp_path / "two"
    both.mkdir()
    for name in ("a", "b"):
        (both / f"{name}.parquet").write_bytes(runs["pooled"].read_bytes())
    agg = tmp_path / "corpus.by-token.parquet"
    assert main(["aggregate", str(runs["corpus"]), "--out", str(agg), "--no-progress"]) == 0
    capsys.readouterr()
    cases = [
        (plain, "not a normfast run"),
        (text, "not a normfast run (not a Parquet file"),
        (tmp_path / "missing.parquet", "does not exist"),
        (both, "holds 2 runs (a.parquet, b.parquet)"),
        (agg, "per-type table written by `normfast aggregate`"),
        (tmp_path, "holds no normfast run"),
    ]
    for path, message in cases:
        assert _view(path) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("normfast view: error: ") and message in err, (path, err)
    parts = tmp_path / "x.parquet.parts"
    parts.mkdir()
    assert _view(parts) == 2 and "unfinished run" in capsys.readouterr().err
    assert _view(runs["words"], "--stat", "nope") == 2
    assert "choose one of ['V2', 'D', 'norm'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected docs to be a positive int, got 0"):
        page_data(ProbeResult.load(runs["words"]), docs=0)
    with pytest.raises(ValueError, match="ending in .html"):
        ProbeResult.load(runs["words"]).to_html(tmp_path / "page.txt")


def test_the_page_is_one_file_that_loads_nothing(runs, tmp_path):
    out = tmp_path / "corpus.html"
    assert _view(runs["corpus"], "--out", out) == 0
    html = out.read_text(encoding="utf-8")
    assert not re.search(r"<(link|img|iframe|object|embed)\b", html, re.I)
    assert not re.search(r"\b(src|href)\s*=", html, re.I)
    assert not re.search(r"\b(fetch|XMLHttpRequest|import\s*\(|@import|WebSocket)\b", html)
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= {"http://www.w3.org/2000/svg"}  # a namespace name


# ---------------------------------------------------------------------------
# in a real browser


@pytest.fixture(scope="module")
def browser():
    yield from launch()


def tiled(run: Path, k: int, out: Path) -> Path:
    """A token run ``k`` times as large: the run's rows repeated with new item indices."""
    base = pq.read_table(run)
    n_items = int(base.column("item").to_numpy().max()) + 1
    parts = [base.set_column(0, "item", pa.array(base.column("item").to_numpy() + i * n_items)) for i in range(k)]
    pq.write_table(pa.concat_tables(parts).replace_schema_metadata(base.schema.metadata), out, row_group_size=4096)
    return out


@pytest.fixture(scope="module")
def pages(runs, tmp_path_factory) -> dict[str, Path]:
    """The pages of the small runs, and of a run 200 times the words run, sampled (a large run)."""
    folder = tmp_path_factory.mktemp("view-pages")
    out = {}
    for kind in ("words", "corpus", "pooled"):
        out[kind] = folder / f"{kind}.html"
        assert _view(runs[kind], "--out", out[kind]) == 0
    out["large"] = folder / "large.html"
    assert _view(tiled(runs["words"], 200, folder / "large.parquet"), "--docs", "500", "--out", out["large"]) == 0
    assert not embedded(out["large"])["sample"]["all"]
    return out


@pytest.fixture(scope="module")
def tab(browser):
    t = Tab(browser)
    yield t
    t.page.close()


def test_pages_load_offline_without_errors(tab, pages):
    for kind, path in pages.items():
        page = tab.open(path)
        assert page.locator("#nf-rows tbody tr").count() > 0, kind
        assert page.locator("#nf-fig-heat rect").count() > 0, kind
        assert page.locator("#nf-fig-law path").count() > 0, kind
        assert (page.locator(".nf-tok").count() > 0) == (kind != "pooled"), kind
        if kind == "large":  # a sampled page: the type table holds every type, the rows the sample
            assert "most frequent" not in page.inner_text("#nf-type-status")
            assert "drawn at random (seed 0)" in page.inner_text(".nf-sample")


def test_sorting_types_by_V2_puts_the_hottest_type_first(tab, pages, runs):
    from normfast.engine.report.ranking import rank_types

    page = tab.open(pages["corpus"])
    agg = aggregate(runs["corpus"], by="token")
    # at first, ranked as every list is: relative heat, types seen twice or more, no punctuation
    ranking = rank_types(agg, min_count=2)
    rows = page.locator("#nf-types tbody tr")
    assert rows.first.locator("td").first.inner_text() == ranking.labels[ranking.order[0]]
    assert rows.count() == min(len(ranking.order), 200)  # the first page of rows
    assert page.locator("#nf-type-min").input_value() == "2"
    note = page.locator("#nf-type-rank").inner_text()
    assert "relative heat" in note and "seen at least 2 times" in note
    assert f"{ranking.below_min_count} types seen fewer times and {ranking.punctuation} punctuation" in note
    page.fill("#nf-type-min", "1")
    page.check("#nf-type-punct")
    v2 = agg.column("V2_mean").to_numpy()
    hottest = int(np.nanargmax(v2))
    page.click("#nf-types th[data-key='V2']")
    first = page.locator("#nf-types tbody tr").first
    assert first.locator("td").first.inner_text() == agg.column("token")[hottest].as_py()
    cell = first.locator("td[data-key='V2']")
    assert float(cell.get_attribute("data-value")) == pytest.approx(v2[hottest], rel=1e-5)
    assert cell.inner_text().startswith(f"{v2[hottest]:.4g}"[:4])
    page.click("#nf-types th[data-key='V2']")  # again: the coldest first
    assert (
        page.locator("#nf-types tbody tr").first.locator("td").first.inner_text()
        == agg.column("token")[int(np.nanargmin(v2))].as_py()
    )
    page.fill("#nf-type-filter", "the")
    labels = page.locator("#nf-types tbody tr td:first-child").all_inner_texts()
    assert labels and all("the" in s.lower() for s in labels)
    page.fill("#nf-type-filter", "")
    page.fill("#nf-type-min", "2")
    counts = [int(s.replace(",", "")) for s in page.locator("#nf-types tbody tr td:nth-child(2)").all_inner_texts()]
    assert counts and min(counts) >= 2 and len(counts) == int((agg.column("count").to_numpy() >= 2).sum())


def test_hovering_a_token_shows_its_values(tab, pages, runs):
    page = tab.open(pages["corpus"])
    table = pq.read_table(runs["corpus"]).to_pandas()
    row = table[(table.doc_id == "1") & ~table.is_special & table.primary].iloc[2]
    token = page.locator(f".nf-tok[data-item='{row['item']}'][data-pos='{row['position']}']")
    token.hover()
    tip = page.locator("#nf-tip")
    assert tip.is_visible()
    for q in ("V2", "D", "norm", "r_eq", "kappa"):
        got = float(tip.locator(f"td[data-q='{q}']").get_attribute("data-value"))
        assert got == pytest.approx(row[q], rel=1e-3), q
    text = tip.inner_text()
    assert "±" in text and "[" in text and row["regime"] in text
    page.mouse.move(1, 1)
    page.locator("#nf-controls").hover()
    assert not tip.is_visible()


def test_switching_the_statistic_recolors_the_text(tab, pages):
    page = tab.open(pages["corpus"])

    def colors():
        return page.eval_on_selector_all(".nf-tok:not(.nf-special)", "els => els.map(e => e.style.background)")

    before = colors()
    assert len(set(before)) > 3
    page.select_option("#nf-stat", "D")
    after = colors()
    assert len(after) == len(before) and after != before and len(set(after)) > 3
    assert "diverging" in page.inner_text("#nf-legend") and page.inner_text(".nf-stat-name") == "D (drift)"
    page.select_option("#nf-stat", "V2")
    assert colors() == before


def test_the_screenshot_is_not_blank(browser, pages):
    """The top of the page as a PNG under runs/ (what `normfast view --screenshot` saves), with content."""
    assert_screenshot_not_blank(pages["corpus"], "corpus", browser)


def test_the_screenshot_option_is_wired(runs, tmp_path, monkeypatch, capsys):
    import normfast.apps.view as view

    calls = []

    def fake(page, png, width, height):
        calls.append((page, png, width, height))
        png.write_bytes(b"png")
        return png

    monkeypatch.setattr(view, "screenshot", fake)
    out, png = tmp_path / "p.html", tmp_path / "p.png"
    assert _view(runs["words"], "--out", out, "--screenshot", png, "--width", "800", "--height", "600") == 0
    assert calls == [(out, png, 800, 600)] and f"wrote {png}" in capsys.readouterr().out
