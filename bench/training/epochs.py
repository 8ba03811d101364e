"""Small training and evaluation helpers shared by the experiments that train a model before probing it.

* :func:`train_epochs` -- epochs over shuffled index batches with any optimizer and a
  ``loss_on(rows)`` callback: the loop every experiment wrote by hand.
* :func:`embed_in_chunks` -- an encoder's outputs for many items without gradients.
* :func:`zero_shot_entropy` -- predictive entropy of a cosine-softmax classifier over
  class embeddings (a CLIP-style zero-shot head).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm


def train_epochs(
    modules: Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    loss_on: Callable[[torch.Tensor], torch.Tensor],
    ids: np.ndarray,
    *,
    batch_size: int,
    epochs: int,
    seed: int,
    progress: bool = True,
    desc: str = "train",
) -> dict[str, Any]:
    """Train for ``epochs`` passes over ``ids`` in shuffled batches; returns a loss record.

    Each epoch draws one permutation of ``ids`` from ``numpy.random.default_rng(seed)``
    and takes ``len(ids) // batch_size`` full batches from it (the remainder is left
    out of that epoch); ``loss_on(rows)`` gets the batch's ids as an int64 tensor and
    returns the scalar loss. ``modules`` are put in train mode for the loop and in
    eval mode after it. The record holds the number of steps, the mean loss of the
    first epoch and of the last quarter epoch, and every step's loss.
    """
    fn = "train_epochs"
    ids = np.asarray(ids)
    if batch_size < 1 or epochs < 1:
        raise ValueError(f"{fn}: expected batch_size >= 1 and epochs >= 1, got {batch_size}, {epochs}")
    steps_per_epoch = len(ids) // batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"{fn}: expected at least batch_size={batch_size} ids, got {len(ids)}")
    rng = np.random.default_rng(seed)
    losses: list[float] = []
    for m in modules:
        m.train()
    bar = tqdm(total=epochs * steps_per_epoch, desc=desc, unit="step", disable=not progress)
    try:
        for _ in range(epochs):
            order = rng.permutation(ids)
            for s in range(steps_per_epoch):
                rows = torch.from_numpy(order[s * batch_size : (s + 1) * batch_size])
                loss = loss_on(rows)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-steps_per_epoch:]):.3f}")
    finally:
        bar.close()
        for m in modules:
            m.eval()
    tail = max(1, steps_per_epoch // 4)
    return {
        "steps": len(losses),
        "loss_first_epoch_mean": float(np.mean(losses[:steps_per_epoch])),
        "loss_last_quarter_epoch_mean": float(np.mean(losses[-tail:])),
        "losses": losses,
    }


@torch.no_grad()
def embed_in_chunks(encoder: Any, items: Sequence[Any], *, output: str = "pooled", chunk: int = 1000) -> np.ndarray:
    """``encoder.encode(items, output=...)`` chunk by chunk, as a float64 numpy array."""
    parts = [encoder.encode(items[lo : lo + chunk], output=output).double().cpu() for lo in range(0, len(items), chunk)]
    return torch.cat(parts).numpy()


def zero_shot_entropy(z: np.ndarray, class_embeddings: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Entropy (nats) of ``softmax_c(cos(z, class_c) / temperature)`` per row, and the predicted class."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"zero_shot_entropy: expected a finite temperature > 0, got {temperature!r}")
    zn = z / np.linalg.norm(z, axis=1, keepdims=True)
    tn = class_embeddings / np.linalg.norm(class_embeddings, axis=1, keepdims=True)
    logits = zn @ tn.T / temperature
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    entropy = -(p * np.log(np.clip(p, 1e-300, None))).sum(axis=1)
    return entropy, logits.argmax(axis=1)
