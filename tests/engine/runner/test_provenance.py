"""The identity of a run (normfast.engine.runner.provenance): the content hashes that a resume
compares see every byte of the weights, the tokenizer's whole state and the content of images,
and stay the same for the same content loaded again."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from normfast.engine.runner.provenance import hash_items, hash_model, hash_tokenizer
from tests._models import tiny_bert


def test_swapping_two_embedding_rows_changes_the_weights_hash(minilm_tokenizer):
    model = tiny_bert(minilm_tokenizer)
    before = hash_model(model)
    table = model.embeddings.word_embeddings.weight
    with torch.no_grad():
        table[[7, 11]] = table[[11, 7]].clone()  # same sum, same norm, same multiset of values
    assert hash_model(model) != before


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_one_changed_value_anywhere_changes_the_weights_hash(where):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 301), nn.LayerNorm(301), nn.Linear(301, 7))
    before = hash_model(net)
    weight = net[0].weight
    index = {"first": 0, "last": weight.numel() - 1, "middle": weight.numel() // 2 + 3}[where]
    with torch.no_grad():
        flat = weight.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))  # one ulp
    assert hash_model(net) != before


class _Holder(nn.Module):
    def __init__(self, **tensors: torch.Tensor):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t.clone())


def test_the_weights_hash_sees_buffers_names_shapes_and_dtypes():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    base = hash_model(net)
    torch.manual_seed(0)
    assert hash_model(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))) == base  # the same content, another object
    with torch.no_grad():
        net[1].running_mean[2] = 0.5  # a buffer
    assert hash_model(net) != base
    t = torch.randn(4, 6)
    same = hash_model(_Holder(w=t))
    assert hash_model(_Holder(w=t)) == same
    assert hash_model(_Holder(v=t)) != same  # the name
    assert hash_model(_Holder(w=t.reshape(6, 4))) != same  # the shape (the same bytes)
    assert hash_model(_Holder(w=t.view(torch.int32))) != same  # the dtype (the same bytes)
    # the order parameters were registered in does not matter, their names do
    u = torch.randn(3)
    assert hash_model(_Holder(a=t, b=u)) == hash_model(_Holder(b=u, a=t))
    assert hash_model(_Holder(a=t, b=u)) != hash_model(_Holder(a=u, b=t))


def test_the_weights_hash_takes_low_precision_and_views():
    torch.manual_seed(0)
    net = nn.Linear(5, 3).to(torch.bfloat16)
    a = hash_model(net)
    with torch.no_grad():
        net.weight[0, 0] = -net.weight[0, 0]
    assert hash_model(net) != a
    net.weight = nn.Parameter(torch.randn(5, 3).t())  # non-contiguous
    assert len(hash_model(net)) == 16


def test_the_tokenizer_hash_sees_lowercasing_and_nothing_of_where_it_was_loaded(minilm_tokenizer, tmp_path):
    import transformers

    minilm_tokenizer.save_pretrained(tmp_path / "a")
    first = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    moved = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "moved"))
    assert hash_tokenizer(first) == hash_tokenizer(moved) == hash_tokenizer(minilm_tokenizer)
    # tokenizing with truncation and padding changes the backend's call state, not the tokenizer
    first(["a b c d e f"] * 2, truncation=True, max_length=4, padding=True)
    assert hash_tokenizer(first) == hash_tokenizer(moved)
    config = tmp_path / "a" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "do_lower_case": False}))
    cased = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert cased("Apple")["input_ids"] != first("Apple")["input_ids"]
    assert hash_tokenizer(cased) != hash_tokenizer(first)
    assert hash_tokenizer(None) is None


def test_the_tokenizer_hash_of_open_clip_is_stable_and_sees_its_context():
    open_clip = pytest.importorskip("open_clip")
    a = open_clip.tokenizer.SimpleTokenizer(context_length=16)
    b = open_clip.tokenizer.SimpleTokenizer(context_length=16)
    a(["a photo of a cat", "warm bread"])  # fills its cache
    assert hash_tokenizer(a) == hash_tokenizer(b)
    assert hash_tokenizer(open_clip.tokenizer.SimpleTokenizer(context_length=12)) != hash_tokenizer(a)


def test_images_are_hashed_by_their_pixels(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(8, 8, 3, generator=g) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(tmp_path / "a.png")
    load = lambda: Image.open(tmp_path / "a.png").convert("RGB")  # noqa: E731
    assert hash_items([load()]) == hash_items([load()])  # other objects, the same pixels
    pixels[3, 4, 0] ^= 1
    Image.fromarray(pixels).save(tmp_path / "a.png")
    changed = hash_items([load()])
    assert changed != hash_items([Image.fromarray(pixels[:, :, ::-1].copy())])
    assert changed == hash_items([load()])
