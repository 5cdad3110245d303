"""The quality measurements: the MQAR generator, protected suffix scoring, fidelity, bootstrap intervals, and the
mqar task of ``hf-tokred eval``."""

import math

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.cli import main
from hf_tokred.evaluation.mqar import MQARSettings, make_batch, recall_hits, tokenizer
from hf_tokred.evaluation.meter import FlopsMeter
from hf_tokred.flops import model_flops
from hf_tokred.evaluation.quality import bootstrap_ci, fidelity, mqar_accuracy, suffix_scores

from conftest import tiny_model


def test_mqar_sequences_follow_the_definition():
    s = MQARSettings()
    b = make_batch(s, 16, seed=3)
    assert b.input_ids.shape == (16, s.seq_len) and 2 * s.filler_len >= s.seq_len
    for row, answers in zip(b.input_ids.tolist(), b.answers.tolist()):
        keys, values = row[0 : 2 * s.num_pairs : 2], row[1 : 2 * s.num_pairs : 2]
        assert len(set(keys)) == s.num_pairs and all(2 <= k < 2 + s.num_keys for k in keys)
        assert all(s.value_start <= v < s.filler_start for v in values)
        filler = row[2 * s.num_pairs : 2 * s.num_pairs + s.filler_len]
        assert all(s.filler_start <= f < s.vocab_size for f in filler)
        bound = dict(zip(keys, values))
        for q, a, pos in zip(row[-2 * s.num_queries :: 2], answers, b.query_positions.tolist()):
            assert row[pos] == q and bound[q] == a == row[pos + 1]  # each query asks a key; its value follows
    again = make_batch(s, 4, seed=3, start=12)
    assert torch.equal(again.input_ids, b.input_ids[12:])  # a row depends on (seed, index) only
    assert not torch.equal(make_batch(s, 4, seed=4).input_ids, b.input_ids[:4])
    labels = b.labels
    assert int((labels != -100).sum()) == 16 * s.num_queries
    assert torch.equal(labels[:, b.query_positions + 1], b.answers) and b.protected_mask.sum() == 16 * s.num_queries


@pytest.mark.parametrize("depth", [0.5, 1.0, None])
def test_mqar_depth_moves_only_the_key_value_block(depth):
    s = MQARSettings(seq_len=96)
    flat = make_batch(s, 8, seed=5)
    b = make_batch(s, 8, seed=5, depth=depth)
    pairs, f = 2 * s.num_pairs, s.filler_len
    befores = set()
    for row, ref in zip(b.input_ids.tolist(), flat.input_ids.tolist()):
        # by hand: the first `before` filler tokens of the flat row, then its pairs, the rest, the same queries
        before = next(k for k in range(f + 1) if row[k:k + pairs] == ref[:pairs] and row[:k] == ref[pairs:pairs + k])
        assert depth is None or before == round(depth * f)
        assert row[before + pairs:] == ref[pairs + before:]
        befores.add(before)
    assert depth is not None or len(befores) > 2  # random depths differ between rows
    assert torch.equal(b.answers, flat.answers) and torch.equal(b.query_positions, flat.query_positions)
    assert torch.equal(make_batch(s, 8, seed=5, depth=0.0).input_ids, flat.input_ids)
    with pytest.raises(ValueError, match="depth must be in"):
        make_batch(s, 1, seed=5, depth=1.5)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_pairs=40), "num_pairs"), (dict(num_queries=9), "num_queries"), (dict(seq_len=40), "filler"),
    (dict(vocab_size=60), "vocab_size"), (dict(seq_len=0), "seq_len"),
])
def test_mqar_settings_are_checked(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        MQARSettings(**kwargs)


def test_recall_hits_scores_the_query_positions_and_refuses_uncomputed_ones():
    s = MQARSettings()
    b = make_batch(s, 2, seed=0)
    logits = torch.zeros(2, s.seq_len, s.vocab_size)
    logits[0, b.query_positions, b.answers[0]] = 1.0  # row 0 right everywhere, row 1 wrong everywhere
    hits = recall_hits(logits, b)
    assert hits[0].all() and not hits[1].any()
    logits[1, b.query_positions[0]] = float("nan")
    with pytest.raises(ValueError, match="not computed"):
        recall_hits(logits, b)


def test_mqar_tokenizer_round_trips():
    s = MQARSettings()
    tok = tokenizer(s)
    row = make_batch(s, 1, seed=0).input_ids[0].tolist()
    assert tok(tok.decode(row), add_special_tokens=False)["input_ids"] == row


def test_bootstrap_interval_by_hand():
    est, lo, hi = bootstrap_ci([1.0, 1.0, 1.0])
    assert est == lo == hi == 1.0
    est, lo, hi = bootstrap_ci([0.0, 1.0] * 50, seed=1)
    assert est == 0.5 and 0.38 < lo < 0.5 < hi < 0.62  # about +-1.96 * sqrt(0.25 / 100)
    est, _, _ = bootstrap_ci([1.0, 3.0], weights=[3.0, 1.0])
    assert est == 1.5


def test_suffix_scores_protect_what_they_score(family):
    model = tiny_model(family, layers=6)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (60, 45, 70)]
    dense = suffix_scores(model, seqs, suffix=8, batch_size=2)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[1, 3]))
    reduced = suffix_scores(model, seqs, suffix=8, batch_size=2)
    assert reduced.computed_tokens < reduced.real_tokens  # reduction removed tokens ...
    fid = fidelity(dense, reduced)
    assert 0 <= fid["top1_agreement"][1] <= fid["top1_agreement"][0] <= fid["top1_agreement"][2] <= 1
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=1.0, anchors=[1, 3]))
    same = fidelity(dense, suffix_scores(model, seqs, suffix=8, batch_size=2))
    assert same["top1_agreement"][0] == 1.0 and abs(same["kl"][0]) < 1e-6
    # the dense NLL by hand for one passage: the last 8 tokens given everything before them
    hf_tokred.apply_token_reduction(model, None)
    with torch.no_grad():
        logits = model(torch.tensor([seqs[0]])).logits[0].float()
    nll = -torch.log_softmax(logits[-9:-1], -1).gather(1, torch.tensor(seqs[0][-8:])[:, None]).sum()
    assert math.isclose(dense.nll[0], float(nll), rel_tol=1e-4)


