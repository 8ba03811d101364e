"""Protocol step 6 of the monitor-every study: what the monitor costs, by the wall clock and by its own
clock, on E1's MLP and on a MiniLM-sized loop."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.experiments.monitor_every.record import train_loop
from bench.experiments.monitor_every.settings import ARMS, MINILM_ARMS, Config


def cost(cfg: Config) -> dict[str, Any]:
    """Protocol step 6 (v2): wall time without and with the monitor, and the monitor's own clock, on E1's
    MLP and on a MiniLM-sized loop; one process each, rotated rounds."""
    from bench.experiments.e1 import e1_setup

    e1cfg, data = e1_setup(cfg.size, 0)
    n = data.x.shape[0]

    def mlp(arm: Any, folder: Path) -> float:
        def hook(step: int, opt: Any, enc: Any) -> Any:
            if arm is None or step:
                return None
            return _monitor(enc, list(range(n)), arm, folder)

        t0 = time.perf_counter()
        train_loop("mlp", e1cfg, data, cfg.cost_steps, hook)
        return time.perf_counter() - t0

    small = _timed_arms(ARMS, mlp, cfg.cost_rounds)
    minilm = _MiniLMLoop(cfg.minilm_steps)
    big = _timed_arms(MINILM_ARMS, minilm, cfg.minilm_rounds)
    return {
        "model": "mlp (E1, seed 0)",
        "items": n,
        "steps": cfg.cost_steps,
        "rounds": cfg.cost_rounds,
        "arms": small,
        "minilm": {"model": "all-MiniLM-L6-v2, last layer", "items": 64, "steps": cfg.minilm_steps,
                   "rounds": cfg.minilm_rounds, "arms": big},
    }  # fmt: skip


def _monitor(enc: Any, probes: list, arm: tuple[int, bool], folder: Path) -> Any:
    from normfast import TrainingMonitor

    return TrainingMonitor(enc, probes, every=arm[0], average=arm[1], out=folder)


def _timed_arms(arms: tuple, train: Any, rounds: int) -> list[dict[str, Any]]:
    """Each arm's median wall time over ``rounds`` (the arms' order rotated; ``train(arm, folder)`` returns
    the seconds of its timed part) as a ratio to the arm without the monitor, and the monitor's own overhead
    beside the wall clock's."""

    walls: dict[str, list[float]] = {arm_name(a): [] for a in arms}
    clocks: dict[str, list[float]] = {arm_name(a): [] for a in arms if a is not None}
    for round_ in range(rounds):
        for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            with tempfile.TemporaryDirectory() as tmp:
                walls[arm_name(arm)].append(train(arm, Path(tmp) / "m"))
                if arm is not None:
                    clocks[arm_name(arm)].append(json.loads((Path(tmp) / "m" / "summary.json").read_text())["overhead"])
    base = statistics.median(walls["none"])
    out = []
    for a in arms:
        wall = statistics.median(walls[arm_name(a)])
        row = {
            "arm": arm_name(a),
            "every": None if a is None else a[0],
            "average": None if a is None else a[1],
            "wall_seconds": wall,
            "wall_ratio": wall / base,
            "monitor_clock_overhead": None if a is None else statistics.median(clocks[arm_name(a)]),
        }
        if a is not None and wall > base:
            row["clock_over_wall"] = row["monitor_clock_overhead"] / (wall / base - 1)
        out.append(row)
    return out


class _MiniLMLoop:
    """A MiniLM-sized training loop: all-MiniLM-L6-v2's last layer trained with AdamW on two dropout
    views of 16 English words a step (InfoNCE, temperature 0.05); 64 other words monitored. The model
    is loaded once and reset to its weights before each arm (untimed); the loop and ``close()`` are timed."""

    def __init__(self, steps: int):
        import normfast
        from normfast.data.word_frequencies import top_words

        self.steps = steps
        self.words = top_words(3000)[1000:3000]
        self.enc = normfast.load_encoder("all-MiniLM-L6-v2")
        for name, p in self.enc.named_parameters():
            p.requires_grad_(".encoder.layer.5." in f".{name}")
        self.initial = {k: v.detach().clone() for k, v in self.enc.state_dict().items()}

    def __call__(self, arm: Any, folder: Path) -> float:
        import torch

        import normfast

        enc, words = self.enc, self.words
        enc.load_state_dict(self.initial)
        opt = torch.optim.AdamW([p for p in enc.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
        objective = normfast.InfoNCE(temperature=0.05)
        rng = np.random.default_rng(0)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        monitor = None if arm is None else _monitor(enc, words[:64], arm, folder)
        enc.train()
        for _ in range(self.steps):
            batch = [words[64 + i] for i in rng.choice(len(words) - 64, 16, replace=False)]
            loss = objective.loss(enc(enc.prepare(batch)), enc(enc.prepare(batch)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if monitor is not None:
                monitor.step(opt)  # before_step, opt.step(), after_step
            else:
                opt.step()
        if monitor is not None:
            monitor.close()
        enc.eval()
        return time.perf_counter() - t0


def arm_name(arm: Any) -> str:
    return "none" if arm is None else f"every={arm[0]} {'averaged' if arm[1] else 'sampled'}"
