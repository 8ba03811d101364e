"""The training monitor inside the trainers people use: transformers' ``Trainer`` (through
``normfast.MonitorCallback``, resumed from a checkpoint), sentence-transformers'
``SentenceTransformerTrainer`` (a live ``SentenceTransformer``, its head trained, with the virtual
probe) and Lightning (``normfast.LightningMonitor``; skipped when Lightning is not installed)."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import normfast
from normfast.engine.directions.objectives import InfoNCE

pytestmark = pytest.mark.usefixtures("single_thread")

ANCHORS = [
    "a dog runs in the park",
    "the cat sleeps",
    "rain falls on the city",
    "a red car stops",
    "children play football",
    "the river flows south",
    "an old man reads",
    "birds sing at dawn",
]
POSITIVES = [
    "a puppy plays outside",
    "a kitten naps",
    "it is raining downtown",
    "the car halts",
    "kids kick a ball",
    "water runs to the sea",
    "a grandfather with a book",
    "morning birdsong",
]


def _rows(path):
    return pq.read_table(path).sort_by([("step", "ascending"), ("item", "ascending")])


def assert_telescopes(table, n_items: int) -> None:
    """Each recorded step's ΔR² (the sum of its terms) is what the next recorded state's norm says: the
    monitor saw the step the optimizer took, between the right hooks."""
    S = table.num_rows // n_items
    norm = np.asarray(table["norm"]).reshape(S, n_items)
    delta = np.asarray(table["delta_r2"]).reshape(S, n_items)
    terms = sum(np.asarray(table[k]) for k in ("task1", "task2", "decay", "remainder")).reshape(S, n_items)
    np.testing.assert_allclose(norm[1:] ** 2 - norm[:-1] ** 2, delta[:-1], rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(terms, delta, rtol=1e-9, atol=1e-12)
    assert np.all(np.abs(delta[:-1]) > 0)  # the model did move


# ---------------------------------------------------------------------------
# transformers.Trainer


class PairModel(torch.nn.Module):
    """A tiny BERT trained on (anchor, positive) pairs with InfoNCE on the mean-pooled output."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert
        self.objective = InfoNCE(temperature=0.1)

    def _pool(self, ids, mask):
        hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1)

    def forward(self, input_ids, attention_mask, positive_ids, positive_mask):
        return {
            "loss": self.objective.loss(self._pool(input_ids, attention_mask), self._pool(positive_ids, positive_mask))
        }


def _trainer(tmp_path, tokenizer, out, resume=None):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (normfast[train])")
    from transformers import Trainer, TrainingArguments

    from normfast.encoders import HFEncoder
    from tests._models import tiny_bert

    model = PairModel(tiny_bert(tokenizer, eager=True).train())

    def collate(rows):
        a = tokenizer([r[0] for r in rows], padding=True, return_tensors="pt")
        b = tokenizer([r[1] for r in rows], padding=True, return_tensors="pt")
        return {
            "input_ids": a["input_ids"],
            "attention_mask": a["attention_mask"],
            "positive_ids": b["input_ids"],
            "positive_mask": b["attention_mask"],
        }

    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        warmup_steps=0,
        save_strategy="steps",
        save_steps=2,
        save_only_model=False,
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    callback = normfast.MonitorCallback(ANCHORS[:5], encoder=HFEncoder(model.bert, tokenizer), every=1, out=out)
    trainer = Trainer(
        model=model, args=args, train_dataset=list(zip(ANCHORS, POSITIVES)), data_collator=collate, callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=resume)
    return callback


