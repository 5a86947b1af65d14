"""A run's folder, read and written by all three jobs: checkpoints, the metrics history, the
commands that continue a run.

* :mod:`~stabletrain.runfiles.checkpoint`: ``checkpoints/last.ckpt`` and ``step_NNNNNN.ckpt``:
  atomic writes, safe loading, rotation, the newest healthy one.
* :mod:`~stabletrain.runfiles.history`: ``metrics.jsonl`` as one timeline across resumes.
* :mod:`~stabletrain.runfiles.commands`: pasteable ``stabletrain train`` commands from a run's settings.

It sits below the loop, the safety net and the tools, so each of them can read a run's files
without importing another.
"""
