"""The best checkpoint and early stopping (--keep-best METRIC:min|max, --early-stop-patience N): judged by rank
0 after each epoch's evaluation and sent to every rank, saved and restored with the checkpoint."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.folder import BEST_RECORD, every_checkpoint, write_json
from .distributed import DistEnv
from .errors import UsageError
from .flags import option

log = logging.getLogger(__name__)


@dataclass
class SelectionOptions:
    """The best checkpoint by an evaluation metric, and early stopping."""

    keep_best: str | None = option(
        None, "METRIC:min or METRIC:max (loss:min, accuracy:max: a metric the evaluation reports): after each "
        "evaluation that closes an epoch (--eval-every) or an interval (--eval-every-steps) and beats every one "
        "before, save a checkpoint, which retention never deletes; CKPT_DIR/best.json names it (one at the run's end "
        "or at --stop-at-step in mid-interval is logged, not judged)"
{%- if cookiecutter.use_export == "yes" %}
        " and `export --best CKPT_DIR` writes it"
{%- endif %})
    early_stop_patience: int | None = option(
        None, "with --keep-best: end training after this many evaluations in a row without a better metric "
        "(decided by rank 0 for every rank; a resumed job goes on counting)")


class ModelSelection:
    """Which evaluation was the best so far, and how many came after it without beating it. A checkpoint
    component (state_dict/load_state_dict), registered whether or not the flags are given, so that they can be
    added or dropped on resume: a job killed mid-patience goes on counting. Its kept_step is a checkpoint
    retention never deletes; CKPT_DIR/best.json names it{% if cookiecutter.use_export == "yes" %} for export --best{% endif %}."""

    def __init__(self, options: SelectionOptions, ckpt_dir: str, env: DistEnv):
        self.metric, _, mode = (options.keep_best or "").rpartition(":")
        self.mode = mode or "min"  # "min" or "max"
        self.patience = options.early_stop_patience
        self.ckpt_dir = Path(ckpt_dir)
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

    def check_metric(self, results: dict) -> None:
        """On the one-batch evaluation before training: the metric exists and is one number."""
        if self.enabled:
            self.value_of(results)

    def value_of(self, results: dict) -> float:
        value = results.get(self.metric)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UsageError(f"--keep-best {self.metric}:{self.mode}: the evaluation reports "
                             + (f"no {self.metric}; it reports {', '.join(sorted(results))}" if value is None else
                                f"{self.metric} as {type(value).__name__}, not one number")) from None

    def judge(self, results: dict, step: int, decided_by_rank_0: Callable[[list[float]], list[float]]) -> bool:
        """After the evaluation at `step`: whether it beats every one before, so that this step's checkpoint is
        saved now and kept. Rank 0 judges and sends its verdict and value to every rank (decided_by_rank_0: the
        stop agreement's), so that every rank enters that save, a collective, and holds the same state: a
        metric a bit apart on one rank cannot split the job."""
        if not self.enabled:
            return False
        value = self.value_of(results)
        better = not math.isnan(value) and (self.best_value is None or (
            value > self.best_value if self.mode == "max" else value < self.best_value))
        better, value = decided_by_rank_0([float(better), value])
        if better:
            self.best_value, self.best_step, self.evaluations_since_best = value, step, 0
            log.info("step %d: the best %s so far (%g); its checkpoint is kept", step, self.metric, value)
        else:
            self.evaluations_since_best += 1
        return bool(better)

    def out_of_patience(self) -> bool:
        """--early-stop-patience evaluations in a row have not beaten the best: the same on every rank, from
        the state judge() kept alike on all of them (or a checkpoint restored on all)."""
        if self.patience is None or self.evaluations_since_best < self.patience:
            return False
        best = (f"than {self.best_value:g} (step {self.best_step}); the best checkpoint is kept"
{%- if cookiecutter.use_export == "yes" %}
                " (export it with --best)"
{%- endif %}
                if self.best_step is not None else "(none was a number)")
        log.info("early stop: %d evaluations without a better %s %s", self.evaluations_since_best, self.metric, best)
        return True

    def write_record(self) -> None:
        """best.json, on rank 0: which step's checkpoint is the best (after that checkpoint was saved)."""
        if self.env.rank == 0 and self.best_step is not None:
            write_json(self.ckpt_dir / BEST_RECORD, {"step": self.best_step, "metric": self.metric,
                                                      "mode": self.mode, "value": self.best_value})

    def state_dict(self) -> dict:
        # Numbers and strings only (no None), as every checkpoint format takes them: step -1 before a best.
        return {"metric": self.metric, "mode": self.mode,
                "best_value": self.best_value if self.best_value is not None else 0.0,
                "best_step": self.best_step if self.best_step is not None else -1,
                "evaluations_since_best": self.evaluations_since_best}

    def load_state_dict(self, state: dict) -> None:
        if (state["metric"], state["mode"]) != (self.metric, self.mode):
            if state["metric"] and self.metric:
                log.info("--keep-best %s:%s -> %s:%s: the best so far and the patience count start over",
                         state["metric"], state["mode"], self.metric, self.mode)
            return  # another metric (or none): nothing saved applies
        judged = state["best_step"] >= 0
        self.best_value = float(state["best_value"]) if judged else None
        self.best_step = int(state["best_step"]) if judged else None
        self.evaluations_since_best = int(state["evaluations_since_best"])
        if self.env.rank == 0 and judged:
            if not any(step == self.best_step for step, _ in every_checkpoint(self.ckpt_dir)):
                log.warning("the best checkpoint so far (step %d, %s %g) is no longer in %s; a better evaluation "
                            "will be kept", self.best_step, self.metric, self.best_value, self.ckpt_dir)
            self.write_record()  # a kill between a best save and its record left an older one
