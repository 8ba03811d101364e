"""The public API's promises: explicit virtual batches, tensor- and dataset-backed pair sources,
a user's collate never skipped, nn.Sequential split into stages with its head, the objective's
settings in the summary and metadata, to_pandas without pandas, and a resume that survives a
truncated chunk and names what changed."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import normfast
from normfast.data import batches as batches_module

pytestmark = pytest.mark.usefixtures("single_thread")


def _data(n_items=9, n_pairs=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_items, 6, generator=g),
        torch.randn(n_pairs, 6, generator=g),
        torch.randn(n_pairs, 6, generator=g),
    )


def _net(seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5))


def config(**kw) -> normfast.ProbeConfig:
    """A small run: 16 drift batches (the default 1024 is the subject of test_drift.py)."""
    kw.setdefault("drift_batches", 16)
    return normfast.ProbeConfig(**kw)


def _probe(encoder, items, pairs, config, objective="infonce", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # toy models: scale-invariance notes etc.
        return normfast.probe(encoder, items, objective, pairs, config, progress=False, **kw)


# ---------------------------------------------------------------------------
# explicit virtual batches

BATCHES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 5, 10, 15], [3, 7, 11, 23]]


def test_batch_indices_replace_the_draw(monkeypatch):
    items, a, p = _data()
    src = normfast.PairSource.from_tensors(a, p)
    enc = normfast.ModuleEncoder(_net())
    per_batch = dict(batches=5, batch_size=4, drift_batches=None)  # the M heat batches give the drift too
    explicit = _probe(enc, items, src, config(**per_batch, batch_indices=BATCHES))
    # the same batches through the old route (patching the draw) give the same table
    monkeypatch.setattr(
        batches_module, "virtual_batches", lambda n, M, B, seed=0: [np.array(b, dtype=np.int64) for b in BATCHES]
    )
    patched = _probe(enc, items, src, config(**per_batch))
    assert explicit.table.drop(["reason"]).equals(patched.table.drop(["reason"]))
    monkeypatch.undo()
    drawn = _probe(enc, items, src, config(**per_batch))
    assert not np.allclose(drawn.column("V2"), explicit.column("V2"))
    # the default draw is reproducible by hand: seed -> rng -> virtual_batches
    seed = int(np.random.default_rng(0).integers(2**31))
    by_hand = [b.tolist() for b in normfast.virtual_batches(len(src), 5, 4, seed)]
    again = _probe(enc, items, src, config(**per_batch, batch_indices=by_hand))
    np.testing.assert_array_equal(again.column("V2"), drawn.column("V2"))
    assert explicit.metadata["config"]["batch_indices"] == BATCHES


def test_batch_indices_with_separate_drift_batches(monkeypatch):
    """One list in the layout of the draw: the M_D drift batches, the first M of them the heat's."""
    items, a, p = _data()
    src = normfast.PairSource.from_tensors(a, p)
    enc = normfast.ModuleEncoder(_net())
    rng = np.random.default_rng(5)
    eight = [sorted(rng.choice(24, 4, replace=False).tolist()) for _ in range(8)]
    layout = dict(batches=3, drift_batches=8, groups=4, batch_size=4)
    explicit = _probe(enc, items, src, config(**layout, batch_indices=eight))
    monkeypatch.setattr(
        batches_module, "virtual_batches", lambda n, M, B, seed=0: [np.array(b, dtype=np.int64) for b in eight[:M]]
    )
    patched = _probe(enc, items, src, config(**layout, heat_sampling="uniform"))  # the heat: the first M
    for col in ("D", "se_D", "V2", "m2", "kappa", "r_eq"):
        np.testing.assert_array_equal(explicit.column(col), patched.column(col), err_msg=col)
    # the heat comes from the first M only: the same first three batches, other drift batches -> same V2
    other = eight[:3] + [sorted(rng.choice(24, 4, replace=False).tolist()) for _ in range(5)]
    moved = _probe(enc, items, src, config(**layout, batch_indices=other))
    np.testing.assert_allclose(moved.column("V2"), explicit.column("V2"), rtol=1e-12)
    assert not np.allclose(moved.column("D"), explicit.column("D"))


