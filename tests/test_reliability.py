"""No silent wrong results: each test here failed before its fix (issue "No silent wrong results")."""

import copy
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    Mamba2ForCausalLM,
    MambaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import hf_tokred
from hf_tokred import TokenReductionConfig, hub
from hf_tokred.ops import cpu as cpu_kernel
from hf_tokred.cli import main
from hf_tokred.compat import cache_kwargs, cache_of
from hf_tokred.families import FAMILIES
from hf_tokred.models import random_config, weights_fingerprint

from conftest import stock_forward, tiny_model

ATOL = 1e-5


def rows(seed, n_rows, length, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n_rows, length), generator=g)


def hand_loss(model, ids, labels, mask=None):
    """Mean next-token cross-entropy over the positions that were computed and have a label (from the logits)."""
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    nxt = F.pad(labels[:, 1:], (0, 1), value=-100)
    use = out.computed_mask & (nxt != -100)
    return F.cross_entropy(out.logits[use].float(), nxt[use]).item(), int(use.sum()), int((nxt != -100).sum())


# ----------------------------------------------------------------------------- 1. Trainer loss


class _Logs(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _train_one_step(model, ids, labels, tmp_path, batch, accumulation):
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": lab} for i, lab in zip(ids, labels)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch, max_steps=1,
                             gradient_accumulation_steps=accumulation, learning_rate=0.0, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0)
    logs = _Logs()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[logs])
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(  # keep the rows in order
        data, batch_size=batch, collate_fn=trainer.data_collator)
    trainer.train()
    return logs.losses[0]


def test_trainer_logs_the_mean_over_computed_labelled_positions(tmp_path):
    model, _ = hf_tokred.load_bundled("mamba", token_reduction={"flops_reduction": 0.3})
    ids = rows(0, 2, 48, vocab=8000)
    labels = ids.clone()
    labels[:, :5] = -100
    want, computed, labelled = hand_loss(model, ids, labels)
    assert computed < labelled  # reduction removed labelled positions: the old rule reported want * computed/labelled
    assert _train_one_step(model, ids, labels, tmp_path / "a", 2, 1) == pytest.approx(want, abs=2e-4)
    # two accumulation steps: the labelled-weighted mean of the two micro-batch means
    parts = [hand_loss(model, ids[i:i + 1], labels[i:i + 1]) for i in range(2)]
    weighted = sum(loss * lab for loss, _, lab in parts) / sum(lab for _, _, lab in parts)
    assert _train_one_step(model, ids, labels, tmp_path / "b", 1, 2) == pytest.approx(weighted, abs=2e-4)


def test_num_items_in_batch_scales_like_trainer_expects(model):
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.6, anchors=[1, 3]))
    ids = rows(1, 2, 30)
    want, _, labelled = hand_loss(model, ids, ids)
    out = model(ids, labels=ids, num_items_in_batch=torch.tensor(2 * labelled))
    assert out.loss.item() == pytest.approx(want / 2, abs=ATOL)  # this batch holds half the labelled positions


# ----------------------------------------------------------------------------- 2. labels / attention_mask shapes


@pytest.mark.parametrize("shape", [(2, 31), (3, 30), (2, 29), (1, 30)])
def test_labels_of_another_shape_are_refused(model, shape):
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.6, anchors=[1, 3]))
    ids = rows(2, 2, 30)
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(2, 30\)"):
        model(ids, labels=torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("shape", [(2, 29), (3, 30), (2, 31)])
def test_attention_mask_of_another_shape_is_refused(model, shape):
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.6, anchors=[1, 3]))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(rows(3, 2, 30), attention_mask=torch.ones(shape, dtype=torch.long))


@pytest.mark.parametrize("batch", [3, 0])
def test_protected_mask_of_another_batch_is_refused(model, batch):
    """A protected_mask row count that does not divide the batch (generate's beams / return sequences repeat rows
    only by a whole factor) is an error naming the argument, not a broadcast."""
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.6, anchors=[1, 3]))
    with pytest.raises(ValueError, match="protected_mask must have shape"):
        model(rows(3, 4, 30), protected_mask=torch.ones(batch, 30, dtype=torch.bool))


