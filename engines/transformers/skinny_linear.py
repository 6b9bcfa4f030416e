"""Linear layers laid out for decoding on a CPU, where each step multiplies every weight matrix by
only a few rows (see `SkinnyLinear`); the transformers engine installs them on the CPU."""

from __future__ import annotations

import torch

SKINNY_ROWS = 128  # up to this many rows, a CPU matmul is faster as (W @ x.T).T


class SkinnyLinear(torch.nn.Linear):
    """nn.Linear that computes an input of few rows (a decode step has one per sequence) as
    (W @ x.T).T: the same result up to float rounding, but MKL's GEMM is several times faster in
    that orientation when one side is thin, which matters most for a large vocabulary's output
    layer. Past a few hundred rows (a long prefill) the two orientations are even, so larger
    inputs take the plain path. `telerag bench generate` measures what it is worth against plain
    transformers on the machine at hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > SKINNY_ROWS:
            return super().forward(x)
        out = torch.mm(self.weight, x.reshape(rows, self.in_features).T).T.contiguous()  # as `linear` gives it
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_skinny_matmuls(model: torch.nn.Module) -> None:
    """Make the model's plain Linear layers `SkinnyLinear`s (in place; the weights stay)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