@pytest.mark.parametrize(
    "batches, kw, error, match",
    [
        (BATCHES, {"batches": 4, "drift_batches": None}, ValueError, r"holds 5 batches but batches=4; pass batches=5"),
        (
            BATCHES,
            {"batches": 5, "drift_batches": 16},
            ValueError,
            r"holds 5 batches but the drift comes from drift_batches=16 batches \(the first batches=5 of them are also "
            r"the heat's\): pass 16 batches, or drift_batches=None for the per-batch drift of the 5 heat batches",
        ),
        (
            BATCHES,
            {"batches": 2, "drift_batches": 16, "groups": 4},
            ValueError,
            r"pass 16 batches, or drift_batches=5 to take the drift from these 5$",
        ),
        (
            BATCHES[:4] + [[1, 2, 3]],
            {"batches": 5, "drift_batches": None},
            ValueError,
            r"batch_indices\[4\] has 3 indices but batch_size=4",
        ),
        (
            BATCHES[:4] + [[1, 2, 2, 3]],
            {"batches": 5, "drift_batches": None},
            ValueError,
            r"batch_indices\[4\] repeats index 2",
        ),
        (
            BATCHES[:4] + [[0.0, 1, 2, 3]],
            {"batches": 5, "drift_batches": None},
            TypeError,
            r"batch_indices\[4\] to be a 1-D sequence of integer",
        ),
        ([[0, 1, 2, 3]], {"batches": 2, "drift_batches": None}, ValueError, r"at least 2 batches"),
        ("0123", {"batches": 2, "drift_batches": None}, TypeError, r"sequence of batches"),
    ],
)
def test_batch_indices_are_validated(batches, kw, error, match):
    with pytest.raises(error, match=match):
        normfast.ProbeConfig(batch_size=4, batch_indices=batches, **kw).validate()


def test_batch_indices_out_of_the_pair_source_are_refused():
    items, a, p = _data(n_pairs=12)
    src = normfast.PairSource.from_tensors(a, p)
    cfg = config(batches=5, batch_size=4, drift_batches=None, batch_indices=BATCHES)  # 15 and 23 >= 12
    with pytest.raises(IndexError, match=r"batch_indices\[3\] has indices outside \[0, 12\).*max=15"):
        _probe(normfast.ModuleEncoder(_net()), items, src, cfg)


# ---------------------------------------------------------------------------
# pair sources


def test_tensor_source_matches_the_list_source():
    items, a, p = _data()
    src = normfast.PairSource.from_tensors(a, positives=p)
    assert src.kind == "pairs" and len(src) == 24
    first, second = src.batch([3, 1])
    assert torch.equal(first, a[[3, 1]]) and torch.equal(second, p[[3, 1]])
    enc = normfast.ModuleEncoder(_net())
    cfg = config(batches=4, batch_size=6)
    from_tensors = _probe(enc, items, src, cfg)
    from_lists = _probe(enc, list(items), list(zip(a, p)), cfg)
    np.testing.assert_allclose(from_tensors.column("V2"), from_lists.column("V2"), rtol=1e-12)
    np.testing.assert_allclose(from_tensors.column("D"), from_lists.column("D"), rtol=1e-12, atol=1e-15)