def _recall_model():
    s = MQARSettings()
    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=s.vocab_size, hidden_size=32, state_size=8, num_hidden_layers=8, num_heads=4,
                          head_dim=16, n_groups=1, chunk_size=32, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config.mqar = s.to_dict()
    return Mamba2ForCausalLM(config).eval(), s


def test_mqar_accuracy_counts_hits_and_keeps_queries(tmp_path):
    model, s = _recall_model()
    dense = mqar_accuracy(model, s, n=16, batch_size=8)
    b = make_batch(s, 16, 1_000_000)
    with torch.no_grad():
        want = recall_hits(model(b.input_ids).logits, b).double().mean().item()
    assert math.isclose(dense["accuracy"][0], want) and dense["computed_share"] == 1.0
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", flops_reduction=0.3))
    meter = FlopsMeter(model.config)
    with hf_tokred.record_reduction() as records:
        reduced = mqar_accuracy(model, s, n=16, batch_size=8, meter=meter)
    assert reduced["computed_share"] < 1.0
    # the meter's FLOPs are those of the blocks' recorded lengths (analytic count, one row at a time)
    rows = [ls for r in records for ls in r.layer_lengths]
    got = meter.summary()["per_task"]["mqar"]
    assert got["rows"] == 16 and got["reduced_flops"] == sum(model_flops(model.config, ls).total for ls in rows)
    assert got["dense_flops"] == 16 * model_flops(model.config, [s.seq_len] * 8).total > got["reduced_flops"]


def test_eval_reports_mqar(tmp_path, capsys):
    model, s = _recall_model()
    model.save_pretrained(tmp_path / "recall")
    tokenizer(s).save_pretrained(tmp_path / "recall")
    assert main(["eval", "--model", str(tmp_path / "recall"), "--tasks", "mqar", "--limit", "8", "--flops-reduction",
                 "0.2", "--method", "evit", "--metric", "delta", "--output", str(tmp_path / "out"), "--json"]) == 0
    row = __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= row["mqar_acc"] <= 1.0 and 0.0 < row["flops_exact"] < 1.0  # the recall forwards are metered
    # a language model is refused for the recall task, with the fix
    lm = tiny_model("mamba")
    lm.save_pretrained(tmp_path / "lm")
    from conftest import word_tokenizer

    word_tokenizer().save_pretrained(tmp_path / "lm")
    assert main(["eval", "--model", str(tmp_path / "lm"), "--tasks", "mqar", "--limit", "4"]) == 2
    assert "recall model" in capsys.readouterr().err
