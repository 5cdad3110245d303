"""Python hooks referenced by the generated lm-eval task YAMLs (``!function hf_tokred.evaluation.tasks.helpers.X``).

The HellaSwag and WinoGrande functions are re-exported from the installed lm-eval
(``lm_eval.tasks.hellaswag.utils``, ``lm_eval.tasks.winogrande.preprocess_winogrande``).  The held-out BoolQ functions implement this project's perplexity tasks (see ``tasks/__init__.py``).
"""

from __future__ import annotations

import contextlib
import re

from ..data import is_heldout

# ----------------------------------------------------------------------------- HellaSwag / WinoGrande
# lm-eval's own prompt functions, imported from the installed lm-eval (not copied), so the prompts are
# exactly the standard ones.
from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_process_docs  # noqa: E402
from lm_eval.tasks.winogrande.preprocess_winogrande import (  # noqa: E402
    doc_to_choice as winogrande_doc_to_choice,
    doc_to_target as winogrande_doc_to_target,
    doc_to_text as winogrande_doc_to_text,
)

# ----------------------------------------------------------------------------- held-out BoolQ passages

#: words scored by ``boolq_heldout_suffix`` (at most half of a passage's words)
SUFFIX_WORDS = 16

_BOUND_LM = None


@contextlib.contextmanager
def bind_lm(lm):
    """Make ``lm``'s tokenizer available to ``process_results`` (token perplexity needs the token count
    of exactly what the LM scored).  The harness binds its LM for the duration of an evaluation."""
    global _BOUND_LM
    previous, _BOUND_LM = _BOUND_LM, lm
    try:
        yield lm
    finally:
        _BOUND_LM = previous


def _lm():
    if _BOUND_LM is None:
        raise RuntimeError(
            "the boolq_heldout_* tasks count tokens with the evaluated model's tokenizer; run them through "
            "hf_tokred.evaluation.runner (hf-tokred eval), which binds it"
        )
    return _BOUND_LM


def boolq_heldout_docs(dataset):
    """Unique BoolQ passages of the held-out half (sha1 hex digest starts with c-f), sorted."""
    from datasets import Dataset

    passages = sorted(p for p in set(dataset["passage"]) if is_heldout(p))
    return Dataset.from_dict({"passage": passages})


def passage(doc) -> str:
    return doc["passage"]


def _split(text: str) -> tuple[str, str]:
    words = text.split(" ")
    k = max(1, min(SUFFIX_WORDS, len(words) // 2))
    return " ".join(words[:-k]), " " + " ".join(words[-k:])


def suffix_context(doc) -> str:
    """All but the last ``min(16, n_words // 2)`` space-separated words of the passage."""
    return _split(doc["passage"])[0]


def suffix_continuation(doc) -> str:
    """The last words of the passage, with their leading space (what is scored)."""
    return _split(doc["passage"])[1]


def _count_words(text: str) -> int:
    return len(re.split(r"\s+", text.strip()))


def rolling_results(doc, results):
    """Whole-passage perplexities (lm-eval's wikitext metrics plus token perplexity)."""
    (ll,) = results
    text = doc["passage"]
    return {
        "word_perplexity": (ll, _count_words(text)),
        "byte_perplexity": (ll, len(text.encode("utf-8"))),
        "bits_per_byte": (ll, len(text.encode("utf-8"))),
        "token_perplexity": (ll, len(_lm().tok_encode(text))),
    }


def suffix_results(doc, results):
    """Perplexity of the passage's final words given the rest (LAMBADA-style: a long reducible context,
    a short protected continuation)."""
    ll, is_greedy = results[0]
    context, continuation = _split(doc["passage"])
    n_tokens = len(_lm()._encode_pair(context, continuation)[1])
    return {
        "token_perplexity": (ll, n_tokens),
        "word_perplexity": (ll, _count_words(continuation)),
        "greedy_match": float(is_greedy),
    }