def test_tensor_source_labels_and_items():
    a = np.random.default_rng(0).normal(size=(10, 6)).astype(np.float32)
    labels = np.array(["b", "a", "b", "c", "a", "b", "c", "a", "b", "c"])
    src = normfast.PairSource.from_tensors(a, labels=labels)
    assert src.kind == "labels" and src.classes == ["a", "b", "c"]
    x, y = src.batch(np.array([0, 1, 2]))
    assert isinstance(x, torch.Tensor) and x.shape == (3, 6) and y.tolist() == [1, 0, 1]
    res = _probe(
        normfast.ModuleEncoder(_net()),
        torch.from_numpy(a[:3]),
        src,
        config(batches=3, batch_size=6),
        objective="supcon",
    )
    assert res.column("valid").all()
    items = normfast.PairSource.from_tensors(torch.arange(5.0)[:, None])
    assert items.kind == "items" and items.batch([4, 0]).tolist() == [[4.0], [0.0]]
    with pytest.raises(ValueError, match="not both"):
        normfast.PairSource.from_tensors(a, positives=a, labels=labels)
    with pytest.raises(ValueError, match=r"as many positives as anchors.*positives.shape=\(9, 6\)"):
        normfast.PairSource.from_tensors(a, positives=a[:9])
    with pytest.raises(ValueError, match=r"one label per anchor"):
        normfast.PairSource.from_tensors(a, labels=labels[:4])
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        src.batch([10])


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, a, p):
        self.a, self.p, self.reads = a, p, 0

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        self.reads += 1
        return self.a[i], self.p[i]


def test_dataset_source_reads_on_demand_and_matches_the_tensor_source():
    items, a, p = _data()
    ds = _Pairs(a, p)
    src = normfast.PairSource.from_dataset(ds)
    assert src.kind == "pairs" and ds.reads == 1  # kind inferred from dataset[0] only
    anchors, positives = src.batch([2, 5])
    assert isinstance(anchors, list) and torch.equal(anchors[1], a[5]) and torch.equal(positives[0], p[2])
    enc = normfast.ModuleEncoder(_net())
    cfg = config(batches=4, batch_size=6)
    via_dataset = _probe(enc, items, ds, cfg)  # a Dataset given as pairs= is read on demand
    via_tensors = _probe(enc, items, normfast.PairSource.from_tensors(a, p), cfg)
    np.testing.assert_allclose(via_dataset.column("V2"), via_tensors.column("V2"), rtol=1e-12)


def test_a_loaders_collate_is_applied_never_skipped():
    items, a, p = _data()
    calls = []

    def collate(rows):
        calls.append(len(rows))
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(a, p), batch_size=3, collate_fn=collate)
    src = normfast.PairSource.from_dataset(loader)
    first, second = src.batch([0, 7, 3])
    assert calls == [3] and torch.equal(first, a[[0, 7, 3]]) and torch.equal(second, p[[0, 7, 3]])
    labelled = normfast.PairSource.from_dataset(torch.utils.data.TensorDataset(a, torch.arange(24) % 3))
    assert labelled.kind == "labels" and labelled.batch([4, 5])[1].tolist() == [1, 2]
    bad = normfast.PairSource.from_dataset(loader, collate=lambda rows: torch.zeros(3))
    with pytest.raises(ValueError, match=r"must return \(anchors, positives\)"):
        bad.batch([0, 1, 2])
    with pytest.raises(TypeError, match="map-style dataset"):
        normfast.PairSource.from_dataset(iter([1, 2]))


def test_module_encoder_applies_its_collate_to_tensor_items():
    seen = []

    def collate(rows):
        seen.append(type(rows).__name__)
        return torch.stack([torch.as_tensor(r) for r in rows]) * 2.0

    enc = normfast.ModuleEncoder(_net(), collate=collate)
    x = torch.randn(4, 6)
    z_tensor = enc.encode(x)
    z_list = enc.encode(list(x))
    assert seen == ["list", "list"]  # a tensor batch reaches collate as its rows
    torch.testing.assert_close(z_tensor, z_list)
    torch.testing.assert_close(z_tensor, _net()(2.0 * x))


# ---------------------------------------------------------------------------
# nn.Sequential and heads


