"""Prober: the directions once, then probes in about a second (a Prober's calls, its saved directions, normfast serve).

    python -m bench run prober --out bench/results/prober    # the committed run (3-6 min on 2 cores)
    python -m bench run prober --quick                        # toy sizes: every step, not a result

Protocol (fixed before the committed run), at the demo's settings on the packaged all-MiniLM-L6-v2:
its last layer probed (``encoder\\.layer\\.5\\.``), SimCSE, token rows, jvp mode, M = 16 heat batches
in K = 8 groups, M_D = 256 drift batches of 32, seed 0; the pair source is explicit (the 512 most
common English words, the demo's kind of items).

1. One process, one ``normfast.Prober``: the first ``probe`` of 10 sentences (it computes the
   directions) and a second ``probe`` of 10 other sentences, each timed once; the ratio of the two.
2. A fresh ``normfast.probe`` of the second call's sentences with the same pair source and config:
   every column compared with the second call's (equal value for value, and the largest absolute
   difference of a float column), ``heat_rel`` and ``se_heat_rel`` apart since issue 40: a Prober
   measures them against a reference fixed with its directions, a fresh probe against its own rows
   (the committed run predates that: both then used the run's own rows).
3. ``Prober.save``: the artifact's size on disk and in memory, and for the other models and
   parameter sets the issue names (MiniLM all parameters, all-mpnet-base-v2's last layer and all
   its parameters) the same (M + K) float32 directions counted from their parameter numbers.
4. A new Python process: ``normfast.Prober.load`` of the saved folder, then the second call's
   sentences probed and compared the same way; its load and probe times.
5. Refusals: loading with another seed and with another SimCSE temperature; the first line of each
   error is recorded.
6. ``normfast serve MODEL --directions FOLDER`` started as a process on a free loopback port: the
   time until it serves, then 10 ``POST /api/probe`` of one new sentence each, timed by the client
   (wall clock, HTTP included); their median, and the ratio of step 1's first call to it. Then the
   interactive page in headless Chromium (Debian's chromium driven by playwright): two sentences
   typed and probed, the pointer on "violin", a screenshot (``prober_serve.png``).

Writes ``OUT/prober.json`` and ``OUT/prober_serve.png`` (OUT: ``runs/prober`` by default; the
committed result: ``--out bench/results/prober``). Claims are ratios within this run and equalities;
the absolute times are this machine's, with its load average recorded beside them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import PLAIN_HEAT
from bench.demo_prober import DemoProbe, free_port, start_service, stop_service
from bench.harness import Context
from bench.sentences import FIRST, SECOND

RESULTS = ("prober.json",)
FIGURES = ("prober_serve.png",)
TABLES = ("prober", "prober-sizes", "prober-answer")
#: the repository root: the new process and the service run from there
REPO = Path(__file__).resolve().parents[2]
SERVED = [
    "a storm is coming",
    "the violin sounded sad",
    "she opened the window",
    "coffee keeps me awake",
    "the bridge was closed for repairs",
    "winter came early this year",
    "he forgot his keys again",
    "the library opens at nine",
    "a dog barked in the night",
    "numbers never lie",
]
PAGE_TEXTS = ("the violin sounded sad", "democracy is a fragile idea")
#: the request whose answer the docs show (abridged to one token's row)
EXAMPLE = "the violin sounded sad"


@dataclass
class Config(DemoProbe):
    requests: int = field(default=10, metadata={"help": "one-sentence requests timed against the service"})
    page: bool = field(default=True, metadata={"help": "screenshot the service's page in headless Chromium"})

    @classmethod
    def quick(cls) -> "Config":
        return cls(batches=4, groups=2, drift_batches=8, batch_size=8, n_pairs=64, requests=3, page=False)


#: columns against a reference level: a Prober's is fixed (the pair source's items), a fresh probe's is the
#: run's own median, so these differ by one constant between the two and are left out of the comparison
RELATIVE = ("heat_rel", "se_heat_rel")


def compare(a, b) -> dict[str, Any]:
    """Two results' tables: equal column for column (:data:`RELATIVE` left out), and the largest absolute
    difference of a float column."""
    import numpy as np
    import pyarrow as pa

    ta, tb = (t.drop_columns([c for c in RELATIVE if c in t.column_names]) for t in (a.table, b.table))
    worst = 0.0
    for name in ta.column_names:
        col = ta.column(name)
        if pa.types.is_floating(col.type):
            x, y = col.to_numpy(zero_copy_only=False), tb.column(name).to_numpy(zero_copy_only=False)
            both = np.isfinite(x) & np.isfinite(y)
            if both.any():
                worst = max(worst, float(np.max(np.abs(x[both] - y[both]))))
    same = ta.column_names == tb.column_names and all(ta.column(n).equals(tb.column(n)) for n in ta.column_names)
    return {"rows": ta.num_rows, "columns": ta.num_columns, "equal": bool(same), "max_abs_diff": worst}


def parameter_counts(params: str) -> dict[str, int]:
    """Parameters of all-MiniLM-L6-v2 and all-mpnet-base-v2 (built on the meta device: no weights), all and
    their last layer's."""
    import re

    import torch
    import transformers

    counts = {}
    for name, cfg, last in (
        ("all-MiniLM-L6-v2", transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                                      intermediate_size=1536), r"encoder\.layer\.5\."),
        ("all-mpnet-base-v2", transformers.MPNetConfig(vocab_size=30527), r"encoder\.layer\.11\."),
    ):  # fmt: skip
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(cfg)
        named = list(model.named_parameters())
        counts[f"{name}, last layer"] = sum(p.numel() for n, p in named if re.search(last, n))
        counts[f"{name}, all parameters"] = sum(p.numel() for _, p in named)
    return counts


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def new_process(model: str, folder: Path, out: Path) -> dict[str, float]:
    """A new Python process: the model loaded, the saved directions loaded, the second call's sentences probed."""
    code = textwrap.dedent(
        f"""
        import json, time
        t0 = time.perf_counter()
        import normfast
        from bench.experiments.prober import SECOND
        encoder = normfast.load_encoder({model!r})
        t1 = time.perf_counter()
        prober = normfast.Prober.load({str(folder)!r}, encoder, progress=False)
        t2 = time.perf_counter()
        prober.probe(SECOND, {str(out)!r})
        t3 = time.perf_counter()
        print(json.dumps({{"load_model_s": t1 - t0, "load_directions_s": t2 - t1, "probe_s": t3 - t2}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def serve(config: Config, folder: Path, png: Path | None) -> dict[str, Any]:
    """``normfast serve`` as a process over the saved directions: its start, the timed requests, the page."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "normfast", "serve", config.model, "--directions", str(folder), "--port", str(port)]
    t0 = time.perf_counter()
    proc, _ = start_service(argv)
    try:
        while True:
            try:
                info = json.loads(urllib.request.urlopen(url + "/api/info", timeout=10).read())
                break
            except OSError:
                if time.perf_counter() - t0 > 600:
                    raise
                time.sleep(0.05)
        started = time.perf_counter() - t0
        seconds, server_seconds, rows, example = [], [], [], None
        for text in SERVED[: config.requests]:
            t = time.perf_counter()
            answer = post(url + "/api/probe", {"texts": [text]})
            seconds.append(time.perf_counter() - t)
            server_seconds.append(answer["seconds"])
            rows.append(len(answer["texts"][0]["rows"]))
            if text == EXAMPLE:  # the docs' example answer, abridged to the row of one token
                example = abridged(answer, "violin")
        page = screenshot(url, png) if png is not None else None
    finally:
        stop_service(proc)
    return {
        "command": " ".join(["normfast", "serve", config.model, "--directions", "FOLDER", "--port", "PORT"]),
        "directions": info["directions"] != "computed",
        "ready_s": started,
        "request_s": seconds,
        "request_s_median": statistics.median(seconds),
        "server_probe_s": server_seconds,
        "rows_per_request": rows,
        "example_answer": example,
        "page": page,
    }


def abridged(answer: dict, token: str) -> dict:
    """An answer with only the row of ``token`` left in its text (and how many rows there were)."""
    text = answer["texts"][0]
    kept = [r for r in text["rows"] if r["token"] == token][:1]
    return {**answer, "texts": [{**text, "rows": kept, "rows_left_out": len(text["rows"]) - len(kept)}]}


def screenshot(url: str, png: Path) -> dict[str, Any]:
    """The interactive page: two sentences typed and probed, the pointer on "violin"; a PNG of it."""
    from playwright.sync_api import sync_playwright

    # the system's Chromium, as normfast view --screenshot finds it ($NORMFAST_CHROMIUM, else on the PATH)
    chromium = os.environ.get("NORMFAST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(120_000)
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='idle']")
            page.fill("#nf-input", "\n".join(PAGE_TEXTS))
            page.click("#nf-go")
            page.wait_for_selector("body[data-ready='1']")
            frame = page.frame_locator("#nf-result")
            tokens = frame.locator(".nf-tok:not(.nf-special)").count()
            frame.locator(".nf-tok", has_text="violin").first.hover()
            status = page.inner_text("#nf-live-status")
            page.screenshot(path=str(png))
        finally:
            browser.close()
    return {"texts": list(PAGE_TEXTS), "tokens_colored": tokens, "status": status, "console_errors": errors}


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import warnings

    import normfast
    from normfast.data.word_frequencies import top_words

    load_before = os.getloadavg()
    encoder = normfast.load_encoder(config.model)
    pairs = top_words(config.n_pairs)
    # its committed result predates the heat drawn by energy (bench.common.PLAIN_HEAT)
    cfg = config.probe_config(chunk_size=128, **PLAIN_HEAT)
    prober = normfast.Prober(encoder, "simcse", pairs=pairs, config=cfg, progress=False, model_name=config.model)
    t = time.perf_counter()
    prober.probe(FIRST)
    first_s = time.perf_counter() - t
    t = time.perf_counter()
    second = prober.probe(SECOND)
    second_s = time.perf_counter() - t
    t = time.perf_counter()
    fresh = normfast.probe(encoder, SECOND, "simcse", pairs, cfg, progress=False, model_name=config.model)
    fresh_s = time.perf_counter() - t

    with tempfile.TemporaryDirectory(prefix="nf-prober-") as tmp:
        folder = prober.save(Path(tmp) / "directions")
        manifest = json.loads((folder / "manifest.json").read_text())
        out = Path(tmp) / "new-process.parquet"
        times = new_process(config.model, folder, out)
        loaded = compare(normfast.ProbeResult.load(out), second)
        refusals = {}
        for what, change in (
            ("seed 1", dict(config=replace(cfg, seed=1))),
            ("SimCSE temperature 0.1", dict(objective=normfast.SimCSE(temperature=0.1))),
        ):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    normfast.Prober.load(folder, encoder, progress=False, **change)
                refusals[what] = None
            except ValueError as exc:
                refusals[what] = str(exc).splitlines()[0]
        served = serve(config, folder, ctx.out / FIGURES[0] if config.page else None)

    d = manifest["directions"]
    n_dirs = d["M"] + len(d["drift_counts"] or ())
    probed = sum(math.prod(shape) for _, shape, _ in d["layout"])
    bytes_per_parameter = d["bytes_per_direction"] / probed
    sizes = {
        "measured": {
            "parameters": probed,
            "directions": n_dirs,
            "disk_bytes": manifest["bytes"],
            "memory_bytes": d["memory_bytes"],
            "files": len(manifest["files"]),
        },
        "counted": {
            name: {"parameters": n, "bytes": int(n * bytes_per_parameter * n_dirs)}
            for name, n in parameter_counts(config.params).items()
        },
    }
    return {
        "settings": {**config.settings(), "items": {"first": len(FIRST), "second": len(SECOND)}},
        "timing": {
            "first_call_s": first_s,
            "second_call_s": second_s,
            "fresh_probe_s": fresh_s,
            "new_process": times,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": __import__("torch").get_num_threads(),
        },
        "second_over_first": first_s / second_s,
        "second_equals_fresh": compare(second, fresh),
        "new_process_equals_second": loaded,
        "refused": refusals,
        "serve": served,
        "first_call_over_serve_median": first_s / served["request_s_median"],
        "sizes": sizes,
    }


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    """The page's screenshot was taken during the run (step 6), while the service was up."""
    png = out / FIGURES[0]
    return [png] if png.exists() else []


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def tables(result: dict[str, Any]) -> dict[str, str]:
    s, t, sv = result["settings"], result["timing"], result["serve"]
    eq, nl = result["second_equals_fresh"], result["new_process_equals_second"]
    verdict = {True: "equal, every column", False: "differ"}
    lines = [
        f"{s['model']} `{s['params']}`, {s['objective']}, {s['output']}, M = {s['M']}, K = {s['K']}, "
        f"M_D = {s['M_D']} (batches of {s['batch_size']}), pairs: {s['pairs']}; torch threads "
        f"{t['torch_threads']}, load average {t['load_average_before'][0]} before, {t['load_average_after'][0]} after",
        "",
        "| step | seconds | |",
        "|---|---:|---|",
        f"| first `Prober.probe`, 10 sentences (computes the directions) | {t['first_call_s']:.1f} | |",
        f"| second `Prober.probe`, 10 new sentences | {t['second_call_s']:.2f} | "
        f"**{result['second_over_first']:.0f}×** faster than the first |",
        f"| a fresh `normfast.probe` of those 10 sentences | {t['fresh_probe_s']:.1f} | "
        f"table: {verdict[eq['equal']]} ({eq['rows']} rows, max abs diff {eq['max_abs_diff']:.1g}) |",
        f"| new process: load the model | {t['new_process']['load_model_s']:.1f} | |",
        f"| new process: `Prober.load` the saved directions | {t['new_process']['load_directions_s']:.2f} | |",
        f"| new process: probe the 10 sentences | {t['new_process']['probe_s']:.2f} | "
        f"table: {verdict[nl['equal']]} with the second call's |",
        f"| `normfast serve --directions`: start until it answers | {sv['ready_s']:.1f} | |",
        f"| `normfast serve`: `POST /api/probe` of one sentence, median of {len(sv['request_s'])} | "
        f"{sv['request_s_median']:.2f} | **{result['first_call_over_serve_median']:.0f}×** faster than the "
        f"first call; range {min(sv['request_s']):.2f}–{max(sv['request_s']):.2f} |",
    ]
    refused = result["refused"]
    lines += ["", "Saved directions loaded with other inputs:", ""]
    lines += [f"* {what}: `{msg}`" if msg else f"* {what}: **not refused**" for what, msg in refused.items()]
    m = result["sizes"]["measured"]
    sizes = [
        f"Measured: {s['model']} `{s['params']}`, {m['parameters']:,} parameters × {m['directions']} directions "
        f"(M + K): {_mib(m['disk_bytes'])} on disk in {m['files']} files, {_mib(m['memory_bytes'])} in memory.",
        "",
        "| model, parameters probed | parameters | disk and memory, (M + K) float32 directions |",
        "|---|---:|---:|",
    ]
    sizes += [
        f"| {name} | {c['parameters']:,} | {_mib(c['bytes'])} |" for name, c in result["sizes"]["counted"].items()
    ]
    blocks = {"prober": "\n".join(lines), "prober-sizes": "\n".join(sizes), "prober-answer": None}
    example = sv.get("example_answer")
    if example is not None:
        text = dict(example["texts"][0])
        left = text.pop("rows_left_out")
        shown = {**example, "texts": [text]}
        blocks["prober-answer"] = (
            f"```json\n{json.dumps(shown, indent=2)}\n```\n\n({left} more rows of that text left out here: "
            f"the answer holds one row per token, [CLS] and [SEP] included.)"
        )
    return blocks
