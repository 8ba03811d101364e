"""The probe loop around the stages: run state, chunks, adaptive M, row tables, output files,
sharding and provenance.

* :mod:`.state` -- :class:`ProbeRun`, one run's shared state (what is probed, how, the directions,
  the accumulators, the progress bar), and :class:`DirectionStore`, the directions a Prober keeps
  across its runs;
* :mod:`.chunks` -- probe items in chunks through head or jvp mode, each chunk finished into rows;
* :mod:`.adaptive` -- adaptive M: as many heat batches as the error bars ask for;
* :mod:`.rows` -- a chunk's output table (metadata, statistics, the law per row, validity, regime);
* :mod:`.output` -- one call's output around the chunk loop: its record and resume key, the output
  opened or resumed, the chunks written, the run finished (one file, in memory, sharded) with its
  run-level summaries;
* :mod:`.files` -- opening and resuming a run's work folder, the directions-outer state;
* :mod:`.distributed` -- sharding the items over ``torch.distributed`` ranks;
* :mod:`.provenance` -- content hashes of the inputs and the model, library versions, the device;
* :mod:`.artifact` -- a Prober's directions on disk (safetensors files and a manifest of their inputs);
* :mod:`.integrity` -- what a directions folder may hold, and every saved file checked against its manifest.
"""

from normfast.engine.runner.adaptive import adaptive_choice
from normfast.engine.runner.chunks import run_chunks
from normfast.engine.runner.distributed import Shard, current_shard, init_from_env
from normfast.engine.runner.files import open_output
from normfast.engine.runner.output import call_record, finish_sharded, probe_call
from normfast.engine.runner.provenance import device_name, hash_items, hash_model, library_versions
from normfast.engine.runner.rows import finish_table
from normfast.engine.runner.state import DirectionStore, ProbeRun

__all__ = [
    "DirectionStore",
    "ProbeRun",
    "Shard",
    "adaptive_choice",
    "call_record",
    "current_shard",
    "device_name",
    "finish_sharded",
    "finish_table",
    "hash_items",
    "hash_model",
    "init_from_env",
    "library_versions",
    "open_output",
    "probe_call",
    "run_chunks",
]
