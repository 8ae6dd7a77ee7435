"""The network: any torchvision classification model, by name, randomly initialised."""

from __future__ import annotations

import difflib

import torch
import torchvision

from .errors import UsageError


def classification_model_names() -> list[str]:
    # module=torchvision.models lists classifiers only (not detection, segmentation or video models).
    return torchvision.models.list_models(module=torchvision.models)


def check_model_name(name: str) -> None:
    names = classification_model_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
        raise UsageError(f"--model {name!r} is not a torchvision classification model; {hint}")


def build_model(name: str, num_classes: int) -> torch.nn.Module:
    """Replace this with your own network; train.py only needs images in, logits out."""
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
