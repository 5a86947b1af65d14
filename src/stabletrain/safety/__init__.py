"""Protect: what stops a run before it saves damage, and what heals it (see docs/blowups.md,
docs/self_healing.md).

The answer to "where is the code that stops a run before it saves a NaN?":

* :mod:`~stabletrain.safety.guard`: :class:`StepGuard`, the device-side check of every step (loss,
  gradient norm before the optimizer step; weights and optimizer state after it); usable in any loop.
* :mod:`~stabletrain.safety.checkpoint_health`: every checkpoint verified finite on the device,
  and whether it is healthy (no instability under way) recorded in it.
* :mod:`~stabletrain.safety.net`: :class:`SafetyNet`, the guard, checkpoint verification and
  interrupts joined for the trainer.
* :mod:`~stabletrain.safety.interrupts`: SIGINT/SIGTERM finish the step, checkpoint and exit 130/143.
* :mod:`~stabletrain.safety.stop_messages`: the words a run ends with: where to continue from, and how.
* :mod:`~stabletrain.safety.optimizer_capture`: the optimizer step the guard stopped at, captured by a re-run.

Self-healing (``on_instability``): :mod:`~stabletrain.safety.spike_detector` (decide on the device),
:mod:`~stabletrain.safety.skip_step` (undo a step), :mod:`~stabletrain.safety.rollback_snapshot`
(snapshots), :mod:`~stabletrain.safety.instability_guard` (detector + skip for any loop) and
:mod:`~stabletrain.safety.healing` (the trainer's policy).

Imports run one way: safety uses the explaining tools (:mod:`stabletrain.debug`), never the loop.
"""