def test_sequential_is_split_and_its_last_linear_is_the_head():
    enc = normfast.ModuleEncoder(_net())
    assert enc.n_stages == 3 and [n for n, _ in enc.stages] == ["blocks.0.0", "blocks.0.1", "blocks.0.2"]
    assert enc.head().weight_name == "blocks.0.2.weight"
    assert "blocks.0.2.weight" in dict(enc.named_parameters())  # parameter names as before the split
    items, a, p = _data()
    cfg = config(params="head", batches=4, batch_size=6)
    res = _probe(enc, items, normfast.PairSource.from_tensors(a, p), cfg)
    assert res.metadata["mode"] == "head"
    assert res.metadata["encoder_note"] == (
        "nn.Sequential split into 3 stages; head = blocks.0.2 (its last module, an nn.Linear)"
    )
    assert "encoder: nn.Sequential split into 3 stages; head = blocks.0.2" in res.format_summary()
    # the same numbers as the explicit list of stages, in jvp mode
    as_list = normfast.ModuleEncoder(list(_net()))
    jvp = _probe(
        as_list,
        items,
        normfast.PairSource.from_tensors(a, p),
        config(params=r"blocks\.2\.", mode="jvp", batches=4, batch_size=6),
    )
    np.testing.assert_allclose(res.column("V2"), jvp.column("V2"), rtol=1e-5)
    assert jvp.metadata["encoder_note"] is None
    # load_encoder wraps a Sequential the same way
    assert normfast.load_encoder(_net()).head() is not None


class _Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.proj = nn.Linear(6, 12), nn.Linear(12, 5)

    def forward(self, x):
        return self.proj(torch.tanh(self.body(x)))


def test_without_a_visible_head_the_error_says_what_to_pass():
    items, a, p = _data()
    src = normfast.PairSource.from_tensors(a, p)
    with pytest.raises(
        ValueError,
        match=r"pass its stages as a list that ends with the final nn.Linear, "
        r"e.g. ModuleEncoder\(\[model.body, model.proj\]\)",
    ):
        _probe(normfast.ModuleEncoder(_Opaque()), items, src, config(params="head", batches=2, batch_size=4))
    with pytest.raises(ValueError, match=r"has no head: .*opaque stage"):
        _probe(normfast.ModuleEncoder(_Opaque()), items, src, config(mode="head", batches=2, batch_size=4))
    relu_last = normfast.ModuleEncoder(nn.Sequential(nn.Linear(6, 5), nn.ReLU()))
    assert relu_last.head() is None and "its last module is ReLU" in relu_last.note
    with pytest.raises(ValueError, match=r"the last stage \(blocks.0.1\) is ReLU, not an nn.Linear"):
        _probe(relu_last, items, src, config(params="head", batches=2, batch_size=4))


# ---------------------------------------------------------------------------
# objective settings, CLI flags, pandas


def test_objective_settings_in_metadata_and_summary():
    items, a, p = _data()
    src = normfast.PairSource.from_tensors(a, p)
    enc = normfast.ModuleEncoder(_net())
    cfg = config(batches=4, batch_size=6)
    one = _probe(enc, items, src, cfg, objective=normfast.InfoNCE(temperature=0.2))
    both = _probe(enc, items, src, cfg, objective=normfast.InfoNCE(temperature=0.2, symmetric=True))
    assert one.metadata["objective_settings"] == {"temperature": 0.2, "symmetric": False}
    assert both.metadata["objective_settings"] == {"temperature": 0.2, "symmetric": True}
    assert "objective infonce (temperature=0.2, symmetric=True)" in both.format_summary()
    assert not np.allclose(one.column("V2"), both.column("V2"))  # the setting reaches the directions


