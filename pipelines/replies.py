"""A model's reply to one of our prompts, as the user gets it.

A small model often restates the prompt's cue before replying ("Answer: Paris") or loops on it
("Answer:\\nAnswer:\\nAnswer:..."). The reply is the text after any leading cues and before
the cue comes again, without surrounding whitespace. `ReplyStream` applies that to a streamed
generation and releases only text that is sure to stay, so what a client is streamed equals
the final reply exactly.
"""

from __future__ import annotations


class ReplyStream:
    """The reply to a prompt ending in `cue`, built from streamed pieces of the generation."""

    def __init__(self, cue: str) -> None:
        self.cue = cue
        self.generated = ""
        self.text = ""  # the part of the reply released so far (all of it once `finish`ed)
        self.complete = False  # the cue came again: the reply is over, whatever follows

    def push(self, piece: str) -> str:
        """Add generated text; returns the new part of the reply that is safe to release."""
        if self.complete or not piece:
            return ""
        self.generated += piece
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: release what was held back (never trailing whitespace)."""
        return "" if self.complete else self._release(final=True)

    def _release(self, *, final: bool) -> str:
        reply, self.complete = self._reply(final)
        piece = reply[len(self.text) :]
        self.text = reply
        return piece

    def _reply(self, final: bool) -> tuple[str, bool]:
        """(the reply so far, whether it is complete). Before the end, text that might yet turn
        out to be a cue or trailing whitespace is held back, so each answer extends the last."""
        body = self.generated.lstrip()
        while body.startswith(self.cue):
            body = body[len(self.cue) :].lstrip()
        if not final and self.cue.startswith(body):
            return "", False  # nothing yet, or the start of another cue
        end = body.find(self.cue)
        if end >= 0:
            return body[:end].rstrip(), True
        if not final:
            body = body[: len(body) - _cue_prefix_at_end(body, self.cue)]
        return body.rstrip(), False


def _cue_prefix_at_end(text: str, cue: str) -> int:
    """Length of the longest end of `text` that the cue starts with (the cue may be arriving)."""
    return next((n for n in range(min(len(cue) - 1, len(text)), 0, -1) if text.endswith(cue[:n])), 0)


def clean_reply(generated: str, cue: str) -> str:
    """The reply in a whole generation (see `ReplyStream`)."""
    reply = ReplyStream(cue)
    reply.push(generated)
    reply.finish()
    return reply.text
