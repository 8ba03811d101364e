"""The experiment contract and what the runner does around a run.

An experiment is a module of :mod:`bench.experiments` (a sub-package where it
needs several modules) with:

* its protocol in the module docstring (the first line is its title);
* ``RESULTS``, ``FIGURES``, ``TABLES``: the JSON and PNG file names it writes
  (as committed under ``bench/results/NAME``) and the README/docs blocks it renders;
* ``Config``: one dataclass; every field is a command-line option of
  ``python -m bench run NAME`` (:mod:`bench.cli`); ``Config.quick()`` gives
  the quick size; an optional ``validate()`` raises ``ValueError`` on bad
  settings;
* ``run(config, ctx) -> dict``: the result, JSON-ready except for keys that
  start with ``_`` (live objects for ``figures`` and ``tables``; never written);
  a result with ``_failed`` (a message) makes the runner exit with status 1
  after writing everything;
* optionally ``figures(result, out) -> list[Path]``, ``tables(result) ->
  dict[str, str]`` (the markdown of one run), ``blocks(load) -> dict[str, str]``
  (the README blocks from the committed results when they span several files;
  without it the blocks are ``tables`` of the committed ``RESULTS[0]``),
  ``result_name(config)`` (when the JSON's name depends on the config) and
  ``JSON`` (a :class:`JsonStyle`; the format each committed file has).

``e1`` (two result files, written as it goes), ``throughput`` (it runs the
product command ``normfast throughput``) and ``gpu_check`` (which rewrites its
report after every stage, so that a crash keeps what was measured) write their
own files: ``WRITES_OWN_FILES = True``.

The runner (:func:`execute`) seeds Python, numpy and torch, times the run,
writes the JSON, calls the figure function and returns what to print. Raise
:class:`UsageError` from ``run`` for an expected failure the user can fix (a
missing optional extra, a bad input folder): the runner prints it and exits
with status 2.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import random
import resource
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

#: every experiment, in the order ``python -m bench list`` shows them
EXPERIMENTS = (
    "e1",
    "e1_drift",
    "e1_counterfactual",
    "e1_adamw",
    "e2",
    "e3",
    "e4",
    "e5",
    "corpus",
    "corpus_recipe",
    "judgments",
    "calibration",
    "heat_sampling",
    "adaptive_m",
    "monitor",
    "monitor_every",
    "monitor_transient",
    "prober",
    "serve_load",
    "streaming",
    "quartic",
    "head_stats",
    "accumulate",
    "kernel_resources",
    "roofline",
    "gpu_check",
    "throughput",
)
#: the committed results
RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: the quick runs whose JSON is committed (bench/results/NAME/quick): ``--quick`` reproduces them exactly
QUICK = "quick"


def results_dir(name: str) -> Path:
    """Where experiment ``name``'s committed results live: ``bench/results/NAME``."""
    return RESULTS_DIR / name


def quick_dir(name: str) -> Path:
    """Where experiment ``name``'s committed quick results live: ``bench/results/NAME/quick``."""
    return RESULTS_DIR / name / QUICK


class UsageError(Exception):
    """An expected failure the user can fix (printed without a traceback; exit status 2)."""


@dataclass
class Context:
    """What a run gets besides its config: where to write, whether to draw progress bars."""

    out: Path = Path("runs")
    progress: bool = False
    quick: bool = False
    #: the command that reproduces the run (``python -m bench run NAME ...``)
    command: str = ""


@dataclass(frozen=True)
class JsonStyle:
    """How a result file is written: ``strict`` turns NaN and numpy values into JSON first."""

    indent: int = 1
    newline: bool = True
    strict: bool = True