def test_cli_symmetric_and_temperature(tmp_path, tiny_bert_folder, capsys):
    from normfast.cli import main

    words = tmp_path / "words.txt"
    words.write_text("apple\nriver\nthe\nblue\n")
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(
        "".join(
            f"{a}\t{b}\n"
            for a, b in [
                ("cat", "feline"),
                ("dog", "canine"),
                ("sun", "star"),
                ("car", "vehicle"),
                ("tree", "plant"),
                ("sea", "ocean"),
            ]
        )
    )
    common = [
        "probe",
        str(tiny_bert_folder),
        "--probes",
        str(words),
        "--pairs",
        str(pairs),
        "--objective",
        "infonce",
        "--batches",
        "3",
        "--drift-batches",
        "8",
        "--batch-size",
        "4",
        "--no-progress",
        "--params",
        r"encoder\.layer\.1\.",
    ]
    assert main([*common, "--temperature", "0.1", "--symmetric", "--tokens", "--out", str(tmp_path / "s.parquet")]) == 0
    out = capsys.readouterr().out
    assert "objective infonce (temperature=0.1, symmetric=True)" in out
    meta = normfast.read_metadata(tmp_path / "s.parquet")
    assert meta["objective_settings"] == {"temperature": 0.1, "symmetric": True}
    table = pq.read_table(tmp_path / "s.parquet")
    special = table.column("is_special").to_numpy()
    tokens = table.column("token").to_pylist()
    assert {t for t, s in zip(tokens, special) if s} == {"[CLS]", "[SEP]"}
    assert not {"[CLS]", "[SEP]"} & {t for t, s in zip(tokens, special) if not s}
    assert main([*common, "--temperature", "0.1", "--tokens", "--out", str(tmp_path / "o.parquet")]) == 0
    capsys.readouterr()
    one_sided = pq.read_table(tmp_path / "o.parquet").column("V2").to_numpy()
    assert not np.allclose(one_sided, table.column("V2").to_numpy())
    assert main([*common[:-2], "--symmetric", "--objective", "simcse", "--out", str(tmp_path / "x.parquet")]) == 2
    assert "--symmetric applies to --objective infonce" in capsys.readouterr().err


def test_to_pandas_without_pandas_says_how_to_get_it(monkeypatch):
    result = normfast.ProbeResult(__import__("pyarrow").table({"a": [1, 2]}), {})
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas -> ImportError
    with pytest.raises(ImportError, match=r'pip install "normfast\[pandas\]".*result.table'):
        result.to_pandas()
    monkeypatch.undo()
    pytest.importorskip("pandas")
    assert list(result.to_pandas()["a"]) == [1, 2]


# ---------------------------------------------------------------------------
# numerical conditions are counted, not warned


def test_kappa_nonpositive_is_counted_into_the_summary_not_warned():
    torch.manual_seed(3)
    lin = nn.Linear(6, 5)
    with torch.no_grad():
        lin.weight.mul_(0.05)
        lin.bias.copy_(torch.tensor([3.0, -2.0, 1.0, 0.5, 2.0]))
    items, a, p = _data(n_items=40)
    cfg = config(batches=3, batch_size=6, no_decay="bias")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = _probe(normfast.ModuleEncoder([lin]), items, normfast.PairSource.from_tensors(a, p), cfg)
    kappa = res.column("kappa")
    n_bad = int(np.sum(kappa <= 0))
    assert 0 < n_bad < len(kappa)
    n_nan = int(np.sum((kappa <= 0) & ~np.isfinite(res.column("r_eq"))))
    summary = res.format_summary()
    line = next(ln for ln in summary.splitlines() if ln.startswith("kappa <= 0"))
    assert line.startswith(
        f"kappa <= 0 for {n_bad} of {len(kappa)} rows ({n_bad / len(kappa):.1%}): no stable equilibrium there ("
    )
    if n_nan:
        assert f"R_eq is NaN for {n_nan}" in line
    if n_bad - n_nan:
        assert f"an unstable root for {n_bad - n_nan}" in line
    assert res.summary()["kappa_nonpositive_fraction"] == pytest.approx(n_bad / len(kappa))


# ---------------------------------------------------------------------------
# resume


