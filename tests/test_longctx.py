"""Long-context evaluation: the passkey generator (by hand), its scoring rule, the length x depth grid against a
per-row recomputation, and ``hf-tokred eval --lengths`` (table, files, one-line errors)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tokred import TokenReductionConfig, apply_token_reduction
from hf_tokred.bundled_models import bundled_path
from hf_tokred.cli import main
from hf_tokred.evaluation import longctx
from hf_tokred.flops import model_flops
from hf_tokred.evaluation.mqar import MQARSettings, make_batch
from hf_tokred.evaluation.passkey import NOISE, PasskeySettings, make_passkey_batch, passkey_hits


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(bundled_path("mamba2")))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_passkey_rows_by_hand(tok, depth):
    s = PasskeySettings(seq_len=160)
    b = make_passkey_batch(tok, s, 4, seed=3, depth=depth)
    assert b.input_ids.shape == (4, 160) and b.labels.shape == (4, 160)
    for r, key in enumerate(b.keys):
        row = b.input_ids[r].tolist()
        assert len(key) == 5 and key[0] != "0" and row[0] == tok.bos_token_id
        needle = ids(tok, f" The pass key is {key}. Remember it. {key} is the pass key.")
        question, answer = ids(tok, " What is the pass key? The pass key is"), ids(tok, " " + key)
        start = int(b.needle_start[r])
        assert row[start:start + len(needle)] == needle
        assert row[-len(question) - len(answer):] == question + answer
        assert int(b.question_length[r]) == len(question) + len(answer)
        assert b.labels[r].tolist() == [-100] * (160 - len(answer)) + answer
        hay = 160 - 1 - len(needle) - len(question) - len(answer)
        # noise: whole sentences before the needle, the cut nearest depth * haystack
        sentence = [len(ids(tok, t)) for t in NOISE]
        bounds = [sum(sentence[i % len(NOISE)] for i in range(k)) for k in range(40)]
        expected = min((x for x in bounds if x <= hay), key=lambda x: abs(x - round(depth * hay)))
        assert start - 1 == expected
    # each row depends only on (seed, index)
    later = make_passkey_batch(tok, s, 2, seed=3, start=2, depth=depth)
    assert torch.equal(later.input_ids, b.input_ids[2:]) and later.keys == b.keys[2:]
    assert make_passkey_batch(tok, s, 4, seed=4, depth=depth).keys != b.keys


def test_natural_haystack_reads_the_texts(tok):
    texts = ["Alpha beta gamma delta. " * 30, "Omega psi chi phi. " * 30]
    b = make_passkey_batch(tok, PasskeySettings(seq_len=128, haystack="natural"), 6, seed=0, depth=0.5, texts=texts)
    vocab = set(ids(tok, texts[0]) + ids(tok, texts[1]))
    for r in range(6):
        start = int(b.needle_start[r])
        assert set(b.input_ids[r, 1:start].tolist()) <= vocab
    with pytest.raises(ValueError, match="natural haystack needs texts="):
        make_passkey_batch(tok, PasskeySettings(haystack="natural"), 1, seed=0)
    with pytest.raises(ValueError, match="too short"):
        make_passkey_batch(tok, PasskeySettings(seq_len=20), 1, seed=0)
    with pytest.raises(ValueError, match="depth must be in"):
        make_passkey_batch(tok, PasskeySettings(), 1, seed=0, depth=1.5)


def test_passkey_hits_is_greedy_copying(tok):
    b = make_passkey_batch(tok, PasskeySettings(seq_len=96), 3, seed=1, depth=0.5)
    vocab = len(tok)
    # a perfect next-token predictor: one-hot of the following token everywhere
    logits = torch.zeros(3, 96, vocab)
    logits[:, :-1].scatter_(-1, b.input_ids[:, 1:, None], 1.0)
    assert passkey_hits(logits, b).tolist() == [True, True, True]
    wrong = logits.clone()
    last_answer_pos = 96 - 2  # predicts the last answer token
    wrong[1, last_answer_pos] = 0
    wrong[1, last_answer_pos, 7] = 1.0
    assert passkey_hits(wrong, b).tolist() == [True, False, True]
    keep = int(b.question_length.max()) + 1  # the last positions alone (logits_to_keep) decide the same
    assert passkey_hits(wrong[:, -keep:], b).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="do not reach every answer token"):
        passkey_hits(wrong[:, -3:], b)
    # a position outside the answer may be anything
    other = logits.clone()
    other[0, 5] = 0
    other[0, 5, 7] = 1.0
    assert passkey_hits(other, b).tolist() == [True, True, True]
    nan = logits.clone()
    nan[2, last_answer_pos] = float("nan")
    with pytest.raises(ValueError, match="question_length"):
        passkey_hits(nan, b)


@torch.no_grad()
def test_grid_equals_a_row_by_row_recomputation():
    model = AutoModelForCausalLM.from_pretrained(str(bundled_path("recall-mamba2")), dtype=torch.float32).eval()
    settings = MQARSettings(**model.config.mqar)
    cfg = TokenReductionConfig(keep_tokens=128)
    records = longctx.grid(model, None, ["mqar"], [128, 320], [0.0, 0.5], {"dense": None, "budget": cfg}, n=6,
                           seed=11, batch_size=4, mqar_settings=settings)
    assert len(records) == 2 * 2 * 3  # lengths x methods x (two depths + pooled)
    by = {(r["method"], r["length"], r["depth"]): r for r in records}
    for (method, length, depth), rec in by.items():
        if depth == "all":
            continue
        s = MQARSettings(**{**settings.to_dict(), "seq_len": length})
        b = make_batch(s, 6, 11, depth=depth)
        apply_token_reduction(model, cfg if method == "budget" else None)
        per_row = []
        for r in range(6):  # one row at a time
            out = model(b.input_ids[r:r + 1], question_length=2 * s.num_queries, use_cache=False)
            per_row.append((out.logits[0, b.query_positions].argmax(-1) == b.answers[r]).float().mean().item())
        assert rec["score"] == pytest.approx(sum(per_row) / 6, abs=1e-9)
        assert rec["n"] == 6 and rec["ci"][0] <= rec["score"] <= rec["ci"][1]
    for depth in (0.0, 0.5, "all"):  # at or below the budget: unchanged, nothing saved
        assert by[("budget", 128, depth)]["score"] == by[("dense", 128, depth)]["score"]
        assert by[("budget", 128, depth)]["flops_saved"] == 0.0
    assert by[("dense", 320, "all")]["flops_saved"] == 0.0
    # prefilter at block 0: it scores 320 tokens and re-runs on 128, every later block sees 128; the LM head runs on
    # the 2 * 8 query tokens and the one before them, dense and reduced alike
    layers = model.config.num_hidden_layers
    reduced = model_flops(model.config, [320 + 128] + [128] * (layers - 1), lm_head_positions=17).total
    dense = model_flops(model.config, [320] * layers, lm_head_positions=17).total
    assert by[("budget", 320, "all")]["flops_saved"] == pytest.approx(1 - reduced / dense, abs=1e-12)
    pooled = by[("dense", 320, "all")]["score"]
    assert pooled == pytest.approx((by[("dense", 320, 0.0)]["score"] + by[("dense", 320, 0.5)]["score"]) / 2)
    table = longctx.format_table(records)
    assert "| mqar | budget | 0.5 |" in table and "| mqar | budget | FLOPs saved | 0.0 % |" in table


def test_document_rows_by_hand():
    rows = longctx.document_rows(list(range(100)), 10, 4)
    assert rows[:, 0].tolist() == [0, 30, 60, 90] and rows[3].tolist() == list(range(90, 100))
    assert longctx.document_rows(list(range(10)), 10, 3).tolist() == [list(range(10))] * 3
    with pytest.raises(ValueError, match="fewer than --lengths 11"):
        longctx.document_rows(list(range(10)), 11, 2)


@torch.no_grad()
def test_position_perplexity_equals_a_row_by_row_recomputation(tok):
    model = AutoModelForCausalLM.from_pretrained(str(bundled_path("mamba")), dtype=torch.float32).eval()
    texts = [f"Passage {i}: the river runs past the mill and the old stone bridge, then east to the sea." * 3
             for i in range(12)]
    cfg = TokenReductionConfig(keep_tokens=64)
    records = longctx.grid(model, tok, ["position_ppl"], [64, 200], [0.0, 1.0], {"dense": None, "budget": cfg},
                           n=3, batch_size=2, texts=texts)
    assert [(r["method"], r["length"], r["depth"], r["metric"]) for r in records] == [
        ("dense", 64, "all", "perplexity"), ("budget", 64, "all", "perplexity"),
        ("dense", 200, "all", "perplexity"), ("budget", 200, "all", "perplexity")]
    stream = tok("\n\n".join(texts))["input_ids"]
    for rec in records:
        apply_token_reduction(model, cfg if rec["method"] == "budget" else None)
        rows = longctx.document_rows(stream, rec["length"], 3)
        nll = []
        for r in range(3):
            out = model(rows[r:r + 1], question_length=33, use_cache=False)
            nll.append(F.cross_entropy(out.logits[0, -33:-1], rows[r, -32:]).item())
        assert rec["score"] == pytest.approx(math.exp(sum(nll) / 3), rel=1e-5)
        assert rec["ci"][0] <= rec["score"] <= rec["ci"][1] and rec["n"] == 3
    by = {(r["method"], r["length"]): r for r in records}
    assert by[("budget", 64)]["score"] == by[("dense", 64)]["score"]  # at the budget: not reduced
    assert by[("budget", 200)]["flops_saved"] > 0.3 and by[("dense", 200)]["flops_saved"] == 0.0
    assert "| position_ppl | budget | all |" in longctx.format_table(records)


def test_cli_long_context_run_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "lc"
    assert main(["eval", "--model", "bundled:recall-mamba2", "--tasks", "mqar", "--lengths", "128,256", "--depths",
                 "0", "--keep-tokens", "128", "--methods", "prefilter,front_prune", "--limit", "4", "--output",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| mqar | prefilter keep_tokens=128 | 0 |" in printed and "front_prune keep_tokens=128" in printed
    saved = json.loads((out / "longctx.json").read_text())
    assert {r["method"] for r in saved["records"]} == {"dense", "prefilter keep_tokens=128",
                                                         "front_prune keep_tokens=128"}
    assert saved["meta"]["lengths"] == [128, 256] and saved["meta"]["rows_per_cell"] == 4
    assert (out / "longctx.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "longctx.md").read_text().startswith("| task | method | depth |")


@pytest.mark.parametrize("argv,needle", [
    (["--tasks", "mqar", "--lengths", "12x"], "--lengths must be comma-separated numbers"),
    (["--tasks", "mqar", "--depths", "0,2"], "--depths must be comma-separated numbers in [0, 1]"),
    (["--tasks", "mqar,piqa", "--lengths", "128"], "piqa is an lm-eval task"),
    (["--tasks", "passkey"], "--tasks passkey needs a language model"),
    (["--tasks", "position_ppl"], "--tasks position_ppl needs a language model"),
    (["--tasks", "mqar", "--methods", "prefilter"], "--methods needs a reduction level"),
    (["--tasks", "mqar", "--methods", "nope", "--keep-tokens", "128"], "--methods nope"),
    (["--tasks", "mqar", "--methods", "evit", "--method", "evit", "--keep-tokens", "128"], "not both"),
    (["--tasks", "passkey", "--haystack", "hay"], "--haystack must be one of noise, natural"),
])
def test_cli_long_context_errors_are_one_line(argv, needle, capsys):
    code = main(["eval", "--model", "bundled:recall-mamba2", "--output", "/tmp/hf_tokred_never", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err
