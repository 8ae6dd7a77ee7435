"""Mixed precision: autocast for the forward pass, and the gradient scaler fp16 needs around the update."""

from __future__ import annotations

import contextlib

import torch

from .errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto: bf16 where the GPU computes it natively (Ampere and newer), else fp32."""
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(f"--precision bf16 but {torch.cuda.get_device_name(device)} has no bf16; use fp16")
        return requested
    if device.type == "cuda" and computes_bf16_natively(device):
        return "bf16"
    return "fp32"  # CPU autocast is correct but rarely faster, so it is opt-in there


def computes_bf16_natively(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) and newer, or ROCm. Not torch.cuda.is_bf16_supported(): by default it
    also counts emulation, which V100s and T4s have, and there bf16 is slower than fp32."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


class MixedPrecision:
    """Parameters, gradients and optimizer state stay fp32; autocast runs matmuls and convolutions in the
    lower precision. fp16's narrow range needs the loss scaled up before backward and the gradients
    unscaled before clipping and stepping (GradScaler); bf16 has fp32's range and needs no scaler."""

    def __init__(self, precision: str, device: torch.device):
        self.precision = precision
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """What FSDP2 all-gathers parameters in for compute (its shards stay fp32); None: unchanged."""
        return None if self.precision == "fp32" else DTYPES[self.precision]

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around training and evaluation forwards alike."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, clip_grad: float | None) -> None:
        """Clip (on true, unscaled gradients) and step; fp16 skips steps whose gradients overflowed."""
        if clip_grad is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()  # empty unless fp16

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)
