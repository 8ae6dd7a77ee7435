"""The one error the package reports as a line of its own, not a traceback: bad input."""


class UsageError(Exception):
    """Bad input (a flag, a path, the launch environment): reported as one line, never a traceback.

    Most are found identically on every rank (the same flags and checks), and one rank reports them for the
    whole job; same_on_every_rank=False marks one that only some ranks see, which each of them reports."""

    def __init__(self, message: str, same_on_every_rank: bool = True):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


class NonFiniteTraining(UsageError):
    """A NaN or inf loss, gradient norm or parameter: the job stops before that step's update or save (a resume
    would meet the same batch again), its checkpoints holding only finite models."""
