"""Every prompt, in one place.

A prompt is a fixed system text (the instruction for that kind of call) and a user turn; the
engine puts them in the model's chat template (`Engine.format_prompt`), or, for a base model
without one, writes the system text above the user turn. Layout rule: the fixed instruction
first, then documents in a canonical order (by id), then the variable parts, so an engine
with a prefix cache (SGLang's RadixAttention) reuses the longest possible prefix across
requests and iterations. The user turn ends in a cue ("Answer:"): a base model continues
after it, and an instruction-tuned one reads it as the format to reply in.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from telerag.engines.types import DocumentChunks
from telerag.pipelines.types import RetrievedPassage, Turn

SYSTEM = "You answer questions using the documents given. Be concise and factual."
ANSWER_CUE = "Answer:"


@dataclass(frozen=True)
class Prompt:
    """One LLM call's prompt: `system` is the same for every call of its kind, `user` ends in `cue`."""

    system: str
    user: str
    cue: str

    @property
    def stops(self) -> tuple[str, ...]:
        """Where a reply has run past itself: the cue again on a new line (a model that loops
        "Answer:\\nAnswer:..."), or a question of its own."""
        return (f"\n{self.cue}", "\nQuestion:")


def format_documents(documents: Sequence[RetrievedPassage]) -> str:
    ordered = sorted(documents, key=lambda d: (d.source, d.id))
    return "\n\n".join(f"[{i + 1}] {d.title}\n{d.text}" for i, d in enumerate(ordered))


DOCUMENTS_HEADING = "Documents:\n"


def _documents_block(documents: Sequence[RetrievedPassage]) -> str:
    return f"{DOCUMENTS_HEADING}{format_documents(documents) if documents else '(no documents)'}\n\n"


def document_chunks(prompt: str) -> DocumentChunks | None:
    """`prompt` (as `Engine.format_prompt` wrote it) cut around the entries of its documents
    block (`format_documents`), or None without one: how an engine with per-document KV
    (TurboRAG; the transformers engine's `split_documents`) finds them. The entries are found by
    their numbers in turn ("[1] ", then "\n\n[2] ", ...); a document whose text holds its
    successor's marker only moves a cut, never loses text."""
    start = prompt.find(f"{DOCUMENTS_HEADING}[1] ")
    if start < 0:
        return None
    head_end = start + len(DOCUMENTS_HEADING)
    cuts = [head_end]
    while (cut := prompt.find(f"\n\n[{len(cuts) + 1}] ", cuts[-1])) >= 0:
        cuts.append(cut + 2)
    tail_start = prompt.find("\n\n", cuts[-1])
    if tail_start < 0:
        return None
    cuts.append(tail_start + 2)
    chunks = tuple(prompt[a:b] for a, b in itertools.pairwise(cuts))
    return DocumentChunks(prompt[:head_end], chunks, prompt[cuts[-1] :])


def _instructions_line(instructions: str) -> str:
    """A client's own instructions (a chat's system message), after the documents: a prompt's
    shared prefix stays the fixed instruction and the documents."""
    return f"Instructions: {instructions.strip()}\n" if instructions.strip() else ""


def answer(question: str, documents: Sequence[RetrievedPassage], draft: str = "", *, instructions: str = "") -> Prompt:
    tail = f"\nAnswer so far: {draft}" if draft else ""
    user = f"{_documents_block(documents)}{_instructions_line(instructions)}Question: {question}{tail}\n{ANSWER_CUE}"
    return Prompt(SYSTEM, user, ANSWER_CUE)


TOPIC_CUE = "Topic:"


def _turns(turns: Sequence[Turn]) -> str:
    return "".join(f"{'User' if turn.role == 'user' else 'Assistant'}: {turn.text.strip()}\n" for turn in turns)


def _topic_system(examples: Sequence[tuple[Sequence[Turn], str]]) -> str:
    """The instruction to name a conversation's topic, shown on `examples` (turns, topic) laid out
    as the call's own turns are: a small model follows their shape."""
    shown = "\n\n".join(f"{_turns(turns)}{TOPIC_CUE} {topic}" for turns, topic in examples)
    return f"Name the topic of the conversation.\n\n{shown}"


TOPIC_SYSTEM = _topic_system(
    [
        (
            (Turn("user", "Tell me about the Eiffel Tower."), Turn("assistant", "It is a wrought-iron tower in Paris.")),
            "the Eiffel Tower",
        ),
        ((Turn("user", "Who was Marie Curie?"), Turn("assistant", "She was a physicist and chemist.")), "Marie Curie"),
    ]
)
QUERY_TOPIC_SYSTEM = _topic_system(
    [((Turn("user", "Who wrote Hamlet?"),), "Hamlet"), ((Turn("user", "When did the Titanic sink?"),), "the Titanic")]
)


