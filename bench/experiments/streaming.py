"""Bounded-memory streaming: peak memory and throughput of token probes at 1M and 10M rows.

    python -m bench run streaming [--sizes 1000000 10000000] [--chunk-size 512] [--batches 16]

Each size runs in a fresh subprocess (so its peak RSS is its own, read with
``os.wait4``): a token-level head-mode probe of a small BERT-style encoder
(random weights, built from a config, the real all-MiniLM-L6-v2 tokenizer,
a linear projection head) over synthetic sentences until the requested
number of token rows is reached, streamed to Parquet with ``out=``. The
probe items come from an on-demand sequence (sentence ``i`` is generated
from ``i``), so the input costs no memory either: what is measured is the
engine. The child samples its own RSS over the run, for the timeline plot.

A resume check follows: the smaller size is started again, killed with
SIGKILL once about half of its chunks are on disk, and rerun with
``resume=True``; the rerun must compute only the missing chunks and give the
same table as the uninterrupted run.

Writes ``OUT/streaming.json`` and ``OUT/streaming.png`` (OUT: ``runs/streaming``
by default; the committed result: ``--out bench/results/streaming``). A child is
``python -m bench.experiments.streaming '<settings JSON>'``.
Claims are ratios within this run (the 10M run's peak RSS against the 1M
run's); absolute CPU times on a shared VM are recorded, not claimed.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.common import pyplot, save
from bench.harness import Context, JsonStyle

RESULTS = ("streaming.json",)
FIGURES = ("streaming.png",)
TABLES = ("streaming",)
JSON = JsonStyle(newline=False, strict=False)
#: the repository root: a child runs ``python -m`` this module from there
REPO = Path(__file__).resolve().parents[2]
SEED = 0
MIN_WORDS, SPAN = 6, 25  # sentence i has MIN_WORDS + (i * 7919) % SPAN words


@dataclass
class Config:
    sizes: tuple[int, ...] = field(default=(1_000_000, 10_000_000), metadata={"help": "token rows per run"})
    chunk_size: int = field(default=512, metadata={"help": "probe items (sentences) per chunk"})
    batches: int = field(default=16, metadata={"help": "M virtual batches"})
    batch_size: int = 32
    hidden: int = 32
    layers: int = 2
    heads: int = 2
    dim: int = field(default=32, metadata={"help": "output width of the projection head"})
    threads: int = 1
    sample_every: float = field(default=0.5, metadata={"help": "RSS sampling period (s)"})
    resume_check: bool = field(default=True, metadata={"help": "kill and resume the smallest size"})
    workdir: str | None = field(default=None, metadata={"help": "where the Parquet outputs go (none: a temp folder)"})
    keep_runs: str | None = field(
        default=None,
        metadata={
            "help": "a folder to keep the finished runs in (run-ROWS.parquet; none: deleted with the temp folder)"
        },
    )

    @classmethod
    def quick(cls) -> "Config":
        return cls(sizes=(2000,), chunk_size=64, batches=4, batch_size=8, resume_check=False)


# ---------------------------------------------------------------------------
# the probe set: synthetic sentences generated on demand


def _vocab_words(tokenizer) -> list[str]:
    """Lower-case alphabetic whole words of the vocabulary: each is exactly one token."""
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) >= 3 and w.isascii()]
    return sorted(words)


def words_in(i: int) -> int:
    return MIN_WORDS + (i * 7919) % SPAN


def items_for_rows(rows: int) -> tuple[int, int]:
    """Fewest sentences whose token rows ([CLS] + words + [SEP]) reach ``rows``; and their row count."""
    per_cycle = sum(words_in(i) + 2 for i in range(SPAN))
    cycles = max(0, rows // per_cycle - 1)
    n, total = cycles * SPAN, cycles * per_cycle
    while total < rows:
        total += words_in(n) + 2
        n += 1
    return n, total


class Sentences:
    """Sentence ``i`` built from ``i`` alone: a sequence of any length that holds nothing."""

    def __init__(self, n: int, words: list[str], seed: int):
        self.n, self.words, self.seed = n, words, seed
        self._steps = np.arange(MIN_WORDS + SPAN, dtype=np.int64)

    def __len__(self) -> int:
        return self.n

    def _one(self, i: int) -> str:
        k = words_in(i)
        # a multiplicative hash of (seed, i, position) picks the words
        idx = ((i + 1) * 2654435761 + (self._steps[:k] + 1) * 40503 * (self.seed + 7)) % 4294967291
        return " ".join(self.words[j] for j in (idx % len(self.words)))

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self._one(i) for i in range(*key.indices(self.n))]
        if key < 0:
            key += self.n
        if not 0 <= key < self.n:
            raise IndexError(key)
        return self._one(key)


# ---------------------------------------------------------------------------
# child: one probe run


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def child(args: SimpleNamespace) -> None:
    import torch
    import transformers
    from torch import nn

    from normfast import ProbeConfig, probe
    from normfast.encoders import HFEncoder
    from normfast.encoders.packaged import minilm_path

    torch.set_num_threads(args.threads)
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    t_start = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - t_start, _rss_bytes()))
            stop.wait(args.sample_every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
    cfg = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.BertModel(cfg).eval()
    encoder = HFEncoder(model, tokenizer, pooling="mean", dense=[nn.Linear(args.hidden, args.dim)])
    words = _vocab_words(tokenizer)
    n_items, expected_rows = items_for_rows(args.rows)
    probes = Sentences(n_items, words, SEED)
    pairs = Sentences(4096, words, SEED + 1)[0:4096]
    config = ProbeConfig(
        params="head",
        mode="head",
        output="tokens",
        batches=args.batches,
        batch_size=args.batch_size,
        seed=SEED,
        chunk_size=args.chunk_size,
        drift_batches=None,
    )  # the protocol predates the mean-direction drift
    out = Path(args.out)
    parts = out.with_name(out.name + ".parts")
    done_before = len(list(parts.glob("chunk-*.parquet"))) if parts.exists() else 0
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    result = probe(
        encoder,
        probes,
        "simcse",
        pairs,
        config,
        out=out,
        resume=args.resume,
        overwrite=not args.resume,
        progress=not args.no_progress,
        model_name="tiny-bert (random)",
    )
    seconds = time.perf_counter() - t0
    rows = len(result)
    stop.set()
    sampler.join()
    n_chunks = -(-n_items // args.chunk_size)
    report = {
        "rows": rows,
        "expected_rows": expected_rows,
        "items": n_items,
        "chunks": n_chunks,
        "chunks_done_before": done_before,
        "chunks_computed": n_chunks - done_before,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "rss_before_probe_bytes": rss_before,
        "peak_rss_self_bytes": _hwm_bytes(),
        "file_bytes": out.stat().st_size,
        "result_holds_table": result._table is not None,
        "rss_timeline": [(round(t, 2), r) for t, r in samples],
        "t_probe_start": round(t0 - t_start, 2),
        "versions": result.metadata["versions"],
        "device": result.metadata["device"],
    }
    print("RESULT " + json.dumps(report), flush=True)


# ---------------------------------------------------------------------------
# parent


def _child_command(args: Config, rows: int, out: Path, resume: bool, progress: bool) -> list[str]:
    settings = dict(asdict(args), rows=rows, out=str(out), resume=resume, no_progress=not progress)
    return [sys.executable, "-m", __name__, json.dumps(settings)]


def run_child(
    args: Config,
    rows: int,
    out: Path,
    *,
    resume: bool = False,
    progress: bool = False,
    kill_at_chunks: int | None = None,
) -> dict:
    """Run one child; its own peak RSS comes from wait4 (ru_maxrss, KiB on Linux)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        _child_command(args, rows, out, resume, progress), stdout=subprocess.PIPE, env=env, text=True, cwd=REPO
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed = False
    if kill_at_chunks is not None:
        parts = out.with_name(out.name + ".parts")
        while proc.poll() is None:
            if parts.exists() and len(list(parts.glob("chunk-*.parquet"))) >= kill_at_chunks:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.2)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    wall = time.perf_counter() - t0
    if killed:
        return {"killed": True, "wall_seconds": wall}
    found = [ln for ln in lines if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"streaming bench: child for {rows} rows failed (exit {proc.returncode})")
    report = json.loads(found[-1][len("RESULT ") :])
    report["peak_rss_bytes"] = usage.ru_maxrss * 1024
    report["wall_seconds"] = wall
    return report