def test_gradient_checkpointing_in_training_builds_no_cache_like_stock(family):
    """As in stock transformers, training with gradient checkpointing turns ``use_cache`` off: a reducing forward
    returns no cache, and its loss and gradients equal the same forward without checkpointing."""
    model = tiny_model(family, layers=4)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.6, anchors=[1, 2]))
    ids = rows(5, 2, 24)
    model.train()
    plain = model(ids, labels=ids, use_cache=False)
    plain.loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing_enable()
    out = model(ids, labels=ids, use_cache=True)
    assert getattr(out, "cache_params", None) is None and getattr(out, "past_key_values", None) is None
    out.loss.backward()
    assert torch.allclose(out.loss, plain.loss, atol=ATOL, rtol=0)
    for p, g in zip(model.parameters(), want):
        assert torch.allclose(p.grad, g, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_use_cache_resolves_as_in_stock(name):
    """Whether a reducing forward returns a cache follows stock transformers for every family, config default,
    mode and ``use_cache`` value: the pure Mamba models build none while training unless asked, and none under
    gradient checkpointing; the hybrids take ``use_cache`` (or the config's) as given."""
    config = random_config(f"{name}-tiny")
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[name].lm_class)(config)
    ssm = FAMILIES[name].anchor_layers(config)
    hybrid = FAMILIES[name].hybrid
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=ssm[:2]))
    ids = rows(2, 1, 12)
    seen = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        for config_default in (True, False):
            model.config.use_cache = config_default
            for training in (False, True):
                model.train(training)
                for use_cache in (None, True, False):
                    kw = {} if use_cache is None else {"use_cache": use_cache}
                    want = cache_of(stock_forward(model, ids, **kw), hybrid) is not None
                    got = cache_of(model(ids, **kw), hybrid) is not None
                    assert got == want, (checkpointing, config_default, training, use_cache)
                    seen.append(want)
    assert any(seen) and not all(seen)


# ----------------------------------------------------------------------------- 3. generate without a cache


@pytest.mark.parametrize("method", ["utrc", "evit", "tome", "utrc_reference"])
def test_generate_without_cache_equals_with_cache(family, method):
    model = tiny_model(family, layers=8)
    model.generation_config.eos_token_id = None
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method=method, keep_ratio=0.6, anchors=[1, 3, 5]))
    ids = rows(4, 2, 30)
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    greedy = model.generate(ids, do_sample=False, **kw)
    assert torch.equal(model.generate(ids, do_sample=False, use_cache=False, **kw), greedy)
    torch.manual_seed(7)
    sampled = model.generate(ids, do_sample=True, **kw)
    torch.manual_seed(7)
    assert torch.equal(model.generate(ids, do_sample=True, use_cache=False, **kw), sampled)


def test_generate_takes_protected_mask_for_the_prompt(family):
    model = tiny_model(family, layers=8)
    model.generation_config.eos_token_id = None
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[1, 3]))
    ids = rows(5, 2, 24)
    protect = torch.zeros_like(ids, dtype=torch.bool)
    protect[:, :6] = True
    with hf_tokred.record_reduction() as plain:
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with hf_tokred.record_reduction() as guarded:
        out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, protected_mask=protect,
                             num_beams=2)
    assert out.shape == (2, 26)
    assert any(not set(range(6)) <= set(k) for k in plain[0].kept_positions)  # without protection some go
    assert all(set(range(6)) <= set(k) for k in guarded[0].kept_positions)  # beams repeat the rows: all kept
    with pytest.raises(ValueError, match="protected_mask must have the prompt's shape"):
        model.generate(ids, max_new_tokens=2, protected_mask=protect[:, :5])