def test_resume_recomputes_a_truncated_chunk(tmp_path):
    items, a, p = _data(n_items=11)
    src = normfast.PairSource.from_tensors(a, p)
    enc = normfast.ModuleEncoder(_net())
    cfg = config(batches=3, batch_size=6, chunk_size=3)
    full = _probe(enc, items, src, cfg)
    out = tmp_path / "run.parquet"
    _probe(enc, items, src, cfg, out=out)
    # rebuild the work folder of an interrupted run: the finished chunks, one of them truncated
    from normfast.data.runwriter import ChunkedParquetWriter

    key_spec = json_spec(out)
    writer = ChunkedParquetWriter(tmp_path / "cut.parquet", key_spec)
    table = pq.read_table(out)
    for c, lo in enumerate(range(0, 11, 3)):
        if c == 3:
            break  # the last chunk was never written
        writer.write_chunk(c, table.filter(pa_mask(table, lo, lo + 3)))
    chunk1 = writer.parts / "chunk-0000001.parquet"
    chunk1.write_bytes(chunk1.read_bytes()[:-40])  # a disk fault cut its footer
    with pytest.warns(
        RuntimeWarning,
        match=r"1 chunk file\(s\) .* could not be read .*: chunk-0000001.parquet; "
        r"computing them again",
    ):
        resumed = _probe(enc, items, src, cfg, out=tmp_path / "cut.parquet", resume=True)
    assert resumed.table.equals(full.table.replace_schema_metadata(resumed.table.schema.metadata))
    np.testing.assert_array_equal(resumed.column("V2"), full.column("V2"))


def json_spec(out):
    """The record a run at ``out`` was started with, as far as a resume compares it: the entries of the
    resume key's allow-list (normfast.data.resume_key), rebuilt from its metadata."""
    from normfast.data.resume_key import PROBE_RESUME_KEY

    meta = normfast.read_metadata(out)
    return {e.name: meta[e.name] for e in PROBE_RESUME_KEY.entries if e.name in meta} | {
        "schema_version": meta["schema_version"]  # the column layout's entry is read from it
    }


def pa_mask(table, lo, hi):
    import pyarrow.compute as pc

    item = table.column("item")
    return pc.and_(pc.greater_equal(item, lo), pc.less(item, hi))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"lr": 0.01}, r"changed: config.lr 0.001 -> 0.01\."),
        ({"items": "other"}, r"changed: the probe items \(probes\)\."),
        ({"pairs": "other"}, r"changed: the virtual-batch source \(pairs\)\."),
        ({"objective": "temperature"}, r"changed: objective_settings.temperature 0.05 -> 0.2\."),
    ],
)
def test_a_refused_resume_names_what_changed(tmp_path, change, named):
    items, a, p = _data(n_items=7)
    src = normfast.PairSource.from_tensors(a, p)
    enc = normfast.ModuleEncoder(_net())
    cfg = config(batches=3, batch_size=6, chunk_size=3)
    out = tmp_path / "run.parquet"
    _probe(enc, items, src, cfg, out=out)
    kw = dict(encoder=enc, items=items, pairs=src, config=cfg, objective="infonce")
    if "lr" in change:
        kw["config"] = config(batches=3, batch_size=6, chunk_size=3, lr=change["lr"])
    if "items" in change:
        kw["items"] = items + 1.0
    if "pairs" in change:
        kw["pairs"] = normfast.PairSource.from_tensors(a, p + 1.0)
    if "objective" in change:
        kw["objective"] = normfast.InfoNCE(temperature=0.2)
    for where in ("finished", "unfinished"):
        if where == "unfinished":  # an interrupted run's work folder holds the same spec
            (tmp_path / "run.parquet.parts").mkdir()
            (tmp_path / "run.parquet.parts" / "run.json").write_text(
                __import__("json").dumps({"key": "old", "spec": json_spec(out)})
            )
            out.unlink()
        with pytest.raises(ValueError, match=named):
            _probe(
                kw["encoder"], kw["items"], kw["pairs"], kw["config"], objective=kw["objective"], out=out, resume=True
            )


def test_every_sub_package_is_listed_in_setup_py():
    """setup.py lists packages explicitly; a sub-package missing there is importable from a checkout
    but absent from an installed wheel."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    listed = set(ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages")))
    on_disk = {
        ".".join(("normfast", *p.parent.relative_to(root / "normfast").parts)).rstrip(".")
        for p in (root / "normfast").rglob("__init__.py")
    }
    assert on_disk <= listed, f"add to setup.py packages: {sorted(on_disk - listed)}"
