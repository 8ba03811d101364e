"""A run's files are a plain Parquet dataset: DuckDB, Polars and pandas read a finished run (one
file), a sharded run (its parts, by a glob) and an unfinished run (its chunks) directly, with the
same rows and types as ``ProbeResult.load``. The code blocks of docs/view.md are the recipes:
every Python and SQL block there runs here, on a real corpus run laid out under the names the
docs use (``runs/news.parquet``; ``runs/big.rank*-of-*.parquet``, more than ten parts so that a
glob's order is not the item order; ``runs/live.parquet.parts/`` of an interrupted run)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from normfast.data.corpus import CorpusWindows, split_sentences
from normfast.data.io import read_metadata
from normfast.encoders import HFEncoder
from normfast.engine.probe import probe
from normfast.engine.report.aggregate import aggregate
from normfast.engine.result import ProbeResult
from tests._chunks import interrupted_at
from tests._models import tiny_bert
from tests.conftest import ROOT
from tests.data.test_corpus import _config as corpus_config
from tests.engine.report.test_view import DOCS, shard_run

duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.usefixtures("single_thread")

DOC = ROOT / "docs" / "view.md"
N_PARTS = 12
#: Arrow type of a run column -> the type DuckDB reads it as
DUCKDB_TYPES = {
    "int64": "BIGINT",
    "int32": "INTEGER",
    "int8": "TINYINT",
    "double": "DOUBLE",
    "bool": "BOOLEAN",
    "string": "VARCHAR",
    "list<element: double>": "DOUBLE[]",
}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def block(marker: str) -> str:
    """The one Python block of the page that contains ``marker`` (blocks move when the page grows)."""
    found = [b for b in blocks("python") if marker in b]
    assert len(found) == 1, f"{len(found)} Python blocks of {DOC.name} contain {marker!r}"
    return found[0]


@pytest.fixture(scope="module")
def layout(tmp_path_factory, minilm_tokenizer) -> Path:
    """``runs/news.parquet`` (a corpus run, one row group per chunk of 3 windows), ``runs/big.*``
    (the same run in chunks of one window sharded over 12 parts) and ``runs/live.parquet.parts``
    (the same run interrupted after 2 chunks) in a fresh folder."""
    folder = tmp_path_factory.mktemp("readers")
    docs = DOCS * 2
    windows = CorpusWindows(docs, minilm_tokenizer, max_length=14, stride=7)
    enc = HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer, max_length=14)
    config = corpus_config(seed=1)  # test_corpus's corpus run: one row group per chunk of 3 windows
    sents = split_sentences(docs)
    news = folder / "runs" / "news.parquet"
    probe(enc, windows, "simcse", sents, config, out=news, progress=False)
    assert len(windows) > N_PARTS
    shard_run(news, folder / "runs" / "big.parquet", N_PARTS, chunk_items=1)
    with interrupted_at(2), pytest.raises(KeyboardInterrupt):
        probe(enc, windows, "simcse", sents, config, out=folder / "runs" / "live.parquet", progress=False)
    return folder


@pytest.fixture
def inside(layout):
    before = os.getcwd()
    os.chdir(layout)
    yield layout
    os.chdir(before)


def _expected(layout: Path) -> dict[str, pa.Table]:
    full = ProbeResult.load(layout / "runs" / "news.parquet").table
    chunks = sorted((layout / "runs" / "live.parquet.parts").glob("chunk-*.parquet"))
    n_live = sum(pq.ParquetFile(c).metadata.num_rows for c in chunks)
    # an unfinished run's chunks lack the two columns that need every row (docs/view.md says so)
    live = full.slice(0, n_live).drop_columns(["heat_rel", "se_heat_rel"])
    return {"news": full, "big": full, "live": live}


def test_the_layouts_are_what_a_run_leaves(layout):
    runs = layout / "runs"
    parts = sorted(runs.glob("big.rank*-of-*.parquet"))
    assert len(parts) == N_PARTS and (runs / "big.manifest.json").exists() and not (runs / "live.parquet").exists()
    assert len(list((runs / "live.parquet.parts").glob("chunk-*.parquet"))) == 2
    # a glob lists rank10 and rank11 before rank2: its order is not the item order
    assert [p.name for p in parts][:4] == [f"big.rank{r}-of-{N_PARTS}.parquet" for r in (0, 1, 10, 11)]
    assert ProbeResult.load(runs / "big.manifest.json").table.equals(ProbeResult.load(runs / "news.parquet").table)


def _as_run_table(table: pa.Table, like: pa.Table) -> pa.Table:
    """The reader's table with the run's Arrow types; the cast must be exact (no value changes)."""
    assert table.column_names == like.column_names
    return table.cast(like.schema.remove_metadata(), safe=True)


def test_the_python_api_block_writes_pages(inside):
    ns: dict = {}
    exec(block("result.to_html("), ns)
    for name in ("sentences.html", "sentences-drift.html"):
        page = (inside / "runs" / name).read_text(encoding="utf-8")
        assert page.startswith("<!DOCTYPE html>") and '<script id="nf-data"' in page


def test_duckdb_recipes_give_the_runs_rows_and_types(inside):
    ns: dict = {}
    exec(block("import duckdb"), ns)
    expected = _expected(inside)
    for name, want in expected.items():
        rel = ns[name]
        assert [str(t) for t in rel.types] == [DUCKDB_TYPES[str(f.type)] for f in want.schema], name
        got = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
        got = got.read_all() if hasattr(got, "read_all") else got
        assert _as_run_table(got, want).equals(want.replace_schema_metadata(None)), name
    assert ns["settings"] == read_metadata(inside / "runs" / "news.parquet")


def test_polars_recipes_give_the_runs_rows_and_types(inside):
    from polars.testing import assert_frame_equal

    ns: dict = {}
    exec(block("import polars"), ns)
    expected = _expected(inside)
    for name in ("news", "big", "live"):
        want = pl.from_arrow(expected[name])
        assert ns[name].schema == want.schema, name
        assert_frame_equal(ns[name], want)
    assert ns["settings"] == read_metadata(inside / "runs" / "news.parquet")


def test_pandas_recipes_give_the_runs_rows_and_types(inside):
    ns: dict = {}
    exec(block("import pandas"), ns)
    expected = _expected(inside)
    for name in ("news", "big"):
        want = ProbeResult.load(inside / "runs" / "news.parquet").to_pandas()
        assert (ns[name].dtypes == want.dtypes).all(), name
        pd.testing.assert_frame_equal(ns[name], want)
    assert ns["settings"] == read_metadata(inside / "runs" / "news.parquet")
    assert len(expected["live"]) < len(expected["news"])


@pytest.mark.parametrize("by", ["token", "word"])
def test_the_docs_sql_gives_normfast_aggregates_answer(inside, by):
    """The hottest types of a corpus run in SQL (the docs' query) against `normfast aggregate`,
    on the single file and on the sharded parts."""
    sql = blocks("sql")[0 if by == "token" else 1]
    agg = aggregate(inside / "runs" / "news.parquet", by=by, min_count=3)
    mean = agg.column("V2_mean").to_numpy()
    order = np.argsort(-mean, kind="stable")[:10]
    key = "token" if by == "token" else "word"
    for source in ("runs/news.parquet", f"runs/big.rank*-of-{N_PARTS}.parquet"):
        rows = duckdb.sql(sql.replace("runs/news.parquet", source)).fetchall()
        assert len(rows) == min(10, agg.num_rows) >= 3
        got = {(r[1] if by == "token" else r[0]): r for r in rows}  # (token_id, token, ...) / (word, ...)
        for i in order:
            label = agg.column(key)[int(i)].as_py()
            r = got[label]
            assert r[-3] == agg.column("count")[int(i)].as_py(), label
            assert r[-2] == pytest.approx(mean[i], rel=1e-9), label
            assert r[-1] == pytest.approx(agg.column("V2_se")[int(i)].as_py(), rel=1e-9), label
        assert [r[-2] for r in rows] == sorted((r[-2] for r in rows), reverse=True)


def test_a_sharded_run_written_to_a_relative_path_reads_back(inside):
    """`torchrun ... --out runs/x.parquet`: the manifest names its parts relative to its own folder
    (a part path relative to the working directory is not stored as it is)."""
    manifest = shard_run(Path("runs/news.parquet"), Path("runs/rel.parquet"), 2)
    parts = [p["path"] for p in json.loads(manifest.read_text())["parts"]]
    assert parts == ["rel.rank0-of-2.parquet", "rel.rank1-of-2.parquet"]
    assert ProbeResult.load(manifest).table.equals(ProbeResult.load("runs/news.parquet").table)
