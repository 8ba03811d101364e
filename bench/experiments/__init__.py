"""The experiments, one module (or sub-package) each; the list and the contract: :mod:`bench.harness`."""
