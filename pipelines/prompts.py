"""Every prompt, in one place.

Layout rule: a fixed instruction prefix first, then documents in a canonical order (by id),
then the variable parts, so an engine with a prefix cache (SGLang's RadixAttention) reuses
the longest possible prefix across requests and iterations.
"""

from __future__ import annotations

from collections.abc import Sequence

from telerag.pipelines.types import Document

SYSTEM = "You answer questions using the documents given. Be concise and factual."


def format_documents(documents: Sequence[Document]) -> str:
    ordered = sorted(documents, key=lambda d: d.id)
    return "\n\n".join(f"[{i + 1}] {d.title}\n{d.text}" for i, d in enumerate(ordered))


def answer(question: str, documents: Sequence[Document], draft: str = "") -> str:
    context = format_documents(documents) if documents else "(no documents)"
    tail = f"\nAnswer so far: {draft}" if draft else ""
    return f"{SYSTEM}\n\nDocuments:\n{context}\n\nQuestion: {question}{tail}\nAnswer:"


def hypothetical_passage(question: str) -> str:
    return f"Write a short encyclopedia passage that answers the question.\n\nQuestion: {question}\nPassage:"


def sub_questions(question: str, limit: int) -> str:
    return (
        f"Break the question into at most {limit} simpler questions, one per line, "
        f"that together answer it.\n\nQuestion: {question}\nSimpler questions:"
    )


def narrower_question(question: str, notes: str) -> str:
    known = f"\nWhat we know so far: {notes}" if notes else ""
    return (
        "Write one short search question for the next fact needed to answer the question."
        f"\n\nQuestion: {question}{known}\nSearch question:"
    )


def judge(question: str, answer_text: str) -> str:
    return (
        "Does the answer fully answer the question? Reply yes or no."
        f"\n\nQuestion: {question}\nAnswer: {answer_text}\nReply:"
    )


def needs_retrieval(question: str) -> str:
    return (
        "Would looking up documents help answer this question accurately? Reply yes or no."
        f"\n\nQuestion: {question}\nReply:"
    )


def critique(question: str, documents: Sequence[Document], answer_text: str) -> str:
    return (
        "Is the answer supported by the documents? Reply yes or no."
        f"\n\nDocuments:\n{format_documents(documents)}\n\nQuestion: {question}\nAnswer: {answer_text}\nReply:"
    )


def revise(question: str, documents: Sequence[Document], draft: str) -> str:
    """Self-RAG: rewrite an answer the critique found unsupported."""
    return (
        f"{SYSTEM}\n\nDocuments:\n{format_documents(documents)}\n\nQuestion: {question}\n"
        f"Draft answer: {draft}\nRewrite the answer using only facts stated in the documents.\nAnswer:"
    )


def is_yes(reply: str) -> bool:
    return reply.strip().lower().lstrip("*\"' ").startswith("yes")
