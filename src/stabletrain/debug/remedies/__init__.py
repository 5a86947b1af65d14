"""remedies: candidate fixes tried from a checkpoint, ranked by measured outcome.

A run's own settings are re-run from the newest healthy checkpoint before the trouble, once per
candidate (the run's lr x0.3 and x0.1, a longer warmup, clipping, AdamW eps and beta2, a wider
precision, qk_norm and z_loss for the built-in language model), through the failing stretch and a
margin past it, in the run's data order; the outcomes are ranked and the best that beats the run
as it was beyond the noise is the verified remedy. :func:`stabletrain.verify_remedies` runs it with
the trainer; see docs/remedies.md.

One job per file: ``candidates`` (what to try, for which mechanism), ``plan`` (where to start and
end, read from the run's files), ``outcome`` (one re-run measured; ranking and noise), ``report``
(:class:`RemedyReport`), ``engine`` (the loop over candidates, with a runner given by the caller).
"""

from stabletrain.debug.remedies.candidates import (
    AS_RUN,
    MECHANISM_NAMES,
    MECHANISMS,
    Candidate,
    candidate_notes,
    candidates_for,
)
from stabletrain.debug.remedies.engine import CONSOLE_FILE, RunOutput, RunRequest, StopAfter, verify
from stabletrain.debug.remedies.outcome import MIN_GAIN, Outcome, beats, noise_of_mean, rank
from stabletrain.debug.remedies.plan import (
    FINAL_WINDOW,
    SCRATCH,
    Plan,
    RemedyError,
    Trouble,
    find_trouble,
    make_plan,
)
from stabletrain.debug.remedies.report import FILE_JSON, FILE_MD, RemedyReport

__all__ = [
    "AS_RUN",
    "CONSOLE_FILE",
    "Candidate",
    "FILE_JSON",
    "FILE_MD",
    "FINAL_WINDOW",
    "MECHANISMS",
    "MECHANISM_NAMES",
    "MIN_GAIN",
    "Outcome",
    "Plan",
    "RemedyError",
    "RemedyReport",
    "RunOutput",
    "RunRequest",
    "SCRATCH",
    "StopAfter",
    "Trouble",
    "beats",
    "candidate_notes",
    "candidates_for",
    "find_trouble",
    "make_plan",
    "noise_of_mean",
    "rank",
    "verify",
]
