"""Which torch device a setting names: the one resolution every layer uses, so "CUDA missing"
is one typed error wherever a device is asked for (retrieval, embedder, engine)."""

from __future__ import annotations

import torch

from telerag.retrieval.errors import DeviceUnavailable


def resolve_device(name: str | torch.device) -> torch.device:
    """`auto` picks CUDA when there is one; naming a device torch does not know, or CUDA without
    one, is `DeviceUnavailable`."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceUnavailable(f"unknown device {str(name)!r}: auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {str(name)!r} asked for, but CUDA is not available here (use auto or cpu)")
    return device
