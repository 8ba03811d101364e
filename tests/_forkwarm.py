"""Imported once by the tests' fork server (tests/engine/runner/test_distributed.py, RANK_PRELOAD): the one-time work
that every process forked from it would otherwise repeat (about 2 s each: the forward-mode AD
decompositions, transformers' table of checkpoint conversions, the CLI's modules)."""

from torch._decomp import decompositions_for_jvp  # noqa: F401 - loaded by the first forward-mode jvp
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

import normfast.apps.probe_command  # noqa: F401
import normfast.cli  # noqa: F401
import normfast.engine.report.summary  # noqa: F401

get_checkpoint_conversion_mapping("bert")  # built once per process, on the first from_pretrained
