"""Which torch device a setting names: the one resolution every layer uses. Each caller names the
error that a device it cannot have is, in its own terms (the retrieval engine's
`DeviceUnavailable`, the LLM engine's `EngineUnavailable`, the embedder's `EmbedderError`), so
"CUDA missing" reads the same everywhere and is still the error of the part that asked."""

from __future__ import annotations

import torch


def resolve_device(name: str | torch.device, *, error: type[Exception]) -> torch.device:
    """`auto` picks CUDA when there is one; naming a device torch does not know, or CUDA without
    one, raises `error`."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise error(f"unknown device {str(name)!r}: auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise error(f"device {str(name)!r} asked for, but CUDA is not available here (use auto or cpu)")
    return device
