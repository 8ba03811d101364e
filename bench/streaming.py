"""Bounded-memory streaming: peak memory and throughput of token probes at 1M and 10M rows.

    python bench/streaming.py [--sizes 1000000 10000000] [--chunk-size 512] [--batches 16]

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

Writes ``runs/streaming.json`` and ``runs/streaming.png`` (the committed result:
``--out bench/results/streaming.json``).
Claims are ratios within this run (the 10M run's peak RSS against the 1M
run's); absolute CPU times on a shared VM are recorded, not claimed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

RUNS = Path(__file__).resolve().parents[1] / "runs"  # default output (git-ignored)
SEED = 0
MIN_WORDS, SPAN = 6, 25  # sentence i has MIN_WORDS + (i * 7919) % SPAN words


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


def child(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from torch import nn

    from normfast.encoders.packaged import minilm_path
    from normfast.encoders import HFEncoder
    from normfast.engine.probe import ProbeConfig, probe

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
    cfg = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  intermediate_size=4 * args.hidden, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.BertModel(cfg).eval()
    encoder = HFEncoder(model, tokenizer, pooling="mean", dense=[nn.Linear(args.hidden, args.dim)])
    words = _vocab_words(tokenizer)
    n_items, expected_rows = items_for_rows(args.rows)
    probes = Sentences(n_items, words, SEED)
    pairs = Sentences(4096, words, SEED + 1)[0:4096]
    config = ProbeConfig(params="head", mode="head", output="tokens", batches=args.batches,
                         batch_size=args.batch_size, seed=SEED, chunk_size=args.chunk_size,
                         drift_batches=None)  # the protocol predates the mean-direction drift
    out = Path(args.out)
    parts = out.with_name(out.name + ".parts")
    done_before = len(list(parts.glob("chunk-*.parquet"))) if parts.exists() else 0
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    result = probe(encoder, probes, "simcse", pairs, config, out=out, resume=args.resume,
                   overwrite=not args.resume, progress=not args.no_progress, model_name="tiny-bert (random)")
    seconds = time.perf_counter() - t0
    rows = len(result)
    stop.set()
    sampler.join()
    n_chunks = -(-n_items // args.chunk_size)
    report = {
        "rows": rows, "expected_rows": expected_rows, "items": n_items, "chunks": n_chunks,
        "chunks_done_before": done_before, "chunks_computed": n_chunks - done_before,
        "seconds": seconds, "rows_per_s": rows / seconds, "rss_before_probe_bytes": rss_before,
        "peak_rss_self_bytes": _hwm_bytes(), "file_bytes": out.stat().st_size,
        "result_holds_table": result._table is not None,
        "rss_timeline": [(round(t, 2), r) for t, r in samples],
        "t_probe_start": round(t0 - t_start, 2),
        "versions": result.metadata["versions"], "device": result.metadata["device"],
    }
    print("RESULT " + json.dumps(report), flush=True)


# ---------------------------------------------------------------------------
# parent


def _child_command(args: argparse.Namespace, rows: int, out: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--rows", str(rows), "--out", str(out),
           "--chunk-size", str(args.chunk_size), "--batches", str(args.batches), "--batch-size",
           str(args.batch_size), "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads",
           str(args.heads), "--dim", str(args.dim), "--threads", str(args.threads),
           "--sample-every", str(args.sample_every)]
    if resume:
        cmd.append("--resume")
    if args.no_progress:
        cmd.append("--no-progress")
    return cmd


def run_child(args: argparse.Namespace, rows: int, out: Path, *, resume: bool = False,
              kill_at_chunks: int | None = None) -> dict:
    """Run one child; its own peak RSS comes from wait4 (ru_maxrss, KiB on Linux)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads))
    t0 = time.perf_counter()
    proc = subprocess.Popen(_child_command(args, rows, out, resume), stdout=subprocess.PIPE, env=env, text=True)
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
    report = json.loads(found[-1][len("RESULT "):])
    report["peak_rss_bytes"] = usage.ru_maxrss * 1024
    report["wall_seconds"] = wall
    return report


