"""An image tower from the command line: a ``--pairs`` file of image paths is read as images (the
anchors; the positives too, except under ``clip``, whose positives are captions for the text
tower), as the command's own help shows. An unreadable image is one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

from normfast.cli import main
from normfast.engine.result import ProbeResult

open_clip = pytest.importorskip("open_clip")
pytestmark = pytest.mark.usefixtures("single_thread")

ARCH = "normfast-test-images-clip"
CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
CAPTIONS = ["a red square", "a blue sky", "green grass", "a stone wall", "the sea", "a white cat"]


@pytest.fixture
def images(tmp_path, monkeypatch):
    from PIL import Image
    from safetensors.torch import save_file

    (tmp_path / f"{ARCH}.json").write_text(json.dumps(CONFIG))
    open_clip.add_model_config(str(tmp_path / f"{ARCH}.json"))
    torch.manual_seed(3)
    model = open_clip.create_model(ARCH).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "clip.safetensors"))
    g = torch.Generator().manual_seed(4)
    for i in range(len(CAPTIONS)):
        pixels = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / f"img{i}.png")
    (tmp_path / "images.txt").write_text("".join(f"img{i}.png\n" for i in range(len(CAPTIONS))))
    (tmp_path / "captions.tsv").write_text("".join(f"img{i}.png\t{c}\n" for i, c in enumerate(CAPTIONS)))
    (tmp_path / "both.tsv").write_text("".join(f"img{i}.png\timg{(i + 1) % 6}.png\n" for i in range(6)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _probe(pairs: str, objective: str, out: str) -> int:
    return main(
        ["probe", f"open_clip:{ARCH}@clip.safetensors", "--tower", "image", "--probes", "images.txt"]
        + ["--pairs", pairs, "--objective", objective, "--params", "all", "--batches", "3", "--drift-batches", "0"]
        + ["--groups", "3", "--batch-size", "4", "--no-progress", "--out", out]
    )


@pytest.mark.parametrize("pairs, objective", [("captions.tsv", "clip"), ("both.tsv", "infonce")])
def test_a_pairs_file_of_image_paths_is_probed(images, pairs, objective):
    assert _probe(pairs, objective, "run.parquet") == 0
    table = ProbeResult.load("run.parquet").table
    assert table.num_rows == len(CAPTIONS)
    heat = table.column("V2").to_pylist()
    assert all(v is not None and v > 0 for v in heat)


def test_an_unreadable_image_in_a_pairs_file_is_named(images, capsys):
    (images / "img2.png").write_bytes(b"not a png")
    assert _probe("both.tsv", "infonce", "run.parquet") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("'img2.png'" in line and "cannot read it as an image" in line for line in err), err
    assert "Traceback" not in "\n".join(err)