def test_protected_mask_as_numpy_or_list_equals_the_tensor(family):
    """protected_mask given as a numpy array or nested list protects the same positions as the bool tensor, in
    forward and generate; floats, strings and other integers are a TypeError naming what is accepted."""
    model = tiny_model(family, layers=8)
    model.generation_config.eos_token_id = None
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[1, 3]))
    ids = rows(5, 2, 24)
    protect = torch.zeros_like(ids, dtype=torch.bool)
    protect[:, :6] = True
    with torch.no_grad():
        reference = model(ids, protected_mask=protect)
        assert all(set(range(6)) <= set(k.tolist()) for k in reference.kept_positions)
        for given in (protect.numpy(), protect.tolist(), protect.int().numpy(), protect.int().tolist()):
            out = model(ids, protected_mask=given)
            assert torch.equal(out.kept_positions, reference.kept_positions)
            torch.testing.assert_close(out.logits, reference.logits, equal_nan=True, atol=0, rtol=0)
        generated = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        for given in (protect, protect.tolist()):
            with hf_tokred.record_reduction() as records:
                out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, protected_mask=given)
            assert all(set(range(6)) <= set(k) for k in records[0].kept_positions) and out.shape == generated.shape
        for bad, what in ((protect.float().numpy(), "ndarray of torch.float32"), ("abc", "str"),
                          ((protect.int() * 2).tolist(), "list of torch.int64")):
            with pytest.raises(TypeError, match=f"protected_mask must be a bool tensor .*got {what}"):
                model(ids, protected_mask=bad)


def test_record_of_a_padded_batch_reduced_after_the_first_block(family):
    """``record_reduction`` with an anchor on block 0: the input lengths are each row's real tokens (counted from
    the mask by hand), block 0 computes all of them, the next block the row's kept tokens, and the kept positions
    are real input positions."""
    model = tiny_model(family, layers=4)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[0, 2]))
    ids = rows(6, 3, 20)
    mask = torch.ones_like(ids)
    mask[1, :7], mask[2, :15] = 0, 0  # left padding: 20, 13 and 5 real tokens
    with torch.no_grad(), hf_tokred.record_reduction() as records:
        model(ids, attention_mask=mask)
    (record,) = records
    assert record.input_lengths == [20, 13, 5] and record.anchors == [0, 2]
    assert [row[0] for row in record.layer_lengths] == [20, 13, 5]
    assert [row[1] for row in record.layer_lengths] == [10, 7, 3]  # ceil(0.5 * n) kept after block 0
    for b, kept in enumerate(record.kept_positions):
        assert set(kept) <= set(mask[b].nonzero().flatten().tolist())


