"""The LLM engines, behind `types.Engine` (the contract with their callers; their errors are
`errors`'): `transformers.TransformersEngine` (any local causal LM on the CPU or a GPU; the
embedded default) and `sglang.SGLangEngine` (production on a GPU). They know nothing of the
pipelines above them. Import each from its module; they load heavy libraries. This module holds
what both share: chat formatting, the prompt's token ids and stop-string handling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError


def format_chat(tokenizer: Any, user_text: str, system: str = "") -> str:
    """`system` and `user_text` in the tokenizer's chat template, ready for the model's reply.

    A template without a system role (Mistral's, Gemma 2's refuse one) gets the system text at
    the top of the user turn, as Gemma 3's template does itself. Without a template (a base
    model, such as the embedded Gemma 3 270M) the system text is written above the user text,
    as a plain completion prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return f"{system}\n\n{user_text}" if system else user_text
    user = {"role": "user", "content": user_text}
    if system:
        try:
            return _apply_chat_template(tokenizer, [{"role": "system", "content": system}, user])
        except TemplateError:
            user = {"role": "user", "content": f"{system}\n\n{user_text}"}
    return _apply_chat_template(tokenizer, [user])


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def end_of_turn(tokenizer: Any) -> str | None:
    """The marker the chat template closes the model's turn with (Gemma's `<end_of_turn>`,
    ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`): an instruction-tuned model emits it when
    its reply is done, so generation stops there. None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    reply = "\x00reply\x00"  # a text no template writes
    turns = [{"role": "user", "content": "?"}, {"role": "assistant", "content": reply}]
    try:
        rendered = tokenizer.apply_chat_template(turns, tokenize=False)
    except TemplateError:
        return None
    after = rendered.partition(reply)[2].split()
    return after[0] if after else None


def prompt_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The ids a model is given for `prompt` (a `format_chat` result): for a chat prompt exactly
    `apply_chat_template(..., tokenize=True)`'s ids (the template writes BOS into the text, so no
    special token is added again); for a plain prompt its text after the model's BOS, where the
    model has one. Never two BOS tokens."""
    bos = getattr(tokenizer, "bos_token", None)
    text = prompt if not bos or prompt.startswith(bos) else bos + prompt
    return tokenizer.encode(text, add_special_tokens=False)


class StopFilter:
    """A streamed text cut at its first stop string. A tail that could still grow into a stop
    string is held back until it is decided, so everything released is a prefix of the final
    text: a client never sees text that is later taken back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # everything seen, cut at the stop once one is found
        self.released = 0  # len of the prefix of `text` already handed out
        self.stopped = False

    def push(self, piece: str) -> str:
        """Add newly generated text; returns the part that is safe to release now. After a
        stop string appears, `stopped` is True and nothing more is taken."""
        if self.stopped or not piece:
            return ""
        self.text += piece
        # A stop can only begin in the unreleased part: anything earlier was checked already.
        hits = [at for at in (self.text.find(s, self.released) for s in self.stops) if at >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def finish(self, matched: str | None = None) -> str:
        """The text still to release at the end. `matched` is a stop string the engine itself
        found and trimmed (SGLang does): the held tail where it begins is dropped."""
        if matched and not self.stopped:
            start = next(
                (at for at in range(self.released, len(self.text) + 1) if matched.startswith(self.text[at:])),
                len(self.text),
            )
            self.text = self.text[:start]
            self.stopped = True
        return self._release(len(self.text))

    @property
    def final(self) -> str:
        """The text released so far (all of it, after `finish`)."""
        return self.text[: self.released]

    def _held(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        unreleased = len(self.text) - self.released
        return max(
            (n for s in self.stops for n in range(min(len(s) - 1, unreleased), 0, -1) if self.text.endswith(s[:n])),
            default=0,
        )

    def _release(self, end: int) -> str:
        piece = self.text[self.released : end]
        self.released = max(self.released, end)
        return piece