def _same_tables(a: Path, b: Path) -> bool:
    from normfast import ProbeResult

    ra, rb = ProbeResult.load(a), ProbeResult.load(b)
    if len(ra) != len(rb):
        return False
    for x, y in zip(ra.iter_batches(batch_size=1 << 18), rb.iter_batches(batch_size=1 << 18)):
        if not x.equals(y):
            return False
    return True


def figures(summary: dict, out: Path) -> list[Path]:
    plt = pyplot()
    path = out / "streaming.png"
    runs = summary["runs"]
    n = np.array([r["rows"] for r in runs], float)
    gib = 2.0**30
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    ax.plot(n, [r["peak_rss_bytes"] / gib for r in runs], "o-", label="peak RSS (process)")
    ax.plot(n, [r["rss_before_probe_bytes"] / gib for r in runs], "s--", label="RSS before probe (model loaded)")
    ax.axhline(
        summary["targets"]["peak_rss_limit_bytes"] / gib, color="r", lw=0.8, ls=":", label="target: 4 GB (3.73 GiB)"
    )
    ax.set_xscale("log")
    ax.set_xticks(n, [f"{int(v):,}" for v in n])
    ax.minorticks_off()
    ax.set_ylim(0, None)
    ax.set_xlabel("token probe rows N")
    ax.set_ylabel("GiB")
    ax.set_title(f"peak RSS: largest / smallest N = {summary['peak_rss_ratio']:.3f}", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.loglog(n, [r["seconds"] for r in runs], "o-", label="probe wall time")
    ax.loglog(n, n / n[0] * runs[0]["seconds"], "k:", lw=0.8, label="linear in N")
    ax.set_xticks(n, [f"{int(v):,}" for v in n])
    ax.minorticks_off()
    ax.set_xlabel("token probe rows N")
    ax.set_ylabel("seconds")
    ax.set_title("time (rows/s: " + ", ".join(f"{r['rows_per_s']:,.0f}" for r in runs) + ")", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[2]
    for r in runs:
        tl = np.array(r["rss_timeline"], float)
        t = (tl[:, 0] - r["t_probe_start"]) / r["seconds"]
        ax.plot(t, tl[:, 1] / gib, lw=1, label=f"N = {r['rows']:,}")
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(0, None)
    ax.set_xlabel("fraction of the probe run")
    ax.set_ylabel("RSS (GiB)")
    ax.set_title("RSS over the run", fontsize=10)
    ax.legend(fontsize=8)
    m = summary["settings"]
    fig.suptitle(
        f"streaming token probes, head mode, M={m['batches']}, chunk {m['chunk_size']} items, "
        f"BERT {m['layers']}x{m['hidden']} + head {m['hidden']}->{m['dim']}, {m['threads']} thread(s)",
        fontsize=10,
    )
    return [save(fig, path)]


def run(args: Config, ctx: Context) -> dict[str, Any]:
    sizes = sorted(args.sizes)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        runs = []
        for rows in sizes:
            print(f"-- {rows:,} token rows", flush=True)
            r = run_child(args, rows, tmp / f"run-{rows}.parquet", progress=ctx.progress)
            if args.keep_runs:
                Path(args.keep_runs).mkdir(parents=True, exist_ok=True)
                shutil.move(tmp / f"run-{rows}.parquet", Path(args.keep_runs) / f"run-{rows}.parquet")
            r.pop("versions_", None)
            runs.append(r)
            print(
                f"   {r['rows']:,} rows in {r['seconds']:.1f} s ({r['rows_per_s']:,.0f} rows/s), "
                f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB",
                flush=True,
            )
        resume = None
        if args.resume_check:
            rows = sizes[0]
            out = tmp / f"resume-{rows}.parquet"
            half = max(1, runs[0]["chunks"] // 2)
            print(f"-- resume check: {rows:,} rows, killed after {half} chunks", flush=True)
            first = run_child(args, rows, out, kill_at_chunks=half, progress=ctx.progress)
            if not first.get("killed"):
                raise RuntimeError("streaming bench: the run to be killed finished first; use a larger size")
            second = run_child(args, rows, out, resume=True, progress=ctx.progress)
            resume = {
                "rows": rows,
                "killed_after_chunks_on_disk": second["chunks_done_before"],
                "chunks": second["chunks"],
                "chunks_computed_on_resume": second["chunks_computed"],
                "resumed_seconds": second["seconds"],
                "uninterrupted_seconds": runs[0]["seconds"],
                "resumed_peak_rss_bytes": second["peak_rss_bytes"],
                "same_table_as_uninterrupted": _same_tables(out, tmp / f"run-{rows}.parquet"),
            }
            print(
                f"   resumed: computed {resume['chunks_computed_on_resume']} of {resume['chunks']} chunks, "
                f"same table: {resume['same_table_as_uninterrupted']}",
                flush=True,
            )

    small, large = runs[0], runs[-1]
    limit = 4 * 10**9
    return {
        "benchmark": "streaming token probes: peak memory and throughput against the number of probe rows",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "versions": small["versions"],
        "device": small["device"],
        "settings": {
            "model": "BertModel (random weights) + HFEncoder(mean pooling, dense=[Linear]), eager "
            "attention, all-MiniLM-L6-v2 tokenizer",
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "dim": args.dim,
            "mode": "head",
            "params": "head",
            "output": "tokens",
            "objective": "simcse",
            "batches": args.batches,
            "batch_size": args.batch_size,
            "chunk_size": args.chunk_size,
            "radial_spread": True,
            "threads": args.threads,
            "tokenizers_parallelism": False,
            "probes": f"synthetic sentences of {MIN_WORDS}-{MIN_WORDS + SPAN - 1} vocabulary words, "
            f"generated on demand",
            "peak_rss": "ru_maxrss of the child (os.wait4)",
        },
        "runs": [{k: v for k, v in r.items() if k != "versions"} for r in runs],
        "peak_rss_ratio": large["peak_rss_bytes"] / small["peak_rss_bytes"],
        "engine_growth_bytes": {str(r["rows"]): r["peak_rss_bytes"] - r["rss_before_probe_bytes"] for r in runs},
        "targets": {
            "peak_rss_limit_bytes": limit,
            "ratio_limit": 1.2,
            "largest_under_limit": large["peak_rss_bytes"] < limit,
            "ratio_within_limit": large["peak_rss_bytes"] / small["peak_rss_bytes"] <= 1.2,
        },
        "resume_check": resume,
    }


def tables(summary: dict[str, Any]) -> dict[str, str]:
    return {"streaming": table_streaming(summary)}


def table_streaming(d: dict) -> str:
    rows = ["| token probes | chunks | peak RSS | rows/s (relative to the 1M run) |", "|---|---|---|---|"]
    base = d["runs"][0]["rows_per_s"]
    for r in d["runs"]:
        rows.append(
            f"| {r['rows']:,} | {r['chunks']} | {r['peak_rss_bytes'] / 2**20:,.0f} MiB | "
            f"{r['rows_per_s'] / base:.2f}x |"
        )
    s_ = d["settings"]
    rc = d["resume_check"]
    resume = (
        "not run."
        if rc is None
        else (
            f"a run killed after {rc['killed_after_chunks_on_disk']} of {rc['chunks']} chunks recomputed "
            f"{rc['chunks_computed_on_resume']} chunks and gave "
            f"{'the same table' if rc['same_table_as_uninterrupted'] else 'a DIFFERENT table'}."
        )
    )
    rows += [
        "",
        f"Peak RSS ratio 10M / 1M: {d['peak_rss_ratio']:.3f} (target: within 20%, and < 4 GB). "
        f"{s_['mode']} mode, {s_['output']}, M = {s_['batches']}, {s_['threads']} thread, on a "
        f"{s_['layers']}-layer, {s_['hidden']}-wide BERT with a linear head. Resume check: {resume}",
    ]
    return "\n".join(rows)


if __name__ == "__main__":  # a child: python -m bench.experiments.streaming '<settings JSON>'
    child(SimpleNamespace(**json.loads(sys.argv[1])))
