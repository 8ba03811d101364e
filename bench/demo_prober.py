"""What the two Prober experiments (``prober``, ``serve_load``) share: the demo's probe settings as the
first fields of their ``Config``, the settings block of their JSON, and ``normfast serve`` run as a
process from the repository root (started, its output read, stopped with Ctrl+C)."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import MINILM_LAST_LAYER, token_probe

#: the repository root: the service runs from there
REPO = Path(__file__).resolve().parents[1]


@dataclass
class DemoProbe:
    """The demo's probe on a packaged model (a subclass adds the experiment's own fields after these):
    SimCSE, token rows, jvp mode, M heat batches in K groups, M_D drift batches, seed 0, the pair source
    the most common English words."""

    model: str = field(default="all-MiniLM-L6-v2", metadata={"help": "the model (a packaged name or a folder)"})
    params: str = field(default=MINILM_LAST_LAYER, metadata={"help": "the probed parameters (a regex)"})
    batches: int = field(default=16, metadata={"help": "M heat batches"})
    groups: int = field(default=8, metadata={"help": "K batch groups"})
    drift_batches: int = field(default=256, metadata={"help": "M_D drift batches"})
    batch_size: int = 32
    n_pairs: int = field(default=512, metadata={"help": "the pair source: this many most common English words"})

    def probe_config(self, **settings: Any) -> Any:
        """The :class:`normfast.ProbeConfig` of these settings (``settings``: the rest, e.g. the chunk size)."""
        return token_probe(
            self.params,
            batches=self.batches,
            groups=self.groups,
            drift_batches=self.drift_batches,
            batch_size=self.batch_size,
            seed=0,
            **settings,
        )

    def settings(self) -> dict[str, Any]:
        """The settings block of the result (the experiment adds its own keys after these)."""
        return {
            "model": self.model,
            "params": self.params,
            "objective": "simcse",
            "output": "tokens",
            "M": self.batches,
            "K": self.groups,
            "M_D": self.drift_batches,
            "batch_size": self.batch_size,
            "pairs": f"the {self.n_pairs} most common English words",
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """``argv`` (a ``normfast serve`` command) as a process from the repository root, returned once it
    prints "serving http://" (RuntimeError with its output if it exits before); a thread keeps
    appending its further output to the returned lines."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    while proc.poll() is None:
        lines.append(proc.stdout.readline())
        if "serving http://" in lines[-1]:
            break
    if not lines or "serving http://" not in lines[-1]:
        raise RuntimeError("normfast serve did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, lines


def stop_service(proc: subprocess.Popen) -> None:
    """Ctrl+C, then a kill if it has not stopped within 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