def load(name: str) -> ModuleType:
    """The experiment module ``name`` (a :data:`EXPERIMENTS` entry)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"bench: expected an experiment name from {', '.join(EXPERIMENTS)}, got {name!r}")
    return importlib.import_module(f"bench.experiments.{name}")


def title(module: ModuleType) -> str:
    """The first paragraph of the module docstring, on one line."""
    first = (module.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(first.split()).rstrip(".")


def result_name(module: ModuleType, config: Any) -> str:
    fn = getattr(module, "result_name", None)
    return fn(config) if fn else module.RESULTS[0]


def dumps(data: Any, style: JsonStyle = JsonStyle()) -> str:
    if style.strict:
        from normfast.data.io import json_ready

        data = json_ready(data)
    text = json.dumps(data, indent=style.indent, allow_nan=not style.strict)
    return text + "\n" if style.newline else text


def write_json(path: Path, data: Any, style: JsonStyle = JsonStyle()) -> Path:
    """Written aside and renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data, style))
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def resumable(ctx: Context, unit: str, key: Any, compute: Callable[[], Any], style: JsonStyle = JsonStyle()) -> Any:
    """One unit of a long study, kept in ``OUT/partial/UNIT.json`` until the whole result is written.

    A rerun with the same ``--out`` reads a finished unit back instead of computing it again when the
    file's ``key`` (the settings that shape the unit) equals ``key``; a unit of other settings, or one
    interrupted before its file was written, is computed again. Files are written aside and renamed,
    so an interruption never leaves half a unit. :func:`drop_partial` removes them once the result
    that assembles them is written.
    """
    path = ctx.out / "partial" / f"{unit}.json"
    kept = read_json(path)
    if "result" in kept and kept.get("key") == json.loads(dumps(key)):
        print(f"{unit}: kept from {path}", flush=True)
        return kept["result"]
    result = compute()
    write_json(path, {"key": key, "result": result}, style)
    return result


