"""The learner errors a user can act on, importable without torch: each is a :class:`LearnerRefused`,
which the command line prints in one line (``cli/main.py``) and exits 2.

:class:`NonFiniteStep`: a step whose loss, gradients or new weights are not finite is refused, not
skipped; nothing of it is published or checkpointed, so the newest checkpoint and every published
version stay finite. :class:`CheckpointRefused`: a checkpoint this run's settings cannot resume (a
full-weight checkpoint resumed as a LoRA run, or the reverse, ``learn/lora.py``), naming the setting;
:class:`AdapterRefused`: LoRA targets the model has no layer of. :class:`TooFewDevices`: more data-parallel ranks
than GPUs. :class:`DataTimeoutError`: no rows for ``learner.data_timeout_s``; :class:`NoRowsToReplay`: an empty epoch.
Design: docs/learner.md#a-step-that-is-not-finite.
"""

from __future__ import annotations


class LearnerRefused(Exception):
    """The learner stopped for a cause its message names, with what to do: no traceback is needed."""


class NonFiniteStep(LearnerRefused, RuntimeError):
    """A step refused because ``what`` was not finite (``"its loss is nan"``, a parameter's
    gradient, the weights after the optimizer step). ``learn/step.py`` raises it without the step;
    the learner raises it again with the step and its newest checkpoint (:meth:`at`), the line a
    user reads."""

    def __init__(self, what: str, *, step: int | None = None, checkpoint_step: int | None = None) -> None:
        self.what = what
        self.step = step
        self.checkpoint_step = checkpoint_step
        super().__init__(self._line())

    def at(self, step: int, checkpoint_step: int | None) -> NonFiniteStep:
        """This refusal, as learner step ``step`` of a run whose newest checkpoint is ``checkpoint_step``."""
        return NonFiniteStep(self.what, step=step, checkpoint_step=checkpoint_step)

    def _line(self) -> str:
        if self.step is None:
            return f"a learner step was refused: {self.what}"
        resume = (f"the checkpoint of step {self.checkpoint_step}" if self.checkpoint_step is not None
                  else "the initial policy (no checkpoint yet)")
        return (f"learner step {self.step} refused: {self.what}; nothing of it was published or checkpointed. Fix "
                f"the cause (often a learning rate too high for the model: lower learner.lr, or clip gradients with "
                f"learner.max_grad_norm) and run the same command: it resumes from {resume}")


class CheckpointRefused(LearnerRefused, ValueError):
    """The run's checkpoint cannot be resumed with this run's settings; the message names the setting
    and the value that resumes it."""


class AdapterRefused(LearnerRefused, ValueError):
    """A LoRA run's ``learner.lora.target_modules`` name a layer the model does not have; the message
    lists the ones it has."""


class TooFewDevices(LearnerRefused, ValueError):
    """A data-parallel rank whose GPU (``cuda:LOCAL_RANK``) this machine does not have; the message names
    ``learner.world_size`` and the GPUs there are."""


class DataTimeoutError(LearnerRefused, RuntimeError):
    """The buffer held too few usable rows for longer than the learner's data timeout."""


class NoRowsToReplay(LearnerRefused, ValueError):
    """An epoch sampler over a buffer that holds no rows."""