def test_trainer_callback_records_and_resumes(tmp_path, minilm_tokenizer):
    """transformers.Trainer with AdamW and a linear schedule: every step recorded between the right hooks
    (the rows telescope; the lr column is the schedule's lr of each step, read before the scheduler moves
    it); the monitor's state goes into each checkpoint, and a run resumed from the first checkpoint writes
    the same monitor.parquet as the uninterrupted one."""
    callback = _trainer(tmp_path, minilm_tokenizer, tmp_path / "whole")
    table = _rows(tmp_path / "whole" / "monitor.parquet")
    assert table.num_rows == 4 * 5
    assert_telescopes(table, 5)
    lr = np.asarray(table["lr"]).reshape(4, 5)[:, 0]
    np.testing.assert_allclose(lr, 1e-2 * np.array([1.0, 0.75, 0.5, 0.25]), rtol=1e-12)
    meta = normfast.read_metadata(tmp_path / "whole" / "monitor.parquet")
    assert meta["optimizer"] == "AdamW" and meta["law"] == "adamw" and meta["weight_decay"] == 0.1
    # the Trainer exempts biases and LayerNorm from decay: a group with weight_decay 0
    assert {g["weight_decay"] for g in meta["param_groups"] if g["monitored_tensors"]} == {0.0, 0.1}
    assert callback.monitor.encoder.staged and meta["cut_stage"] == 0
    checkpoint = tmp_path / "trainer" / "checkpoint-2"
    assert (checkpoint / "normfast_monitor.pt").is_file()
    _trainer(tmp_path, minilm_tokenizer, tmp_path / "resumed", resume=str(checkpoint))
    assert (tmp_path / "resumed" / "monitor.parquet").read_bytes() == (
        tmp_path / "whole" / "monitor.parquet"
    ).read_bytes()


class _Planted:
    """Unpickled by a full unpickler, it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_monitor_state_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    """The trainer resumes from a checkpoint whose normfast_monitor.pt is a pickle naming a call: a
    ValueError naming the file, and nothing in it runs (read with weights_only, as every state file)."""
    import pickle
    from types import SimpleNamespace

    from normfast.engine.monitor.callbacks import STATE_FILE

    marker = tmp_path / "it-ran"
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / STATE_FILE).write_bytes(pickle.dumps({"step": _Planted(marker)}, protocol=2))
    callback = normfast.MonitorCallback([torch.randn(4) for _ in range(3)], every=1, out=None)
    state = SimpleNamespace(is_world_process_zero=True, global_step=2)
    with pytest.raises(ValueError, match=r"the monitor's state file .*normfast_monitor\.pt cannot be read safely"):
        callback.on_train_begin(
            SimpleNamespace(output_dir=str(tmp_path)), state, None, model=torch.nn.Linear(4, 3, bias=False)
        )
    assert not marker.exists()


# ---------------------------------------------------------------------------
# sentence-transformers


def test_sentence_transformer_trainer_with_a_trained_head(tmp_path, tiny_bert_folder):
    """A live SentenceTransformer (tiny BERT, mean pooling, a linear Dense head) with its transformer frozen:
    the monitor wraps the model's own modules (its norms are the model's own embeddings), caches the frozen
    transformer (the cut is the pooling stage), records the head's steps, and runs the virtual probe."""
    pytest.importorskip("datasets", reason="SentenceTransformerTrainer needs datasets (normfast[train])")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (normfast[train])")
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    try:  # their home since sentence-transformers 6
        from sentence_transformers.sentence_transformer import losses
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import losses, models

    torch.manual_seed(0)
    body = models.Transformer(str(tiny_bert_folder), max_seq_length=32)
    head = models.Dense(32, 16, bias=False, activation_function=torch.nn.Identity())
    st = SentenceTransformer(modules=[body, models.Pooling(32, "mean"), head], device="cpu")
    for p in body.parameters():
        p.requires_grad_(False)
    data = Dataset.from_dict({"anchor": ANCHORS, "positive": POSITIVES})
    encoder = normfast.load_encoder(st)
    assert encoder.dense[0].linear.weight is head.linear.weight  # shared, not copied
    before = np.linalg.norm(st.encode(ANCHORS[:6], convert_to_numpy=True), axis=1)
    callback = normfast.MonitorCallback(
        data,
        n_probes=6,
        every=1,
        out=tmp_path / "m",
        virtual=2,
        objective=InfoNCE(temperature=0.05),
        pairs=list(zip(ANCHORS, POSITIVES)),
        virtual_batch_size=4,
    )
    assert callback.items == ANCHORS[:6]
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "st"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = SentenceTransformerTrainer(
        model=st, args=args, train_dataset=data, loss=losses.MultipleNegativesRankingLoss(st), callbacks=[callback]
    )
    trainer.train()
    table = _rows(tmp_path / "m" / "monitor.parquet")
    meta = normfast.read_metadata(tmp_path / "m" / "monitor.parquet")
    assert meta["trained_parameters"] == ["dense.0.linear.weight"]
    assert meta["cut_stage"] == 3  # embeddings, 2 layers, then the pooling stage: the front is cached
    assert table.num_rows == 3 * 6
    assert_telescopes(table, 6)
    np.testing.assert_allclose(np.asarray(table["norm"])[:6], before, rtol=1e-5)
    for c in ("virtual_D", "virtual_Q", "virtual_kappa"):
        assert np.isfinite(np.asarray(table[c])).all(), c
    # a linear head without bias, fully decayed: κ = 1
    np.testing.assert_allclose(np.asarray(table["virtual_kappa"]), 1.0, rtol=1e-5)


