"""The document-plus-question split: the question (a suffix of the prompt) is never removed and never merged into,
through ``forward``, ``generate``, ``pipeline("text-generation")`` and chat templates."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, pipeline

import hf_tokred
from conftest import tiny_model, word_tokenizer
from hf_tokred import TokenReductionConfig, encode_document_question, record_reduction
from robust_helpers import pad_rows, plans_equal, random_rows


def _question_mask(mask: torch.Tensor, lengths) -> torch.Tensor:
    """The last ``lengths[b]`` real tokens of each row, computed by hand from the mask."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    for b, q in enumerate(lengths):
        real = mask[b].nonzero().squeeze(1).tolist()
        out[b, real[len(real) - q:]] = True
    return out


@pytest.mark.parametrize("method", ["utrc", "tome", "merge_only", "utrc_reference"])
def test_question_is_never_a_merge_destination(family, method):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method=method, keep_ratio=0.5, anchors=[0, 2]))
    rows = random_rows(1, [30, 22, 17])
    ids, mask = pad_rows(rows, "left")
    q = [6, 3, 17 // 2]
    question = _question_mask(mask, q)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, question_length=q)
    assert bool(out.computed_mask[question].all())  # every question token is computed at its own position
    assert out.plans, "the document must be reduced"
    q_cols = question  # the question's columns at each anchor
    for layer, plan in out.plans:
        mergeable = torch.ones_like(plan.src_mask) if plan.mergeable is None else plan.mergeable
        hit = q_cols.gather(1, plan.dst) & plan.src_mask & mergeable
        assert not bool(hit.any()), f"{method}: a token merged into the question at anchor {layer}"
        assert not bool((q_cols.gather(1, plan.src) & plan.src_mask).any())
        q_cols = q_cols.gather(1, plan.keep) & plan.keep_mask


def test_question_equals_protection_that_receives_nothing(family):
    """utrc with the question split reduces exactly as utrc_frozen (protected tokens are never destinations) with
    the question as its protected positions: two code paths, one meaning."""
    model = tiny_model(family)
    rows = random_rows(4, [26, 19])
    ids, mask = pad_rows(rows, "left")
    q = [5, 4]
    outs = []
    for method, kwargs in (("utrc", {"question_length": q}),
                           ("utrc_frozen", {"protected_mask": _question_mask(mask, q)})):
        hf_tokred.apply_token_reduction(model, TokenReductionConfig(method=method, keep_ratio=0.6, anchors=[0, 3]))
        with torch.no_grad():
            outs.append(model(ids, attention_mask=mask, **kwargs))
    assert plans_equal(outs[0].plans, outs[1].plans)
    torch.testing.assert_close(outs[0].logits, outs[1].logits, equal_nan=True)


def test_pruning_methods_take_the_question_as_protected_positions(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=9))
    ids = torch.randint(2, 96, (2, 24))
    q = _question_mask(torch.ones_like(ids), [5, 5])
    with record_reduction() as a:
        ga = model.generate(ids, max_new_tokens=4, do_sample=False, question_length=5)
    with record_reduction() as b:
        gb = model.generate(ids, max_new_tokens=4, do_sample=False, protected_mask=q)
    assert torch.equal(ga, gb) and a[0].kept_positions == b[0].kept_positions
    assert all(p[-5:] == list(range(19, 24)) for p in a[0].kept_positions)
    beams = model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, question_length=[5, 2])
    assert beams.shape == (2, 27)


@pytest.mark.parametrize("value,error,match", [
    (2.5, TypeError, "question_length must be an int"),
    (True, TypeError, "question_length must be an int"),
    (99, ValueError, "between 0 and each row's real prompt length"),
    (-1, ValueError, "between 0"),
    ([1, 2, 3], ValueError, "one entry per row"),
])
def test_bad_question_lengths(value, error, match):
    model = tiny_model("mamba")
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=4))
    with pytest.raises(error, match=match):
        model(torch.randint(2, 96, (2, 20)), question_length=value)


def test_dense_model_accepts_and_ignores_nothing_it_needs(family):
    model = tiny_model(family)
    ids = torch.randint(2, 96, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, question_length=3).logits, model(ids).logits)


def test_encode_document_question_by_hand():
    tok = word_tokenizer()
    enc = encode_document_question(tok, ["w5 w6 w7 w8", "w9"], " w20 w21")
    assert enc["input_ids"].tolist() == [[5, 6, 7, 8, 20, 21], [0, 0, 0, 9, 20, 21]]
    assert enc["attention_mask"].tolist() == [[1] * 6, [0, 0, 0, 1, 1, 1]]
    assert enc["question_length"].tolist() == [2, 2]
    with pytest.raises(ValueError, match="2 documents and 3 questions"):
        encode_document_question(tok, ["w5", "w6"], ["w2", "w3", "w4"])
    with pytest.raises(TypeError, match="document must be a string"):
        encode_document_question(tok, 5, "w2")


CHAT = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4 w4{% endif %}")


def test_chat_template_question_runs_to_the_end_of_the_template():
    tok = word_tokenizer()
    tok.chat_template = CHAT
    enc = encode_document_question(tok, "w10 w11 w12", " w30 w31", chat=True)
    # w2 <document> w30 w31 w3 w4 w4: the question is its two words, the closing tag and the assistant header
    assert enc["input_ids"].tolist() == [[2, 10, 11, 12, 30, 31, 3, 4, 4]]
    assert enc["question_length"].tolist() == [5]


def test_pipeline_question_equals_generate_on_the_encoded_prompt(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    tok = word_tokenizer()
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=6))
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    doc, question = "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16", " w40 w41 w42"
    with record_reduction() as rec:
        got = pipe(doc, question=question, max_new_tokens=4, do_sample=False, return_full_text=False)
    enc = encode_document_question(tok, doc, question)
    ref = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert got[0]["generated_text"] == tok.decode(ref[0, enc["input_ids"].shape[1]:])
    assert rec[0].kept_positions[0][-3:] == [12, 13, 14]
    full = pipe(doc, question=question, max_new_tokens=2, do_sample=False)[0]["generated_text"]
    assert full.startswith(doc + question)
    tok.chat_template = CHAT
    chat = pipe([{"role": "user", "content": doc}], question=question, max_new_tokens=2, do_sample=False)
    assert chat[0]["generated_text"][0]["content"] == doc + question  # the question ends the user message
    batch = pipe([doc, "w7 w8 w9 w10 w11 w12 w13 w14"], question=question, max_new_tokens=2, do_sample=False,
                 batch_size=2, return_full_text=False)
    one = pipe("w7 w8 w9 w10 w11 w12 w13 w14", question=question, max_new_tokens=2, do_sample=False,
               return_full_text=False)
    assert batch[1] == one


def test_pipeline_question_on_a_model_hf_tokred_does_not_reduce():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                                         eos_token_id=None)).eval()
    tok = word_tokenizer()
    pipe = pipeline("text-generation", model=llama, tokenizer=tok)
    got = pipe("w5 w6", question=" w7", max_new_tokens=2, do_sample=False, return_full_text=False)
    ref = pipe("w5 w6 w7", max_new_tokens=2, do_sample=False, return_full_text=False)
    assert got == ref
