"""normfast in the training loop: the trainers' adapters and the report of a monitor folder.

* :mod:`.callbacks` -- :class:`MonitorCallback`, a ``transformers.TrainerCallback`` (so
  sentence-transformers' ``SentenceTransformerTrainer`` works too);
* :mod:`.lightning` -- :class:`LightningMonitor`, a Lightning callback (the optional extra
  ``normfast[lightning]``; the module imports without it and the class says what to install);
* :mod:`.report` -- ``normfast report FOLDER`` on a monitor folder: the text, the figure and the files.

The monitor itself is :class:`normfast.TrainingMonitor` (:mod:`normfast.engine.monitor`); what its
folder says is computed by :mod:`normfast.engine.monitor_analysis`. Nothing here is imported by
``import normfast``: each adapter imports its trainer library when it is first used.
"""