# ---------------------------------------------------------------------------
# Lightning


def test_lightning_callback(tmp_path):
    """A LightningModule training E1's toy MLP with heavy-ball SGD: every step recorded between Lightning's
    hooks (the rows telescope), the shadow decay buffer from the first step."""
    lightning = pytest.importorskip("lightning", reason="the Lightning adapter needs normfast[lightning]")
    from bench.experiments.e1.data import E1Config, build_encoder, make_concepts

    cfg = E1Config(concepts=4, items_per_concept=3, d_in=8, hidden=16, d_out=8, n_pairs=200, batch_size=8)
    data = make_concepts(cfg)
    n = data.x.shape[0]

    class Toy(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.enc = build_encoder("mlp", cfg, data)
            self.objective = InfoNCE(temperature=0.1)

        def training_step(self, batch, _):
            a, b = batch[:, 0].tolist(), batch[:, 1].tolist()
            return self.objective.loss(self.enc(self.enc.prepare(a)), self.enc(self.enc.prepare(b)))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)

    module = Toy()
    loader = torch.utils.data.DataLoader(torch.as_tensor(data.pairs), batch_size=8, shuffle=False)
    callback = normfast.LightningMonitor(list(range(n)), encoder=module.enc, every=1, out=tmp_path / "m")
    trainer = lightning.Trainer(
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[callback],
    )
    trainer.fit(module, loader)
    table = _rows(tmp_path / "m" / "monitor.parquet")
    assert table.num_rows == 5 * n
    assert_telescopes(table, n)
    assert normfast.read_metadata(tmp_path / "m" / "monitor.parquet")["decay_buffer"] == "exact"


def test_lightning_adapter_without_lightning(monkeypatch):
    """Without Lightning the adapter's module still imports and the class names the extra to install."""
    import normfast.engine.monitor.lightning as adapter

    for name in (
        "lightning",
        "lightning.pytorch",
        "lightning.pytorch.callbacks",
        "pytorch_lightning",
        "pytorch_lightning.callbacks",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    try:
        blocked = importlib.reload(adapter)
        assert blocked.AVAILABLE is False
        with pytest.raises(ModuleNotFoundError, match=r"normfast\[lightning\]"):
            blocked.LightningMonitor([0, 1])
    finally:
        monkeypatch.undo()
        importlib.reload(adapter)


def test_the_callback_keeps_every_probe_item_of_a_list_and_says_what_it_leaves_out():
    """A plain list of 256 items is probed whole (it used to keep 64 silently); a dataset takes its
    first 64 rows by default and says so; n_probes cuts either, saying how many were left out."""
    pytest.importorskip("transformers")
    import warnings

    from normfast.engine.monitor.callbacks import probe_items

    items = [f"w{i}" for i in range(256)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe_items(items) == items
    with pytest.warns(UserWarning, match=r"first 10 of 256 probe items \(n_probes\)"):
        assert probe_items(items, 10) == items[:10]
    rows = {"text": items[:100], "label": list(range(100))}
    with pytest.warns(
        UserWarning, match=r"first 64 of 100 rows of the probe dataset \(the default for a dataset, 64\)"
    ):
        assert probe_items(rows) == items[:64]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe_items(rows, 100) == items[:100]
