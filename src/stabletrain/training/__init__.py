"""Train: the loop on Lightning Fabric and what it needs around it (see docs/training.md).

* :mod:`~stabletrain.training.loop`: :func:`train` and the :class:`Trainer`, whose
  ``fit -> train_step -> forward_backward`` is the whole loop; the events it fires are drawn in
  :mod:`stabletrain.events`.
* :mod:`~stabletrain.training.setup`: the Fabric, the out folder, the debugging callbacks, settings.json.
* :mod:`~stabletrain.training.checks`: every configuration problem at once, before anything is written.
* :mod:`~stabletrain.training.preflight`: the checks that need no torch (``stabletrain train`` runs them first).
* :mod:`~stabletrain.training.optim`: the optimizer and the learning-rate schedule.
* :mod:`~stabletrain.training.state`: the checkpoint state, the checks before resuming, a resumed history.
* :mod:`~stabletrain.training.step_log`: one logged step, read back in one host synchronisation.

The pieces the loop is protected by are in :mod:`stabletrain.safety`; the tools that explain a
run are in :mod:`stabletrain.debug`; a run's files are read and written by :mod:`stabletrain.runfiles`.
"""
