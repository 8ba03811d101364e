"""Training before probing: to a stationary state, then the equilibrium law tested on it.

The pieces every experiment of that kind needs, for any :class:`~normfast.encoders.Encoder`
and a pool of (anchor, positive) pairs of its items (E2 on the real MiniLM uses them;
``python -m bench run e2``), one module each:

* :mod:`.settings` -- :class:`TrainSettings` (SGD + decay on InfoNCE pairs, what is
  recorded) and :class:`HealthThresholds`;
* :mod:`.stationary` -- :func:`split_decay` (the trained parameters, split into decayed
  and exempt: SGD parameter groups, the same exemption the engine gets through
  ``ProbeConfig(no_decay=...)``) and :func:`train` (plain SGD, no momentum, with
  decoupled-in-effect weight decay on the decayed group, a linear lr warm-up, InfoNCE on
  uniform draws from the pool as the engine's virtual batches are drawn, recording over
  the late window the probe items' norms, the embeddings' mean pairwise cosine and the
  decayed weights' norm; a callback runs the engine at checkpoints);
* :mod:`.criteria` -- :func:`health`, the criteria a run must meet before any fit means
  anything: (a) loss below a fraction of chance, (b) no collapse, (c) norms and weights
  stationary between the window halves;
* :mod:`.selection` -- :func:`pilot`, candidate settings in a fixed order, health only (it
  never computes the law's inputs or a fit); the first that passes is chosen;
* :mod:`.checkpoints` -- :class:`CheckpointLaw`, the engine at every checkpoint, the
  statistics averaged over the checkpoints, the law solved on the averages (full and
  heat-only), the regime check of the averages, and the last checkpoint alone;
* :mod:`.storage` -- :class:`Resume` (a state file that lets an interrupted :func:`train`,
  with its checkpoints' statistics, go on where it stopped, with the same result) and
  :class:`CheckpointSnapshots` (the trained parameters saved at every checkpoint);
* :mod:`.workers` -- :func:`probe_checkpoints`, the snapshots probed after training in
  one worker process per core (the laws then hold what probing during training gives);
* :mod:`.epochs` -- the plain loop other experiments train with (:func:`train_epochs`),
  :func:`embed_in_chunks` and :func:`zero_shot_entropy`.

Plain SGD + weight decay is what the law describes (DESIGN §1); the dropout of
the encoder is off in training, as in the engine's virtual batches, so the
only noise is the minibatch noise.
"""

from bench.training.checkpoints import CheckpointLaw
from bench.training.criteria import health
from bench.training.epochs import embed_in_chunks, train_epochs, zero_shot_entropy
from bench.training.selection import pilot
from bench.training.settings import HealthThresholds, TrainSettings
from bench.training.stationary import Records, mean_cosine, split_decay, train
from bench.training.storage import CheckpointSnapshots, Resume
from bench.training.workers import probe_checkpoints

__all__ = [
    "CheckpointLaw",
    "CheckpointSnapshots",
    "HealthThresholds",
    "Records",
    "Resume",
    "TrainSettings",
    "embed_in_chunks",
    "health",
    "mean_cosine",
    "pilot",
    "probe_checkpoints",
    "split_decay",
    "train",
    "train_epochs",
    "zero_shot_entropy",
]
