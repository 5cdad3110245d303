"""A long document followed by a question: the document is reduced, the question is kept exactly as written.

The question is a suffix of the prompt: ``model(ids, question_length=q)`` / ``generate(..., question_length=q)``
keep each row's last ``q`` real tokens out of every anchor's reach (never removed, never merged into, at their own
positions).  This module builds such prompts from text, with or without the tokenizer's chat template
(:func:`encode_document_question`), and teaches transformers' ``pipeline("text-generation")`` a ``question=``
argument (``pipe(document, question=...)``, the split kvpress users know), installed by :func:`hf_tokred.install`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import BatchEncoding

__all__ = ["encode_document_question", "pipeline_forward", "pipeline_preprocess"]


def _texts(name: str, value: Any) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"{name} must be a string or a non-empty list of strings, got {type(value).__name__}")
    return list(texts)


def _chat_ids(tokenizer, messages: list[dict], question: str) -> tuple[list[int], int]:
    """The chat template's tokens for ``messages`` (the question ends the last user message) and how many of them,
    from the first that overlaps the question's characters to the end (the template's assistant header
    included), are the question."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    start = text.rfind(messages[-1]["content"])
    if start < 0:
        raise ValueError("the chat template does not reproduce the last message's text, so the question cannot be "
                         "located in it; build the prompt yourself and pass question_length=")
    start += len(messages[-1]["content"]) - len(question)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    first = next((i for i, (_, end) in enumerate(offsets) if end > start), len(ids))
    return ids, len(ids) - first


def encode_document_question(tokenizer, document: str | Sequence[str], question: str | Sequence[str], *,
                             chat: bool = False, system: str | None = None,
                             return_tensors: str = "pt") -> BatchEncoding:
    """``input_ids``, ``attention_mask`` (left-padded for a batch) and ``question_length`` of document + question.

    Without ``chat`` the document is tokenized as a prompt (with the tokenizer's special tokens) and the question
    separately (without them), and the two are concatenated, so the question's tokens are exactly its own.  With
    ``chat`` one user message holds document + question (after an optional ``system`` message) and the chat
    template is applied; the question then runs from its first token to the end of the template (the assistant
    header included; a token straddling the boundary counts as the question's).  Pass the result to the model:
    ``model.generate(**enc, max_new_tokens=...)``.
    """
    docs, questions = _texts("document", document), _texts("question", question)
    if len(questions) == 1 and len(docs) > 1:
        questions = questions * len(docs)
    if len(questions) != len(docs):
        raise ValueError(f"got {len(docs)} documents and {len(questions)} questions; give one question, or one per "
                         "document")
    rows, lengths = [], []
    for doc, q in zip(docs, questions):
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": doc + q}]
            ids, n_question = _chat_ids(tokenizer, messages, q)
        else:
            q_ids = tokenizer(q, add_special_tokens=False)["input_ids"]
            ids, n_question = tokenizer(doc)["input_ids"] + q_ids, len(q_ids)
        rows.append({"input_ids": ids})
        lengths.append(n_question)
    if len(rows) > 1 and tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token, so a batch cannot be padded; set tokenizer.pad_token "
                         "(e.g. to tokenizer.eos_token) or encode one document at a time")
    enc = tokenizer.pad(rows, padding=True, padding_side="left", return_tensors=return_tensors)
    enc["question_length"] = torch.tensor(lengths) if return_tensors == "pt" else lengths
    return enc


def _reduces(model) -> bool:
    return hasattr(type(model).generate, "_hf_tokred_original")


def pipeline_preprocess(original):
    """``TextGenerationPipeline.preprocess`` with ``question=``: the prompt becomes document + question (its
    ``prompt_text`` too, so ``return_full_text`` shows both) and carries the question's length."""

    @functools.wraps(original)
    def preprocess(self, prompt_text, *args, question=None, **kwargs):
        if question is None:
            return original(self, prompt_text, *args, **kwargs)
        if not isinstance(question, str):
            raise TypeError(f"question must be a string, got {type(question).__name__}")
        messages = getattr(prompt_text, "messages", None)
        if messages is not None:  # a chat: the question ends its last message
            if messages[-1].get("role") != "user":
                raise ValueError("with a chat, question= is appended to the last message, which must be the user's")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + question}]
            ids, n_question = _chat_ids(self.tokenizer, messages, question)
            prompt = type(prompt_text)(messages)
            enc = BatchEncoding({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                                               dtype=torch.long)})
        else:
            enc = encode_document_question(self.tokenizer, prompt_text, question)
            prompt, n_question = prompt_text + question, int(enc.pop("question_length")[0])
        enc["prompt_text"] = prompt
        enc["question_length"] = torch.tensor([n_question])
        return enc

    preprocess._hf_tokred_original = original
    return preprocess


def pipeline_forward(original):
    """``TextGenerationPipeline._forward``: the question's length goes to ``generate`` (a model hf_tokred does not
    reduce just sees document + question)."""

    @functools.wraps(original)
    def forward(self, model_inputs, **generate_kwargs):
        generate_kwargs.pop("question", None)
        question_length = model_inputs.pop("question_length", None)
        if question_length is not None and _reduces(self.model):
            generate_kwargs["question_length"] = question_length
        return original(self, model_inputs, **generate_kwargs)

    forward._hf_tokred_original = original
    return forward
