"""A reply as the user gets it: restated and repeated cues cut, and streamed pieces that add up
to exactly the final reply however the generation is split into tokens."""

from __future__ import annotations

import pytest

from telerag.pipelines.replies import ReplyStream, clean_reply

CASES = [
    ("Answer:\nAnswer:\nAnswer:\nAnswer:", ""),  # the loop the embedded default once fell into
    (" Answer: Leonardo da Vinci\nAnswer: Leonardo", "Leonardo da Vinci"),
    ("Answer: Paris Answer: Paris Answer:", "Paris"),
    (" Jupiter is the largest planet. ", "Jupiter is the largest planet."),
    ("\n\nAnswer:  Eris", "Eris"),
    ("An answer: yes, Ansel Adams", "An answer: yes, Ansel Adams"),  # what merely starts like the cue stays
    ("Answ", "Answ"),  # an unfinished cue at the very end is text
    ("", ""),
]


@pytest.mark.parametrize(("generated", "reply"), CASES)
def test_the_reply_drops_restated_cues_and_ends_where_the_cue_comes_again(generated, reply):
    assert clean_reply(generated, "Answer:") == reply


@pytest.mark.parametrize(("generated", "reply"), CASES)
def test_streamed_pieces_add_up_to_the_reply_however_the_text_is_split(generated, reply):
    """Released text is never taken back: for every split into single characters and into
    every pair of pieces, the concatenation of what is released equals the reply."""
    splits = [list(generated)] + [[generated[:i], generated[i:]] for i in range(len(generated) + 1)]
    for pieces in splits:
        stream = ReplyStream("Answer:")
        released = "".join(stream.push(piece) for piece in pieces) + stream.finish()
        assert released == reply == stream.text, pieces


def test_the_reply_is_complete_once_the_cue_comes_again():
    stream = ReplyStream("Answer:")
    assert stream.push("Answer:") == ""
    assert stream.push(" Paris") == "Paris" and not stream.complete
    assert stream.push(" is the capital\nAnswer") == " is the capital"  # "\nAnswer" may be the cue coming
    assert not stream.complete
    assert stream.push(":") == "" and stream.complete
    assert stream.push(" more") == "" and stream.finish() == "" and stream.text == "Paris is the capital"
