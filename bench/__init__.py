"""normfast's experiments and benchmarks in one harness.

    python -m bench list                       # every experiment: name, title, default output
    python -m bench run NAME [--quick] [--seed N] [--out DIR] [options]
    python -m bench tables --check README.md   # the README's results tables against bench/results

Each experiment is a module of :mod:`bench.experiments` (the contract:
:mod:`bench.harness`); the runner (:mod:`bench.cli`) parses its options from
its ``Config``, seeds, times, writes the JSON and the figures, and prints its
tables with the command that reproduces them. :mod:`bench.tables` renders the
README's (and the docs') results tables from ``bench/results``.

Experiment code calls the public API (``import normfast``, ``normfast.ops``)
and, where it needs more, only names in the ``__all__`` of the stable internals
that :mod:`normfast.stable` lists, a documented and versioned set
(``tests/test_layout.py`` checks every import of ``bench/`` against it).
Shared study code lives here too: :mod:`bench.training` (training a real
encoder to a stationary state, for E2 and E5) and :mod:`bench.common`.

``bench/test_micro.py`` is not an experiment: it holds pytest-benchmark
micro-benchmarks (``pytest bench/test_micro.py --benchmark-only``), the tool
made for them; pytest's ``testpaths`` leave it out of the test suite.
"""

from __future__ import annotations

from typing import Any


def catalog() -> list[dict[str, Any]]:
    """Every experiment: ``name``, ``title``, ``protocol`` (its docstring), ``command`` (the one that
    writes the committed results), ``tables`` (README blocks), ``figures`` and ``results`` (file
    names under bench/results/NAME). Imports no heavy library (torch is imported by ``run`` only)."""
    from bench import harness

    out = []
    for name in harness.EXPERIMENTS:
        m = harness.load(name)
        out.append(
            {
                "name": name,
                "title": harness.title(m),
                "protocol": (m.__doc__ or "").strip(),
                "command": f"python -m bench run {name} --out bench/results/{name}",
                "tables": list(m.TABLES),
                "figures": list(m.FIGURES),
                "results": list(m.RESULTS),
            }
        )
    return out
