"""The network: any torchvision classification model by name, or small_cnn; randomly initialised."""

from __future__ import annotations

import difflib

import torch
import torchvision
from torch import nn

from .errors import UsageError

SMALL_CNN = "small_cnn"


def classification_model_names() -> list[str]:
    # module=torchvision.models lists classifiers only (not detection, segmentation or video models).
    return [SMALL_CNN, *torchvision.models.list_models(module=torchvision.models)]


def check_model_name(name: str) -> None:
    names = classification_model_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
        raise UsageError(f"--model {name!r} is not a torchvision classification model; {hint}")


def build_model(name: str, num_classes: int) -> torch.nn.Module:
    """Replace this with your own network; train.py only needs images in, logits out."""
    if name == SMALL_CNN:
        return small_cnn(num_classes)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def small_cnn(num_classes: int, width: int = 32) -> nn.Module:
    """Three conv blocks and a linear head, quick on a CPU. GroupNorm, not BatchNorm, and no dropout: a
    sample's gradient does not depend on the rest of its batch, so a larger batch and the same samples in
    accumulated micro-batches give the same update."""
    def block(channels_in: int, channels_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.GroupNorm(8, channels_out),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2))
    # Pooling to 2x2, not 1x1, keeps where in the image a feature was.
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width * 4, num_classes))