def drop_partial(ctx: Context, units: list[str]) -> None:
    """Remove the named units of ``OUT/partial/`` (and the folder once it is empty)."""
    folder = ctx.out / "partial"
    for unit in units:
        (folder / f"{unit}.json").unlink(missing_ok=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators (experiments seed their own as well)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@dataclass
class Outcome:
    """A finished run: the result, the files written, the tables, the time taken."""

    result: dict[str, Any]
    written: list[Path]
    tables: dict[str, str]
    wall_seconds: float
    cpu_seconds: float
    failed: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def execute(name: str, config: Any, ctx: Context, seed: int = 0) -> Outcome:
    """Seed, run, write the JSON and the figures; the torch thread count is restored afterwards."""
    import torch

    module = load(name)
    threads = torch.get_num_threads()
    seed_everything(seed)
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    try:
        result = module.run(config, ctx)
    finally:
        torch.set_num_threads(threads)
    written: list[Path] = []
    public = {k: v for k, v in result.items() if not k.startswith("_")}
    if getattr(module, "WRITES_OWN_FILES", False):
        written += [ctx.out / n for n in result.get("_written", ())]
    else:
        written.append(write_json(ctx.out / result_name(module, config), public, getattr(module, "JSON", JsonStyle())))
        figures: Callable[..., list[Path]] | None = getattr(module, "figures", None)
        if figures is not None:
            written += figures(result, ctx.out)
    tables = module.tables(result) if hasattr(module, "tables") else {}
    return Outcome(
        public, written, tables, time.perf_counter() - wall0, cpu_seconds() - cpu0, failed=result.get("_failed")
    )


# ---------------------------------------------------------------------------
# comparing runs: the fields that describe the machine or the clock, not the result

#: keys left out when two runs are compared (anywhere in the tree): the machine, the clock, the command
VOLATILE_KEYS = frozenset(
    {
        "timing",
        "runtime",
        "versions",
        "environment",
        "machine",
        "device",
        "command",
        "date",
        "started",
        "finished",
        "segments",
        "rss_timeline",
        "source",
        "torch_threads",
        "speed",
    }
)


def volatile(key: str) -> bool:
    """A field that describes the clock or the machine, not the result: :data:`VOLATILE_KEYS`, any key
    holding ``seconds``, ``load_average`` or ``time_ratio``, and rates (``*_s``, ``*_ms``, ``*_per_s``)."""
    return (
        key in VOLATILE_KEYS
        or any(part in key for part in ("seconds", "load_average", "time_ratio"))
        or key.endswith(("_s", "_ms", "_per_s"))
    )


def comparable(obj: Any) -> Any:
    """``obj`` without its volatile fields (:func:`volatile`): what two runs of a deterministic
    experiment with the same config and seed must agree on exactly."""
    if isinstance(obj, dict):
        return {k: comparable(v) for k, v in obj.items() if not volatile(k)}
    if isinstance(obj, list):
        return [comparable(v) for v in obj]
    return obj


#: How far a float of a committed quick result may move when the same command runs on another machine
#: (another CPU code path: AVX-512 or AVX2 kernels reassociate float32 sums, so every float differs
#: in its last bits and a training loop carries the difference along). Structure, integers, strings
#: and booleans must agree exactly; a float ``a`` against the committed ``b`` passes when
#: ``|a - b| <= QUICK_ATOL + QUICK_RTOL * max(|a|, |b|)``. An experiment whose quick run amplifies
#: rounding in some fields (a training loop, a statistic of pure rounding noise, a bootstrap percentile)
#: names them in ``QUICK_TOLERANCE`` (fnmatch pattern of the path -> its rtol, or None: structure and
#: type only), each with the reason. Measured (the README of bench/results): under torch's portable
#: CPU path the quick runs committed from the AVX2 path differ by at most 2e-6 (relative) in most
#: experiments, 3.1e-4 in E1's MLP.
QUICK_RTOL = 5e-4
QUICK_ATOL = 1e-9


def differences(
    got: Any,
    want: Any,
    *,
    rtol: float = QUICK_RTOL,
    atol: float = QUICK_ATOL,
    loose: dict[str, float | None] | None = None,
    path: str = "",
) -> list[str]:
    """Where ``got`` differs from ``want`` beyond float rounding (both JSON-like, volatile fields already
    left out by :func:`comparable`): one line per difference, naming its path. ``loose``: path patterns
    with their own tolerance (None: any float passes)."""
    if isinstance(want, dict) or isinstance(got, dict):
        if not (isinstance(want, dict) and isinstance(got, dict)):
            return [f"{path or '/'}: {type(got).__name__} where {type(want).__name__} was committed"]
        out = [f"{path}/{k}: missing" for k in want if k not in got]
        out += [f"{path}/{k}: not in the committed result" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(got[k], want[k], rtol=rtol, atol=atol, loose=loose, path=f"{path}/{k}")
        return out
    if isinstance(want, list) or isinstance(got, list):
        if not (isinstance(want, list) and isinstance(got, list)) or len(got) != len(want):
            return [f"{path}: {_short(got)} where {_short(want)} was committed"]
        out: list[str] = []
        for i, (g, w) in enumerate(zip(got, want)):
            out += differences(g, w, rtol=rtol, atol=atol, loose=loose, path=f"{path}[{i}]")
        return out
    if isinstance(want, float) and isinstance(got, (float, int)) and not isinstance(got, bool):
        for pattern, own in (loose or {}).items():
            if fnmatch.fnmatchcase(path, pattern):
                if own is None:
                    return []
                rtol = own
                break
        if not (abs(got - want) <= atol + rtol * max(abs(got), abs(want))):
            return [
                f"{path}: {got!r} where {want!r} was committed (relative difference "
                f"{abs(got - want) / max(abs(got), abs(want)):.1e} > {rtol:g})"
            ]
        return []
    if type(got) is not type(want) or got != want:
        return [f"{path}: {_short(got)} where {_short(want)} was committed"]
    return []


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def config_fields(config_cls: type) -> list[str]:
    return [f.name for f in fields(config_cls)]