def _same_tables(a: Path, b: Path) -> bool:
    from normfast.engine.probe import ProbeResult

    ra, rb = ProbeResult.load(a), ProbeResult.load(b)
    if len(ra) != len(rb):
        return False
    for x, y in zip(ra.iter_batches(batch_size=1 << 18), rb.iter_batches(batch_size=1 << 18)):
        if not x.equals(y):
            return False
    return True


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    n = np.array([r["rows"] for r in runs], float)
    gib = 2.0**30
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    ax.plot(n, [r["peak_rss_bytes"] / gib for r in runs], "o-", label="peak RSS (process)")
    ax.plot(n, [r["rss_before_probe_bytes"] / gib for r in runs], "s--", label="RSS before probe (model loaded)")
    ax.axhline(summary["targets"]["peak_rss_limit_bytes"] / gib, color="r", lw=0.8, ls=":",
               label="target: 4 GB (3.73 GiB)")
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
    fig.suptitle(f"streaming token probes, head mode, M={m['batches']}, chunk {m['chunk_size']} items, "
                 f"BERT {m['layers']}x{m['hidden']} + head {m['hidden']}->{m['dim']}, {m['threads']} thread(s)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="token rows per run")
    p.add_argument("--chunk-size", type=int, default=512, help="probe items (sentences) per chunk")
    p.add_argument("--batches", type=int, default=16, help="M virtual batches")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=32, help="output width of the projection head")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sample-every", type=float, default=0.5, help="RSS sampling period (s)")
    p.add_argument("--no-resume-check", action="store_true")
    p.add_argument("--workdir", default=None, help="where the Parquet outputs go (default: a temp folder)")
    p.add_argument("--out", default=str(RUNS / "streaming.json"),
                   help="output JSON (default %(default)s; the committed result: --out bench/results/streaming.json)")
    p.add_argument("--no-progress", action="store_true")
    # child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0

    sizes = sorted(args.sizes)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        runs = []
        for rows in sizes:
            print(f"-- {rows:,} token rows", flush=True)
            r = run_child(args, rows, tmp / f"run-{rows}.parquet")
            r.pop("versions_", None)
            runs.append(r)
            print(f"   {r['rows']:,} rows in {r['seconds']:.1f} s ({r['rows_per_s']:,.0f} rows/s), "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
        resume = None
        if not args.no_resume_check:
            rows = sizes[0]
            out = tmp / f"resume-{rows}.parquet"
            half = max(1, runs[0]["chunks"] // 2)
            print(f"-- resume check: {rows:,} rows, killed after {half} chunks", flush=True)
            first = run_child(args, rows, out, kill_at_chunks=half)
            if not first.get("killed"):
                raise RuntimeError("streaming bench: the run to be killed finished first; use a larger size")
            second = run_child(args, rows, out, resume=True)
            resume = {"rows": rows, "killed_after_chunks_on_disk": second["chunks_done_before"],
                      "chunks": second["chunks"], "chunks_computed_on_resume": second["chunks_computed"],
                      "resumed_seconds": second["seconds"], "uninterrupted_seconds": runs[0]["seconds"],
                      "resumed_peak_rss_bytes": second["peak_rss_bytes"],
                      "same_table_as_uninterrupted": _same_tables(out, tmp / f"run-{rows}.parquet")}
            print(f"   resumed: computed {resume['chunks_computed_on_resume']} of {resume['chunks']} chunks, "
                  f"same table: {resume['same_table_as_uninterrupted']}", flush=True)

    small, large = runs[0], runs[-1]
    limit = 4 * 10**9
    summary = {
        "benchmark": "streaming token probes: peak memory and throughput against the number of probe rows",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
        "versions": small["versions"], "device": small["device"],
        "settings": {"model": "BertModel (random weights) + HFEncoder(mean pooling, dense=[Linear]), eager "
                              "attention, all-MiniLM-L6-v2 tokenizer",
                     "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "dim": args.dim,
                     "mode": "head", "params": "head", "output": "tokens", "objective": "simcse",
                     "batches": args.batches, "batch_size": args.batch_size, "chunk_size": args.chunk_size,
                     "radial_spread": True, "threads": args.threads, "tokenizers_parallelism": False,
                     "probes": f"synthetic sentences of {MIN_WORDS}-{MIN_WORDS + SPAN - 1} vocabulary words, "
                               f"generated on demand", "peak_rss": "ru_maxrss of the child (os.wait4)"},
        "runs": [{k: v for k, v in r.items() if k != "versions"} for r in runs],
        "peak_rss_ratio": large["peak_rss_bytes"] / small["peak_rss_bytes"],
        "engine_growth_bytes": {str(r["rows"]): r["peak_rss_bytes"] - r["rss_before_probe_bytes"] for r in runs},
        "targets": {"peak_rss_limit_bytes": limit, "ratio_limit": 1.2,
                    "largest_under_limit": large["peak_rss_bytes"] < limit,
                    "ratio_within_limit": large["peak_rss_bytes"] / small["peak_rss_bytes"] <= 1.2},
        "resume_check": resume,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"peak RSS ratio {large['rows']:,} / {small['rows']:,} rows: {summary['peak_rss_ratio']:.3f}; "
          f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
