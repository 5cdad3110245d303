"""The bundled default models load offline from the package and reduce end to end."""

import re

import pytest
import torch
from transformers import Mamba2ForCausalLM, MambaForCausalLM

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.evaluation import data
from hf_tokred.evaluation.mqar import MQARSettings, make_batch
from hf_tokred.evaluation.passkey import PasskeySettings, make_passkey_batch
from hf_tokred.models import BUNDLED


@pytest.mark.parametrize("family,cls", [("mamba", MambaForCausalLM), ("mamba2", Mamba2ForCausalLM)])
def test_bundled_model_loads_and_reduces(family, cls):
    model, tok = hf_tokred.load_bundled(family)
    assert type(model) is cls and model.config.num_hidden_layers >= 12
    assert getattr(model.config, "token_reduction", None) is None
    prompt = ("The history of the city is long. The people who lived there built roads, schools and a large "
              "market by the river, and the town grew during the nineteenth century when the railway came")
    enc = tok(prompt, return_tensors="pt")
    assert enc["input_ids"].shape[1] >= 30
    with torch.no_grad():
        dense = model(**enc).logits
        hf_tokred.apply_token_reduction(model, TokenReductionConfig(flops_reduction=0.2))
        out = model(**enc)
    assert out.plans, "a 20 % FLOPs target reduces this prompt"
    assert torch.isfinite(out.logits[:, -1]).all()
    # A trained model: the reduced next-token distribution stays close to the dense one.
    p, q = dense[:, -1].log_softmax(-1), out.logits[:, -1].log_softmax(-1)
    assert torch.nn.functional.kl_div(q, p, log_target=True, reduction="batchmean") < 1.0
    reduced, _ = hf_tokred.load_bundled(family, token_reduction={"method": "tome", "flops_reduction": 0.1})
    assert hf_tokred.get_token_reduction(reduced).method == "tome"
    text = tok.decode(model.generate(**enc, max_new_tokens=5, do_sample=False)[0], skip_special_tokens=True)
    assert text.startswith("The history of the city") and len(text) > len(prompt)


RECALL_CASES = [(m, 0.0) for m in BUNDLED if m.startswith("recall-")] + [
    ("recall-mamba2-anydepth", 0.5), ("recall-mamba2-anydepth", 1.0)]  # trained with the pairs at any depth


@pytest.mark.parametrize("name,depth", RECALL_CASES)
def test_bundled_recall_model_recalls(name, depth):
    """A bundled recall model carries its task in config.json, has at least 8 blocks, and answers at least 90 % of
    the queries of fresh evaluation sequences (never trained on), scored by hand from the tokens: each query key's
    prediction must be the value bound to that key in the pairs at the start of its row."""
    model, tok = hf_tokred.load_bundled(name)
    s = MQARSettings(**model.config.mqar)
    assert model.config.num_hidden_layers >= 8 and len(tok) == s.vocab_size
    ids = make_batch(s, 64, 1_000_000, depth=depth).input_ids
    with torch.no_grad():
        predicted = model(ids).logits.argmax(-1)
    hits = []
    k = round(depth * s.filler_len)  # the pairs start after this much filler
    for row, guess in zip(ids.tolist(), predicted.tolist()):
        bound = dict(zip(row[k : k + 2 * s.num_pairs : 2], row[k + 1 : k + 2 * s.num_pairs : 2]))
        start = len(row) - 2 * s.num_queries
        hits += [guess[t] == bound[row[t]] for t in range(start, len(row), 2)]
    assert len(hits) == 64 * s.num_queries
    assert sum(hits) / len(hits) >= 0.9


PASSKEY_CASES = [(m, haystack) for m in BUNDLED if m.startswith("passkey-") for haystack in ("noise", "natural")]


@pytest.mark.parametrize("name,haystack", PASSKEY_CASES)
def test_bundled_passkey_model_retrieves(name, haystack):
    """A bundled passkey model carries its task in config.json and, after the question of fresh prompts (never
    trained on; natural haystacks from the held-out split), greedily writes the number that the needle sentence of
    its prompt holds in at least 90 % of them; the number is read back from the prompt's text by hand."""
    model, tok = hf_tokred.load_bundled(name)
    s = PasskeySettings(**{**model.config.passkey, "haystack": haystack})
    texts = data.heldout_passages() if haystack == "natural" else None
    hits = []
    for depth in (0.0, 0.5, 1.0):
        b = make_passkey_batch(tok, s, 12, 1_000_000, depth=depth, texts=texts)
        for row, key in zip(b.input_ids, b.keys):
            prompt = tok.decode(row)
            found = re.findall(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.", prompt)
            assert found == [(key, key)]
            question = prompt.rindex("What is the pass key? The pass key is")
            answer_tokens = len(tok(" " + key, add_special_tokens=False)["input_ids"])
            ids = row[: len(row) - answer_tokens][None]  # the prompt without its answer
            assert tok.decode(ids[0]).rstrip().endswith("The pass key is") and question > 0
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=answer_tokens, do_sample=False)
            hits.append(tok.decode(out[0, ids.shape[1]:]).strip() == key)
    assert sum(hits) / len(hits) >= 0.9, sum(hits)
