"""Build the one compiled piece, the batched quartic solver ``normfast.core._quartic``.

Everything else is pure Python; packages are listed explicitly (a sub-package missing here
would be missing from the wheel; tests/test_api.py checks the list).
"""

import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

# -fno-math-errno: sqrt may then compile to one (vector) instruction; results
# are the same, only errno is left alone
compile_args = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
link_args = []
if sys.platform.startswith("linux"):
    # -Wno-psabi: the solver's internal vector helpers take 32-byte vectors by
    # value; GCC notes an old ABI change for such arguments, which never cross
    # a library boundary here
    compile_args += ["-fopenmp", "-Wno-psabi"]
    link_args.append("-fopenmp")

ext = Pybind11Extension(
    "normfast.core._quartic",
    sources=["csrc/quartic.cpp", "csrc/bindings.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(
    packages=[
        "normfast",
        "normfast.apps",
        "normfast.apps.retrieval",
        "normfast.apps.serve",
        "normfast.apps.throughput",
        "normfast.core",
        "normfast.core.reference",
        "normfast.data",
        "normfast.encoders",
        "normfast.engine",
        "normfast.engine.diagnostics",
        "normfast.engine.directions",
        "normfast.engine.directions.objectives",
        "normfast.engine.estimators",
        "normfast.engine.monitor",
        "normfast.engine.report",
        "normfast.engine.report.page",
        "normfast.engine.runner",
        "normfast.engine.trajectory",
        "normfast.engine.transmission",
        "normfast.engine.transmission.head",
        "normfast.kernels",
    ],
    # the pages' templates, scripts and style (normfast view, normfast compare, normfast serve) are read from the
    # installed package
    package_data={
        "normfast": ["py.typed"],
        "normfast.core": ["*.pyi"],
        "normfast.engine.report.page": ["*.j2", "*.js", "*.css"],
        "normfast.engine.monitor": ["*.j2", "*.js"],
    },
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)
