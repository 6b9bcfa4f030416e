"""The output layer of a greedy step, screened in bfloat16 and rescored in float32.

On a CPU the float32 output layer of a large vocabulary is a decode step's largest matmul (Gemma
3's 262,144 x 640: 104-135 ms for 8 rows on this project's 2-core AMX box, against a 154-200-ms
rest of the step). A greedy row needs only the argmax, so `GreedyScreen` scores every token in
bfloat16 (AMX) and rescores in float32 only the tokens whose bfloat16 score is within a proven
bound of the best (both factors' rounding to bfloat16, the result's, and float32 accumulation,
by Cauchy-Schwarz with the largest weight row's norm): the float32 argmax is always among them.
The screened head took 35 ms for those 8 rows. The rescored scores round as a smaller matmul
does, equal to the full layer's up to float rounding (as `SkinnyLinear`'s are to plain
transformers'), so where two tokens tie within that rounding either may be chosen. Rows that
sample or ask for log-probabilities need the whole distribution and get the whole layer.
"""

from __future__ import annotations

from typing import Any

import torch

BF16_ROUNDING = 2.0**-9  # unit roundoff of bfloat16 (8 significant bits)
FP32_ROUNDING = 2.0**-24
SCREENED_VOCAB = 32768  # below this many tokens the output layer is cheap enough whole


class GreedyScreen:
    """Logits of a batch's last positions from the output layer's float32 `weight` (vocab x
    hidden), with the rows in `screened` left at -inf except the tokens that may be their argmax."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # shared with the model, float32
        self.screen = weight.to(torch.bfloat16)
        self.max_norm = float(weight.norm(dim=1).max())
        # |bf16 score - fp32 score| <= bound * |w_i| * |h|: each product's two factors rounded to
        # bfloat16, the bfloat16 result rounded once more, and float32 accumulation over
        # `hidden` terms in either score (gamma_n = n u / (1 - n u))
        n_u = weight.shape[1] * FP32_ROUNDING
        self.bound = 3 * BF16_ROUNDING + BF16_ROUNDING**2 + 2 * n_u / (1 - n_u)

    def logits(self, hidden: torch.Tensor, screened: torch.Tensor) -> torch.Tensor:
        """`hidden`: (rows, hidden) float32; `screened`: (rows,) bool."""
        out = torch.empty((hidden.shape[0], self.weight.shape[0]), dtype=torch.float32, device=hidden.device)
        whole = ~screened
        if bool(whole.any()):
            out[whole] = torch.mm(self.weight, hidden[whole].T).T  # as `SkinnyLinear` computes it
        if bool(screened.any()):
            h = hidden[screened]
            scores = torch.mm(self.screen, h.to(torch.bfloat16).T).T.float()
            # one slack a row (the largest weight row's): two passes over the scores, not five
            slack = self.bound * self.max_norm * h.norm(dim=1)
            floor = scores.max(dim=1).values - 2 * slack
            for i, row in enumerate(torch.nonzero(screened).flatten().tolist()):
                candidates = torch.nonzero(scores[i] >= floor[i]).flatten()
                out[row] = float("-inf")
                out[row, candidates] = torch.mv(self.weight[candidates], h[i])
        return out


def greedy_screen_for(model: torch.nn.Module, device: torch.device) -> GreedyScreen | None:
    """A screen for `model`'s output layer where it pays and is sound: on a CPU with AMX (fast
    bfloat16), a float32 layer of a large vocabulary, and a model whose logits are its decoder's
    last hidden state times that layer with nothing after it (checked on a probe at load, so a
    model that soft-caps its logits, as Gemma 2 does, gets none); else None."""
    from telerag.engines.transformers.checkpoints import cpu_has_amx

    hf: Any = model  # a transformers model: its output layer and decoder
    head = hf.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if device.type != "cpu" or not cpu_has_amx() or weight is None or weight.dtype != torch.float32:
        return None
    if weight.shape[0] < SCREENED_VOCAB or getattr(head, "bias", None) is not None:
        return None
    probe = torch.arange(1, 9, device=device)[None]
    with torch.inference_mode():
        logits = model(input_ids=probe, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        hidden = hf.get_decoder()(input_ids=probe, use_cache=False).last_hidden_state[0, -1]
        ours = torch.mv(weight, hidden)
    if not torch.allclose(ours, logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max())):
        return None
    return GreedyScreen(weight.detach())
