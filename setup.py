"""Build the one compiled piece, the batched quartic solver ``normfast._quartic``.

Everything else is pure Python; packages are listed explicitly because the
``kernels/`` folder is installed as ``normfast.kernels`` and setuptools'
auto-discovery mishandles such remaps in editable installs.
"""
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

compile_args = ["-O3", "-ffp-contract=off"]
link_args = []
if sys.platform.startswith("linux"):
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")

ext = Pybind11Extension(
    "normfast._quartic",
    sources=["csrc/quartic.cpp", "csrc/bindings.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(
    packages=["normfast", "normfast.kernels"],
    package_dir={"normfast": "normfast", "normfast.kernels": "kernels"},
    package_data={"normfast": ["py.typed", "*.pyi"]},
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)
