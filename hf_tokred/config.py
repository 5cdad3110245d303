"""`TokenReductionConfig`: the user-facing settings and their validation (the schedules they resolve to: schedule.py).

A config is a small frozen dataclass that round-trips through a plain JSON dict (that dict is what
lives in ``model.config.token_reduction`` and in ``config.json``).  ``resolve(num_hidden_layers)``
turns it into the concrete schedule that will run: anchor layers and a per-anchor keep ratio or a token budget.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from .schedule import (ResolvedSchedule, budget_anchors, budget_removal_count, check_depth, default_anchors, merge_count,
                       proxy_flops_reduction, removal_count, schedule_fractions, schedule_proxy_reduction,
                       schedule_reduction, solve_keep_ratio, ssm_anchors)
from .version import __version__

try:  # numpy's bool is not a Python bool but must not pass as a number
    from numpy import bool_ as np_bool
except ImportError:  # pragma: no cover - numpy comes with torch
    np_bool = bool

__all__ = [
    "METHODS",
    "METRICS",
    "STRATEGIES",
    "DEFAULT_MATCH_WINDOW",
    "DEFAULT_METHOD",
    "LEVELS",
    "LONG_CONTEXT_METHOD",
    "MethodSpec",
    "ResolvedSchedule",
    "TokenReductionConfig",
    "budget_anchors",
    "budget_removal_count",
    "default_anchors",
    "merge_count",
    "proxy_flops_reduction",
    "removal_count",
    "schedule_fractions",
    "schedule_proxy_reduction",
    "schedule_reduction",
    "ssm_anchors",
    "solve_keep_ratio",
]


@dataclass(frozen=True)
class MethodSpec:
    """What a named method does: how it selects tokens, and what each branch does with them."""

    selection: str  # "importance_similarity" | "reference" | "importance" | "bipartite" | "front"
    hidden: str  # strategy on the hidden-state (mixer output) branch
    residual: str  # strategy on the residual branch
    pairs: bool  # True when every removed token is matched to a kept one (removes at most half per anchor)
    summary: str
    metric: str = "clip"  # the importance metric it uses unless the settings name one
    protected_receive: bool = True  # protected tokens may be merge destinations (False: they stay untouched)
    rerun: bool = False  # the plan prunes the anchor's input and the anchor block runs on the kept tokens


METHODS: dict[str, MethodSpec] = {
    "utrc": MethodSpec(
        "importance_similarity", "hybrid", "merge", True,
        "The paper's UTRC as written: importance-classified halves, cosine matching, hybrid (hidden) + merge (residual).",
    ),
    "utrc_reference": MethodSpec(
        "reference", "hybrid_channel", "merge", True,
        "What the authors' code computes: per-channel sort selection (thins the front) and per-channel hybrid.",
    ),
    "evit": MethodSpec(
        "importance", "prune", "prune", False,
        "EViT baseline: keep the most important tokens, drop the rest (both branches).",
    ),
    "tome": MethodSpec(
        "bipartite", "merge", "merge", True,
        "ToMe / PuMer baseline: even/odd bipartite soft matching, average merge (both branches).",
    ),
    "prune_only": MethodSpec(
        "importance_similarity", "prune", "prune", True,
        "UTRC selection, prune on both branches (paper Table 5, P-only).",
    ),
    "merge_only": MethodSpec(
        "importance_similarity", "merge", "merge", True,
        "UTRC selection, merge on both branches (paper Table 5, M-only).",
    ),
    "front_prune": MethodSpec(
        "front", "prune", "prune", False,
        "Content-aware front-thinning: prune the least important of the oldest 2r unprotected tokens at each anchor "
        "(hf_tokred's method, the recommended default: the authors' front window, chosen by importance).",
    ),
    "prefilter": MethodSpec(
        "blocks", "prune", "prune", False,
        "Score with a first pass of the anchor block, then prune before it: the anchor and every later block run on "
        "the most important blocks of 32 consecutive tokens (hf_tokred's long-context method, the default of "
        "keep_tokens: later blocks see a short sequence of whole runs of text, which gives back the recall a Mamba "
        "loses past its training length).",
        rerun=True,
    ),
    "utrc_frozen": MethodSpec(
        "importance_similarity", "hybrid", "merge", True,
        "UTRC whose protected tokens (the last token, scored positions) are never merge destinations: they stay "
        "exactly as computed (hf_tokred's variant of the paper's method).",
        protected_receive=False,
    ),
}

#: The method ``TokenReductionConfig()`` uses when none is named (docs/methods.md says why).
DEFAULT_METHOD = "front_prune"
#: The method a token budget (``keep_tokens``) uses when none is named (docs/long-prompts.md says why).
LONG_CONTEXT_METHOD = "prefilter"
DEFAULT_Q = 0.5
#: The similarity selections match each candidate among this many destinations near it at most (0: all of them,
#: the exact global matching); docs/long-prompts.md has the cost and what it changes.  512 keeps every matching
#: method's own cost under 2 % of the dense forward at 16k tokens (1024 did not); prompts up to 1024 tokens per
#: anchor are matched exactly.
DEFAULT_MATCH_WINDOW = 512
#: hf_tokred 0.3.0 stored its default window (1024) with every method's settings, matching or not
_STORED_WINDOW_0_3_0 = ("0.3.0", 1024)
#: selections whose matching ``match_window`` bounds
WINDOWED_SELECTIONS = ("importance_similarity", "bipartite")
#: The fields that set how much is reduced; a config names exactly one.
LEVELS = ("flops_reduction", "keep_ratio", "keep_tokens")  # the hybrid strategies' pruned share unless the settings name one (the paper's setting)

#: Importance metrics: the paper's Table 3 (from the anchor block's mixer output ``h``), and ``delta``.
METRICS: dict[str, str] = {
    "clip": "mean over channels of max(0, h) (paper Eq. 5, the paper's methods' default)",
    "l1": "mean over channels of |h|",
    "l2": "L2 norm of h over channels",
    "noclip": "mean over channels of h",
    "delta": "mean over the SSM's channels (Mamba) or heads (Mamba-2) of the anchor's step size softplus(dt): how "
             "strongly the token writes into the recurrent state",
}

#: What a branch does with the selected tokens.
STRATEGIES: dict[str, str] = {
    "prune": "drop the selected tokens",
    "merge": "average each selected token into its matched token",
    "hybrid": "per token: prune a fraction q of the selected tokens (least important), merge the rest",
    "hybrid_channel": "per channel: merge the top (1-q) share of selected values, prune the others (reference code)",
}

def setting_text(value: Any, sep: str = ",") -> str:
    """A setting's value as text: anchors joined by ``sep``, numbers in ``:g`` form (labels, command lines)."""
    if isinstance(value, tuple):
        return sep.join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _real(name: str, value: Any) -> float:
    """A real setting (Python or numpy number, not bool) as a float."""
    if isinstance(value, (bool, np_bool)) or not isinstance(value, numbers.Real):
        raise TypeError(f"TokenReductionConfig.{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"TokenReductionConfig.{name} must be finite, got {value!r}")
    return value


def _count(name: str, value: Any) -> int:
    """A positive whole-number setting (Python or numpy int, not bool) as an int."""
    if isinstance(value, (bool, np_bool)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"TokenReductionConfig.{name} must be a positive int, got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"TokenReductionConfig.{name} must be a positive int, got {int(value)}")
    return int(value)


def _choice(name: str, value: Any, allowed: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"TokenReductionConfig.{name}={value!r} is not supported; allowed values: {', '.join(sorted(allowed))}"
        )
    return value


@dataclass(frozen=True)
class TokenReductionConfig:
    """Token-reduction settings for a Mamba / Mamba-2 model.

    Give either ``flops_reduction`` (the paper's measure; the keep ratio is solved for the model's depth)
    or ``keep_ratio`` (per anchor, relative to the sequence length entering that anchor).  ``anchors``
    (0-based block indices; reduction happens after these blocks) default to the paper's rule.

    Args:
        method: one of ``METHODS`` (default ``front_prune``; ``utrc`` is the paper's method as written,
            ``utrc_reference`` the authors' code, ``utrc_frozen`` UTRC with protected tokens never merged into,
            ``evit`` / ``tome`` / ``prune_only`` / ``merge_only`` baselines).
        flops_reduction: target FLOPs reduction in ``[0, 1)``, e.g. 0.1 / 0.2 / 0.3.
        keep_ratio: per-anchor keep ratio in ``(0, 1]`` (``[0.5, 1]`` for methods that pair tokens).
        anchors: strictly increasing block indices; checked against the model's depth when applied.
        metric: importance metric, one of ``METRICS`` (default: the method's own, ``clip`` for the paper's).
        q: share of the selected tokens that the hybrid strategy prunes (the rest are merged), in ``[0, 1]``.
        hidden_strategy / residual_strategy: override the method's strategy for a branch (ablations).
        protect_recent: share of each sequence's most recent tokens that no anchor removes, in ``[0, 1)``.
        keep_tokens: a token budget instead of a ratio: every block after the last anchor processes at most this
            many tokens of each sequence (padding excluded; protected tokens always survive); sequences of at most
            ``keep_tokens`` tokens are not reduced.  Without ``method`` it picks ``LONG_CONTEXT_METHOD``, without
            ``anchors`` the first SSM layer (:func:`hf_tokred.schedule.budget_anchors`).
        match_window: the similarity-matching methods (utrc, utrc_frozen, tome, prune_only, merge_only) match each
            candidate among at most this many destinations near it, so their cost stays linear in the length;
            ``0`` is the exact global matching (identical up to ``2 * match_window`` tokens).
    """

    method: str | None = None  # None: DEFAULT_METHOD, or LONG_CONTEXT_METHOD with keep_tokens
    flops_reduction: float | None = None
    keep_ratio: float | None = None
    anchors: tuple[int, ...] | None = None
    metric: str | None = None
    q: float = DEFAULT_Q
    hidden_strategy: str | None = None
    residual_strategy: str | None = None
    protect_recent: float = 0.0
    keep_tokens: int | None = None
    match_window: int = DEFAULT_MATCH_WINDOW

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.method is None:
            set_(self, "method", DEFAULT_METHOD if self.keep_tokens is None else LONG_CONTEXT_METHOD)
        _choice("method", self.method, METHODS)
        if self.metric is not None:
            _choice("metric", self.metric, METRICS)
        set_(self, "q", _real("q", self.q))
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"TokenReductionConfig.q must be in [0, 1], got {self.q}")
        set_(self, "protect_recent", _real("protect_recent", self.protect_recent))
        if not 0.0 <= self.protect_recent < 1.0:
            raise ValueError(f"TokenReductionConfig.protect_recent must be in [0, 1), got {self.protect_recent}")
        for name in ("hidden_strategy", "residual_strategy"):
            if getattr(self, name) is not None:
                _choice(name, getattr(self, name), STRATEGIES)
                if self.spec.rerun and getattr(self, name) != "prune":
                    raise ValueError(f"TokenReductionConfig.{name}={getattr(self, name)!r} has no meaning for method "
                                     f"{self.method!r}: it prunes the anchor's input, before the block splits into "
                                     "branches; leave the strategies out")
        if self.q != DEFAULT_Q and not {self.hidden, self.residual} & {"hybrid", "hybrid_channel"}:
            raise ValueError(f"TokenReductionConfig.q={self.q:g} would have no effect: q is the share of selected tokens "
                             f"that the hybrid strategies prune, and method {self.method!r} uses {self.hidden} / "
                             f"{self.residual}; name a method with a hybrid strategy (utrc, utrc_frozen, "
                             "utrc_reference), set hidden_strategy='hybrid', or leave q out")
        if isinstance(self.match_window, (bool, np_bool)) or not isinstance(self.match_window, numbers.Integral):
            raise TypeError(f"TokenReductionConfig.match_window must be an int (0: exact global matching), got "
                            f"{type(self.match_window).__name__} {self.match_window!r}")
        if self.match_window < 0:
            raise ValueError(f"TokenReductionConfig.match_window must be >= 0 (0: exact global matching), got "
                             f"{self.match_window}")
        set_(self, "match_window", int(self.match_window))
        if self.match_window != DEFAULT_MATCH_WINDOW and self.spec.selection not in WINDOWED_SELECTIONS:
            raise ValueError(f"TokenReductionConfig.match_window={self.match_window} would have no effect: method "
                             f"{self.method!r} does not match tokens by similarity (only utrc, utrc_frozen, tome, "
                             "prune_only and merge_only do); leave match_window out")
        levels = {name: getattr(self, name) for name in LEVELS if getattr(self, name) is not None}
        if len(levels) != 1:
            got = (", ".join(f"{k}={v!r}" for k, v in levels.items()) + " are given" if levels else
                   f"none is given; the method ({self.method}) and the other settings have defaults, the level has none")
            raise ValueError("TokenReductionConfig needs a reduction level, exactly one of flops_reduction (e.g. 0.2), "
                             f"keep_ratio (e.g. 0.9) or keep_tokens (e.g. 2048, a token budget): {got}")
        if self.keep_tokens is not None:
            set_(self, "keep_tokens", _count("keep_tokens", self.keep_tokens))
        if self.flops_reduction is not None:
            set_(self, "flops_reduction", _real("flops_reduction", self.flops_reduction))
            if not 0.0 <= self.flops_reduction < 1.0:
                raise ValueError(f"TokenReductionConfig.flops_reduction must be in [0, 1), got {self.flops_reduction}")
        if self.keep_ratio is not None:
            set_(self, "keep_ratio", _real("keep_ratio", self.keep_ratio))
            lo = self.min_keep_ratio
            if not (lo <= self.keep_ratio <= 1.0 and self.keep_ratio > 0.0):
                why = (f" (method {self.method!r} pairs every removed token with a kept one, so an anchor removes at "
                       "most half)" if lo > 0 else "")
                interval = f"[{lo:g}, 1]" if lo > 0 else "(0, 1]"
                raise ValueError(f"TokenReductionConfig.keep_ratio must be in {interval}{why}, got {self.keep_ratio}")
        if self.anchors is not None:
            set_(self, "anchors", self._check_anchors(self.anchors))

    @staticmethod
    def _check_anchors(anchors: Any) -> tuple[int, ...]:
        if hasattr(anchors, "tolist") and not isinstance(anchors, (str, bytes)):  # numpy array / torch tensor
            anchors = anchors.tolist()
        if isinstance(anchors, (str, bytes)) or not isinstance(anchors, Sequence):
            raise TypeError(f"TokenReductionConfig.anchors must be a list of ints, got {anchors!r}")
        out = []
        for a in anchors:
            if isinstance(a, (bool, np_bool)) or not isinstance(a, numbers.Integral):
                raise TypeError(f"TokenReductionConfig.anchors must be a list of ints, got element {a!r}")
            a = int(a)
            if a < 0:
                raise ValueError(f"TokenReductionConfig.anchors must be non-negative layer indices, got {a}")
            out.append(a)
        if not out:
            raise ValueError("TokenReductionConfig.anchors must not be empty (omit it to use the default rule)")
        if any(b <= a for a, b in zip(out, out[1:])):
            raise ValueError(f"TokenReductionConfig.anchors must be strictly increasing, got {out}")
        return tuple(out)

    # ------------------------------------------------------------------ derived

    def non_default_settings(self) -> dict[str, Any]:
        """Settings besides ``method`` and ``flops_reduction`` that differ from their defaults, in field order
        (what a label or a command line must spell out)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("method", "flops_reduction") and getattr(self, f.name) != f.default}

    @property
    def spec(self) -> MethodSpec:
        return METHODS[self.method]

    @property
    def importance_metric(self) -> str:
        """The importance metric that runs: the one named in the settings, else the method's own."""
        return self.metric or self.spec.metric

    @property
    def min_keep_ratio(self) -> float:
        return 0.5 if self.spec.pairs else 0.0

    @property
    def hidden(self) -> str:
        """Strategy applied to the hidden-state branch."""
        return self.hidden_strategy or self.spec.hidden

    @property
    def residual(self) -> str:
        """Strategy applied to the residual branch."""
        return self.residual_strategy or self.spec.residual

    def resolve(self, num_hidden_layers: int, ssm_layers: Sequence[int] | None = None,
                layer_costs: Sequence[tuple[float, float]] | None = None) -> ResolvedSchedule:
        """The anchors and keep ratio that will be applied to a model with ``num_hidden_layers`` blocks.

        Hybrids pass ``ssm_layers`` (the only layers an anchor may sit on; the default anchors move onto them) and
        ``layer_costs`` (see :func:`schedule_reduction`; a ``flops_reduction`` target then weighs the layers)."""
        check_depth(num_hidden_layers)
        anchors = self.anchors
        if anchors is None and self.keep_tokens is not None:
            anchors = budget_anchors(range(num_hidden_layers) if ssm_layers is None else ssm_layers)
        elif anchors is None:
            anchors = default_anchors(num_hidden_layers)
            if ssm_layers is not None:
                anchors = ssm_anchors(anchors, ssm_layers, num_hidden_layers)
        if not anchors:
            raise ValueError(
                f"a {num_hidden_layers}-layer model is too shallow for the default anchor rule; pass anchors=[...]"
            )
        if anchors[-1] >= num_hidden_layers:
            raise ValueError(
                f"TokenReductionConfig.anchors {list(anchors)} reach outside a {num_hidden_layers}-layer model; "
                f"anchors must be in [0, {num_hidden_layers - 2}]"
            )
        if anchors[-1] == num_hidden_layers - 1:
            raise ValueError(
                f"TokenReductionConfig.anchors {list(anchors)}: anchor {anchors[-1]} is the last block of a "
                f"{num_hidden_layers}-layer model, so no block runs on the reduced sequence and it saves nothing; "
                f"anchors must be in [0, {num_hidden_layers - 2}]"
            )
        off = [a for a in anchors if ssm_layers is not None and a not in ssm_layers]
        if off:
            raise ValueError(
                f"TokenReductionConfig.anchors {list(anchors)}: layer(s) {off} of this hybrid model are not SSM layers "
                f"an anchor can split (attention, feed-forward, Zamba2's shared-attention layers); pick anchors among "
                f"the SSM layers {list(ssm_layers)}, or omit anchors to use the default rule"
            )
        if self.keep_tokens is not None:  # the long-sequence limit of a budget: nothing after the first anchor
            return ResolvedSchedule(num_hidden_layers, tuple(anchors), None,
                                    schedule_reduction(num_hidden_layers, anchors, 0.0, layer_costs), self.spec.pairs,
                                    self.keep_tokens, self.spec.rerun)
        if self.keep_ratio is not None:
            keep = self.keep_ratio
        else:
            keep = solve_keep_ratio(num_hidden_layers, anchors, self.flops_reduction, max(self.min_keep_ratio, 1e-6),
                                    layer_costs)
        return ResolvedSchedule(num_hidden_layers, tuple(anchors), keep,
                                schedule_reduction(num_hidden_layers, anchors, keep, layer_costs), self.spec.pairs,
                                rerun=self.spec.rerun)

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict with every field and the hf_tokred version that wrote it (what ``config.json``
        stores)."""
        d = asdict(self)
        d["anchors"] = list(self.anchors) if self.anchors is not None else None
        d["version"] = __version__
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TokenReductionConfig":
        if not isinstance(data, Mapping):
            raise TypeError(f"token_reduction settings must be a dict or TokenReductionConfig, got {type(data).__name__}")
        data = dict(data)
        written_by = data.pop("version", None)
        if (written_by, data.get("match_window")) == _STORED_WINDOW_0_3_0 and \
                METHODS.get(data.get("method"), METHODS[DEFAULT_METHOD]).selection not in WINDOWED_SELECTIONS:
            del data["match_window"]  # that version's default, stored for a method it does not apply to
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            origin = (f" (these settings were written by hf_tokred {written_by}; this is hf_tokred {__version__}: "
                      "upgrade hf-tokred to read them)" if written_by not in (None, __version__) else "")
            raise ValueError(
                f"unknown token_reduction field(s) {unknown}; allowed fields: {', '.join(sorted(known))}{origin}"
            )
        return cls(**data)

    @classmethod
    def coerce(cls, value: "TokenReductionConfig | Mapping[str, Any]") -> "TokenReductionConfig":
        """Accept a config or a plain dict (as stored in ``config.json``)."""
        return value if isinstance(value, cls) else cls.from_dict(value)
