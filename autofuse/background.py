"""The public names of `on_miss="tune"` (``autofuse.background.BackgroundTune`` in the manual), kept where users
import them from; the code is `autofuse.deploy.background` (starting a job) and `autofuse.tuning.background_entry`
(the job's process)."""
from __future__ import annotations

from .deploy.background import NO_BACKGROUND_ENV, BackgroundTune, NotQueued, TuningJob, queue

__all__ = ["NO_BACKGROUND_ENV", "BackgroundTune", "NotQueued", "TuningJob", "queue"]