def test_only_prefills_that_can_reduce_are_recorded(family):
    """``record_reduction`` records reducing forwards only: generating from a one-token prompt (nothing to reduce)
    records nothing, from a two-token prompt exactly the prefill (decode steps are never recorded)."""
    model = tiny_model(family, layers=4)
    model.generation_config.eos_token_id = None
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[0, 2]))
    ids = rows(9, 1, 2)
    with torch.no_grad(), hf_tokred.record_reduction() as one:
        model.generate(ids[:, :1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad(), hf_tokred.record_reduction() as two:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert one == []
    assert len(two) == 1 and two[0].input_lengths == [2] and two[0].anchors == [0]  # one token left at block 2


def test_a_cached_forward_of_several_new_tokens_is_not_reduced(family):
    """Only a fresh prefill is reduced: a forward of several new tokens on a filled cache (chunked prefill,
    assisted decoding) computes every one of them, is not recorded, and equals the same forward with reduction
    off on the same cache contents."""
    model = tiny_model(family, layers=4)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[0, 2]))
    ids = rows(8, 1, 30)
    new = dict(use_cache=True, cache_position=torch.arange(24, 30))
    with torch.no_grad(), hf_tokred.record_reduction() as records:
        first = model(ids[:, :24], use_cache=True)
        second = model(ids[:, 24:], **cache_kwargs(copy.deepcopy(cache_of(first))), **new)
    assert len(records) == 1 and records[0].anchors == [0, 2]
    assert second.computed_mask.all() and second.logits.shape[1] == 6
    saved = model.config.token_reduction
    hf_tokred.apply_token_reduction(model, None)
    with torch.no_grad():
        plain = model(ids[:, 24:], **cache_kwargs(copy.deepcopy(cache_of(first))), **new)
    model.config.token_reduction = saved
    torch.testing.assert_close(second.logits, plain.logits, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- 4. assigning the settings object


def test_assigning_a_config_object_keeps_saving_working(tmp_path, family):
    model = tiny_model(family)
    model.config.token_reduction = TokenReductionConfig(keep_ratio=0.7, anchors=[1, 3])
    assert isinstance(model.config.token_reduction, dict)
    json.loads(model.config.to_json_string())
    assert len(model(rows(6, 1, 20)).plans) == 2
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf_tokred.get_token_reduction(again) == TokenReductionConfig(keep_ratio=0.7, anchors=[1, 3])
    model.config.token_reduction = None
    assert hf_tokred.get_token_reduction(model) is None and "token_reduction" not in model.config.to_dict()


# ----------------------------------------------------------------------------- 5. CLI errors


BAD_INPUT = [
    (["generate", "x", "--flops-reduction", "0.9"], "--flops-reduction"),
    (["generate", "x", "--anchors", "40", "--keep-ratio", "0.9"], "--anchors"),
    (["generate", "x", "--anchors", "11", "--keep-ratio", "0.9"], "last block"),
    (["generate", ""], "prompt is empty"),
    (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "x", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["generate", "x", "--model", "random:gpt2-tiny"], "--model random:gpt2-tiny"),
    (["generate", "x", "--model", "bundled:gpt"], "--model bundled:gpt"),
    (["schedule", "--layers", "0"], "--layers"),
    (["schedule", "--length", "0"], "--length"),
    (["schedule", "--length", "-5"], "--length"),
    (["schedule", "--model", "bundled:gpt"], "--model"),
    (["bench", "--model", "random:gpt2-tiny", "--length", "8"], "--model"),
    (["eval", "--model", "random:mamba-tiny", "--max-length", "4", "--tasks", "arc_easy", "--limit", "2",
      "--no-fidelity"], "--max-length"),
    (["push", "--model", "random:gpt2-tiny", "--flops-reduction", "0.2", "--full-copy", "--output", "/tmp/hf_tokred_push_test"], "--model"),
]


@pytest.mark.parametrize("argv,needle", BAD_INPUT, ids=[" ".join(a[:3]) for a, _ in BAD_INPUT])
def test_cli_user_errors_are_one_line_exit_2(argv, needle, capsys, tmp_path):
    if argv[0] == "eval":
        from hf_tokred.evaluation import data

        data.fetch_data()  # the offline splits (as test_evaluation.py does)
        argv = [*argv, "--output", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_cli_missing_model_is_one_line_exit_1(capsys):
    """A Hub id that cannot be read (offline, not cached) exits 1; a missing local folder is a usage error (2)."""
    assert main(["generate", "x", "--model", "no-such-owner/no-such-model"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["generate", "x", "--model", "/nonexistent/folder"]) == 2
    assert "no such folder '/nonexistent/folder'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 6. eval results of another model


def _result_for(model, spec, cfg):
    return {"schema": "hf_tokred.eval/1", "row": {"model": spec}, "model": spec,
            "model_fingerprint": weights_fingerprint(model), "model_type": model.config.model_type,
            "num_hidden_layers": model.config.num_hidden_layers, "token_reduction": cfg.to_dict()}


def test_eval_results_of_another_model_are_refused(tmp_path):
    cfg = TokenReductionConfig(flops_reduction=0.2)
    other, _ = hf_tokred.load_model("random:mamba-tiny")
    model, tok = hf_tokred.load_bundled("mamba")
    with pytest.raises(ValueError, match="another model"):
        hub.save_variant(model, cfg, tmp_path / "a", tokenizer=tok, full_copy=True, base_name="bundled:mamba",
                         eval_results=_result_for(other, "bundled:mamba", cfg))
    with pytest.raises(ValueError, match="measured on 'random:mamba-tiny', not on 'bundled:mamba'"):
        hub.save_variant("bundled:mamba", cfg, tmp_path / "b", eval_results=_result_for(other, "random:mamba-tiny", cfg))
    # the same model loaded in another dtype has the same fingerprint: accepted
    half, _ = hf_tokred.load_bundled("mamba", dtype=torch.float16)
    hub.save_variant(model, cfg, tmp_path / "c", tokenizer=tok, full_copy=True, base_name="bundled:mamba",
                     eval_results=_result_for(half, "bundled:mamba", cfg))


# ----------------------------------------------------------------------------- 7/8. the main job and schedule


def test_main_job_prints_what_reduction_did(capsys):
    assert main(["generate", "--model", "bundled:mamba", "--flops-reduction", "0.2", "--max-new-tokens", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    red = out["reduction"]
    model, tok = hf_tokred.load_bundled("mamba", token_reduction={"flops_reduction": 0.2})
    ids = tok(out["prompt"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        kept = int(model(ids, logits_to_keep=1).computed_mask.sum())
    assert red["prompt_tokens"] == ids.shape[1] and red["layer_lengths"][-1] == kept < ids.shape[1]
    assert list(red["kept_after_anchor"].values()) == sorted(red["kept_after_anchor"].values(), reverse=True)
    assert 0.1 < red["prefill_flops_reduction"] < 0.3
    assert main(["generate", "--model", "bundled:mamba", "--flops-reduction", "0.2", "--max-new-tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert f"kept {kept}/{ids.shape[1]} prompt tokens" in text and "prefill FLOPs -" in text


def test_schedule_reports_prefill_and_scoring_flops_against_measured_matmuls(capsys):
    from torch.utils.flop_counter import FlopCounterMode

    assert main(["schedule", "--model", "bundled:mamba", "--flops-reduction", "0.3", "--length", "200",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    model, _ = hf_tokred.load_bundled("mamba")
    ids = rows(8, 1, 200, vocab=8000)

    def measured(keep):
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(ids, logits_to_keep=keep)
        return fc.get_total_flops()

    dense = {k: measured(k) for k in (1, 0)}
    hf_tokred.apply_token_reduction(model, {"flops_reduction": 0.3})
    for key, keep in (("flops_reduction_exact_prefill", 1), ("flops_reduction_exact_scoring", 0)):
        got = 1 - measured(keep) / dense[keep]  # matmuls only: the element-wise share is small
        assert abs(row[key] - got) < 0.02, (key, row[key], got)
    assert row["flops_reduction_exact_scoring"] > row["flops_reduction_exact_prefill"] + 0.02


# ----------------------------------------------------------------------------- 9. quiet by default


def test_commands_keep_stderr_quiet():
    proc = subprocess.run([sys.executable, "-m", "hf_tokred.cli", "generate", "hello", "--model", "bundled:mamba2",
                           "--max-new-tokens", "2"], capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# ----------------------------------------------------------------------------- 10. fast kernels with autograd on


def test_plain_forward_uses_compiled_kernels_and_backward_matches_stock(monkeypatch):
    if not cpu_kernel.available():
        pytest.fail("the compiled CPU kernels must build in CI")
    calls = []
    real = cpu_kernel.selective_scan_cpu
    monkeypatch.setattr(cpu_kernel, "selective_scan_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("mamba", layers=3).train()
    ids = rows(9, 2, 24)
    out = model(ids, labels=ids)  # no torch.no_grad(): parameters require grad
    assert calls, "the compiled scan did not run"
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = stock_forward(model, ids, labels=ids)
    ref.loss.backward()
    assert torch.allclose(out.loss, ref.loss, atol=ATOL)
    for n, p in model.named_parameters():
        assert torch.allclose(ours[n], p.grad, atol=1e-5, rtol=1e-4), n


# ----------------------------------------------------------------------------- 11. small ones


def test_numpy_numbers_are_accepted():
    cfg = TokenReductionConfig(method="utrc", keep_ratio=np.float32(0.75), anchors=[np.int64(1), np.int32(3)],
                               q=np.float64(0.25))
    assert cfg.keep_ratio == 0.75 and cfg.anchors == (1, 3) and type(cfg.anchors[0]) is int
    assert TokenReductionConfig(flops_reduction=np.float32(0.2), anchors=np.array([1, 3])).anchors == (1, 3)
    json.dumps(cfg.to_dict())
    with pytest.raises(TypeError):
        TokenReductionConfig(keep_ratio=np.bool_(True))


def test_anchor_on_the_last_block_is_refused(model):
    with pytest.raises(ValueError, match="last block"):
        hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.7, anchors=[1, 5]))


def test_autoconfig_token_reduction_is_applied_or_refused(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "m")
    config = AutoConfig.from_pretrained(tmp_path / "m", token_reduction={"keep_ratio": 0.7, "anchors": [1, 3]})
    assert hf_tokred.get_token_reduction(config) == TokenReductionConfig(keep_ratio=0.7, anchors=[1, 3])
    with pytest.raises(ValueError, match="reach outside"):
        AutoConfig.from_pretrained(tmp_path / "m", token_reduction={"keep_ratio": 0.7, "anchors": [40]})
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="applies to Mamba"):
        AutoConfig.from_pretrained(tmp_path / "g", token_reduction={"flops_reduction": 0.2})


def test_settings_found_on_a_model_are_validated_on_first_use(model):
    model.config.__dict__["token_reduction"] = {"keep_ratio": 0.9, "anchors": [40]}  # as if loaded before import
    with pytest.raises(ValueError, match="apply_token_reduction"):
        model(rows(10, 1, 12))


def test_invalid_saved_block_message_has_one_period(tmp_path, model):
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["token_reduction"] = {"flops_reduction": 0.9, "anchors": [1]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert ".." not in str(err.value) and "Fix that block" in str(err.value)


def test_concrete_class_loads_a_settings_only_variant(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "base")
    cfg = TokenReductionConfig(keep_ratio=0.7, anchors=[1, 3])
    hub.save_variant(str(tmp_path / "base"), cfg, tmp_path / "variant", tokenizer=_tok())
    cls = MambaForCausalLM if family == "mamba" else Mamba2ForCausalLM
    other = Mamba2ForCausalLM if family == "mamba" else MambaForCausalLM
    loaded = cls.from_pretrained(tmp_path / "variant")
    assert type(loaded) is cls and hf_tokred.get_token_reduction(loaded) == cfg
    with pytest.raises(ValueError, match="load it with AutoModelForCausalLM"):
        other.from_pretrained(tmp_path / "variant")


def _tok():
    from conftest import word_tokenizer

    return word_tokenizer()


def test_loss_is_nan_free_when_labels_survive(model):
    """Sanity for the loss rule: with every labelled position protected, the reduced loss equals the stock loss
    over the same positions (independent of how many tokens were removed elsewhere)."""
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_ratio=0.5, anchors=[1, 3]))
    ids = rows(11, 1, 30)
    labels = torch.full_like(ids, -100)
    labels[0, 25:] = ids[0, 25:]
    protect = torch.zeros_like(ids, dtype=torch.bool)
    protect[0, 24:] = True
    out = model(ids, labels=labels, protected_mask=protect)
    nxt = F.pad(labels[:, 1:], (0, 1), value=-100)
    want = F.cross_entropy(out.logits[nxt != -100], nxt[nxt != -100])
    assert not math.isnan(out.loss.item()) and out.loss.item() == pytest.approx(want.item(), abs=ATOL)
