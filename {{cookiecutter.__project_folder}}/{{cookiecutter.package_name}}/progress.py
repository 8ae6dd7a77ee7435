"""Where training stands, in optimizer steps and samples: what a resumed run needs besides the weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingProgress:
    """Where training stands: what a resumed run needs besides weights and optimizer state."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0
    samples_in_epoch: int = 0  # global samples (all ranks) of this epoch already trained on

    def advance(self, global_batch_size: int) -> None:
        self.step += 1
        self.samples_in_epoch += global_batch_size

    def finished(self, epochs: int, max_steps: int | None) -> bool:
        return self.epoch >= epochs or (max_steps is not None and self.step >= max_steps)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.samples_in_epoch = 0