def conversation_topic(history: Sequence[Turn]) -> Prompt:
    """What a conversation is about, which makes its follow-up question stand alone. The question
    itself is left out: a small model shown it answers it instead (Gemma 3 270M named the topic
    of 29 of the 30 shipped follow-ups this way, and rewrote 7 when asked for the question)."""
    return Prompt(TOPIC_SYSTEM, f"{_turns(history)}{TOPIC_CUE}", TOPIC_CUE)


def query_topic(query: str) -> Prompt:
    """What a search's query is about (a vector store search's `rewrite_query`): the query as a
    conversation of its one turn, shown examples of that shape whose topic is not their answer.
    Of the first 60 shipped questions, Gemma 3 270M named a topic in the question's own words for
    22 this way (the others mostly a guess at the answer), and for 6 shown the conversations'
    examples (it wrote the assistant's answer instead)."""
    return Prompt(QUERY_TOPIC_SYSTEM, f"{_turns([Turn('user', query)])}{TOPIC_CUE}", TOPIC_CUE)


def standalone(question: str, topic: str) -> str:
    """A question asked about a topic (its conversation's, for a follow-up; a search query's own):
    the question as it is without one."""
    return f"{question} ({topic})" if topic else question


def hypothetical_passage(question: str) -> Prompt:
    return Prompt("Write a short encyclopedia passage that answers the question.", f"Question: {question}\nPassage:", "Passage:")


def sub_questions(question: str, limit: int) -> Prompt:
    return Prompt(
        f"Break the question into at most {limit} simpler questions, one per line, that together answer it.",
        f"Question: {question}\nSimpler questions:",
        "Simpler questions:",
    )


SEARCH_QUESTION_CUE = "Search question:"


def narrower_question(question: str, notes: str) -> Prompt:
    known = f"\nWhat we know so far: {notes}" if notes else ""
    return Prompt(
        "Write one short search question for the next fact needed to answer the question.",
        f"Question: {question}{known}\n{SEARCH_QUESTION_CUE}",
        SEARCH_QUESTION_CUE,
    )


def judge(question: str, answer_text: str) -> Prompt:
    return Prompt(
        "Does the answer fully answer the question? Reply yes or no.",
        f"Question: {question}\nAnswer: {answer_text}\nReply:",
        "Reply:",
    )


def needs_retrieval(question: str) -> Prompt:
    return Prompt(
        "Would looking up documents help answer this question accurately? Reply yes or no.",
        f"Question: {question}\nReply:",
        "Reply:",
    )


def critique(question: str, documents: Sequence[RetrievedPassage], answer_text: str) -> Prompt:
    """Self-RAG: is the draft supported? Laid out as the draft's own prompt (`answer`, without a
    client's instructions) up to its cue, the draft after it and the instruction last, so that a
    prefix cache holds all but the draft and the instruction (as the system text, the
    instruction cost the reuse of the documents)."""
    return Prompt(
        SYSTEM,
        f"{_documents_block(documents)}Question: {question}\n{ANSWER_CUE} {answer_text}\n"
        "Is the answer supported by the documents? Reply yes or no.\nReply:",
        "Reply:",
    )


def revise(question: str, documents: Sequence[RetrievedPassage], draft: str, *, instructions: str = "") -> Prompt:
    """Self-RAG: rewrite an answer the critique found unsupported."""
    return Prompt(
        SYSTEM,
        f"{_documents_block(documents)}{_instructions_line(instructions)}Question: {question}\nDraft answer: {draft}\n"
        f"Rewrite the answer using only facts stated in the documents.\n{ANSWER_CUE}",
        ANSWER_CUE,
    )


def is_yes(reply: str) -> bool:
    return _first_word(reply) == "yes"


def is_no(reply: str) -> bool:
    return _first_word(reply) == "no"


def _first_word(reply: str) -> str:
    words = reply.strip().lower().lstrip("*\"' ").split(maxsplit=1)
    return words[0].rstrip(".,!:;*\"'") if words else ""


def holds_answer_cue(answer: str) -> bool:
    """An answer that still holds the answer cue: a reply that looped on it past what the
    stops and `clean_reply` cut (what the benchmarks count: none should)."""
    return ANSWER_CUE in answer
