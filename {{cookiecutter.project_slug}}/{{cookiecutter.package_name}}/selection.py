"""The best checkpoint and early stopping (--keep-best METRIC:min|max, --early-stop-patience N): judged after
each epoch's evaluation from the metrics every rank holds alike, saved and restored with the checkpoint."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from .checkpoint.folder import BEST_RECORD, write_json
from .distributed import DistEnv
from .errors import UsageError
from .options import TrainOptions

log = logging.getLogger(__name__)


class ModelSelection:
    """Which evaluation was the best so far, and how many came after it without beating it. A checkpoint
    component (state_dict/load_state_dict): a job killed mid-patience resumes counting where it was. Its
    kept_step is a checkpoint retention never deletes; CKPT_DIR/best.json names it for export --best."""

    def __init__(self, options: TrainOptions, env: DistEnv):
        self.metric, _, mode = (options.keep_best or "").partition(":")
        self.maximize = mode == "max"
        self.patience = options.early_stop_patience
        self.record = Path(options.ckpt_dir) / BEST_RECORD
        self.env = env
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.evaluations_since_best = 0

    @property
    def enabled(self) -> bool:
        return bool(self.metric)

    @property
    def kept_step(self) -> int | None:
        """The best evaluation's step, whose checkpoint retention keeps."""
        return self.best_step

    def is_new_best(self, results: dict, step: int) -> bool:
        """After an evaluation at `step`: whether it beats every one before (save this step's checkpoint)."""
        if not self.enabled:
            return False
        if self.metric not in results:
            raise UsageError(f"--keep-best {self.metric}:{'max' if self.maximize else 'min'}: the evaluation "
                             f"reports no {self.metric}; it reports {', '.join(sorted(results))}")
        value = float(results[self.metric])
        better = not math.isnan(value) and (self.best_value is None or (
            value > self.best_value if self.maximize else value < self.best_value))
        if better:
            self.best_value, self.best_step, self.evaluations_since_best = value, step, 0
            log.info("step %d: the best %s so far (%g); its checkpoint is kept", step, self.metric, value)
        else:
            self.evaluations_since_best += 1
        return better

    def out_of_patience(self) -> bool:
        """--early-stop-patience evaluations in a row have not beaten the best."""
        return self.patience is not None and self.evaluations_since_best >= self.patience

    def stops_training(self, decided_by_rank_0) -> bool:
        """Whether to end training now: rank 0's judgement, sent to every rank (decided_by_rank_0: the stop
        agreement's), so that no rank goes on to a collective the others never reach."""
        if self.patience is None:  # the same on every rank: no collective to agree on
            return False
        stop = decided_by_rank_0(self.out_of_patience())
        if stop:
            log.info("early stop: %d evaluations without a better %s than %g (step %d); the best checkpoint "
                     "is kept (export it with --best)", self.evaluations_since_best, self.metric,
                     self.best_value, self.best_step)
        return stop

    def write_record(self) -> None:
        """best.json, on rank 0: which step's checkpoint is the best (after that checkpoint was saved)."""
        if self.env.rank == 0 and self.best_step is not None:
            write_json(self.record, {"step": self.best_step, "metric": self.metric,
                                     "mode": "max" if self.maximize else "min", "value": self.best_value})

    def state_dict(self) -> dict:
        # Numbers only (no None), as every checkpoint format takes them: step -1 before the first evaluation.
        return {"best_value": self.best_value if self.best_value is not None else 0.0,
                "best_step": self.best_step if self.best_step is not None else -1,
                "evaluations_since_best": self.evaluations_since_best}

    def load_state_dict(self, state: dict) -> None:
        judged = state["best_step"] >= 0
        self.best_value = float(state["best_value"]) if judged else None
        self.best_step = int(state["best_step"]) if judged else None
        self.evaluations_since_best = int(state["evaluations_since_best"])
        self.write_record()  # a kill between a best save and its record left an older one
