"""What every ``hf-tokred`` command shares: the error policy, the reduction and model flags, loading a model.

Error policy: a user mistake raises :class:`UsageError` (the command prints one line naming the flag and exits
2; so does a bad flag value, through :class:`ArgumentParser`); a model or file that cannot be found or read exits 1
with one line; ``-v`` shows tracebacks instead.  :func:`cli_wording` names the flags where a library message names
Python settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re

import tqdm
from transformers.utils import logging as hf_logging

from ..config import (DEFAULT_MATCH_WINDOW, DEFAULT_METHOD, LONG_CONTEXT_METHOD, METHODS, METRICS, STRATEGIES,
                      TokenReductionConfig)
from ..models import check_model_spec, load_model
from ..settings import apply_token_reduction

__all__ = ["LEVEL_FLAGS", "REFINING_FLAGS", "ArgumentParser", "UsageError", "add_model_argument",
           "add_reduction_arguments", "cli_wording", "given_reduction_flags", "load_for_command", "positive", "positive_int_text",
           "quiet_libraries", "reduction_from_args"]

#: The flags that set a reduction level: a reducing run needs one (TokenReductionConfig's level fields).
LEVEL_FLAGS = ("--flops-reduction", "--keep-ratio", "--keep-tokens")
#: The flags that refine a level; given without one they are refused (they would change nothing).
REFINING_FLAGS = ("--method", "--anchors", "--metric", "--q", "--hidden-strategy", "--residual-strategy",
                  "--protect-recent", "--match-window")


class UsageError(Exception):
    """A user mistake the command reports with exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (``PROG: error: MESSAGE (see PROG --help)``, exit 2), no usage block; the
    subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _field(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


_FIELDS = tuple(f.name for f in dataclasses.fields(TokenReductionConfig))


def cli_wording(message: str) -> str:
    """A library message with the settings it names as the command's flags: ``TokenReductionConfig.keep_ratio`` and
    ``keep_ratio`` -> ``--keep-ratio``, ``anchors=[...]`` -> ``--anchors A,B,...``, ``metric='delta'`` -> ``--metric
    delta`` (plain words such as "anchors" stay)."""
    for name in _FIELDS:
        flag = "--" + name.replace("_", "-")
        message = message.replace(f"TokenReductionConfig.{name}", flag).replace(f"{name}=[...]", f"{flag} A,B,...")
        message = re.sub(rf"(?<![\w.-]){name}='([^']*)'", rf"{flag} \1", message)
        message = re.sub(rf"(?<![\w.-]){name}=", f"{flag} ", message)
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}\b", flag, message)
    return message


def add_reduction_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The flags that build a TokenReductionConfig, shared by every subcommand (unset flags stay ``None``)."""
    g = parser.add_argument_group("token reduction", f"give a level ({' or '.join(LEVEL_FLAGS)}) to reduce; the "
                                                     "flags replace a model's saved settings as a whole")
    g.add_argument("--method", choices=sorted(METHODS), default=None, help=f"reduction method (default: {DEFAULT_METHOD}; {LONG_CONTEXT_METHOD} with --keep-tokens)")
    g.add_argument("--flops-reduction", type=float, default=None, help="target FLOPs reduction, e.g. 0.2")
    g.add_argument("--keep-ratio", type=float, default=None, help="per-anchor keep ratio (instead of a FLOPs target)")
    g.add_argument("--keep-tokens", type=int, default=None,
                   help="token budget: blocks after the last anchor process at most this many tokens per sequence "
                        "(instead of a ratio; shorter prompts are not reduced)")
    g.add_argument("--anchors", type=str, default=None, help="comma-separated anchor layers, e.g. 12,17,22")
    g.add_argument("--metric", choices=sorted(METRICS), default=None,
                   help="importance metric (default: the method's own; clip for the paper's methods)")
    g.add_argument("--q", type=float, default=None, help="pruned share in the hybrid strategy (default: 0.5)")
    g.add_argument("--hidden-strategy", choices=sorted(STRATEGIES), default=None, help="override (ablations)")
    g.add_argument("--residual-strategy", choices=sorted(STRATEGIES), default=None, help="override (ablations)")
    g.add_argument("--protect-recent", type=float, default=None,
                   help="share of each sequence's most recent tokens that are never removed (default: 0)")
    g.add_argument("--match-window", type=int, default=None,
                   help="similarity-matching methods: destinations searched per candidate, near it "
                        f"(0: exact global matching; default: {DEFAULT_MATCH_WINDOW})")


def given_reduction_flags(args: argparse.Namespace) -> list[str]:
    """The reduction flags given on the command line, levels first."""
    return [flag for flag in LEVEL_FLAGS + REFINING_FLAGS if getattr(args, _field(flag), None) is not None]


def reduction_from_args(args: argparse.Namespace):
    """A TokenReductionConfig from the shared flags, or ``None`` when none is given (the model as it is saved)."""
    given = given_reduction_flags(args)
    if not any(flag in LEVEL_FLAGS for flag in given):
        if given:
            raise UsageError(f"{'/'.join(given)} {'needs' if len(given) == 1 else 'need'} a reduction level: add "
                             f"{' or '.join(LEVEL_FLAGS)} (e.g. --flops-reduction 0.2; the flags replace a model's saved settings "
                             "as a whole)")
        return None
    fields = {_field(flag): getattr(args, _field(flag)) for flag in given}
    if "anchors" in fields:
        try:
            fields["anchors"] = [int(a) for a in fields["anchors"].split(",")]
        except ValueError:
            raise UsageError(f"--anchors must be comma-separated integers, got {args.anchors!r}") from None
    try:
        return TokenReductionConfig(**fields)
    except (TypeError, ValueError) as err:
        raise UsageError(cli_wording(str(err))) from None


def add_model_argument(parser: argparse.ArgumentParser, default: str = "bundled:mamba") -> None:
    parser.add_argument("--model", default=default,
                        help="bundled:mamba | bundled:mamba2 | random:<family>-<size> (e.g. random:mamba-130m) | "
                             f"a local folder or Hub id (default: {default})")


def load_for_command(spec: str, cfg=None, **kwargs):
    """``(model, tokenizer)`` for ``--model``: with ``cfg`` applied, else with the settings saved in the model's
    config (if any).  User mistakes become UsageError naming the flag (an unknown spec or a missing folder:
    --model; settings that do not fit the model: the reduction flags)."""
    try:
        check_model_spec(spec)
        model, tok = load_model(spec, **kwargs)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--model {spec}: {err}") from None
    if cfg is not None:
        try:
            apply_token_reduction(model, cfg)
        except (TypeError, ValueError) as err:
            raise UsageError(f"--flops-reduction/--keep-ratio/--keep-tokens/--anchors for --model {spec}: {cli_wording(str(err))}") \
                from None
    return model, tok


def positive(flag: str, value: int | None, example: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {value} (e.g. {flag} {example})")


def positive_int_text(flag: str, value, example: str) -> int | None:
    """A positive integer given as text (``None`` stays ``None``)."""
    if value is None:
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1 or str(n) != str(value).strip():
        raise UsageError(f"{flag} must be a positive integer, got {value!r} (e.g. {flag} {example})")
    return n


def quiet_libraries() -> None:
    """Commands keep stderr for what they have to say: no weight-loading bars, no library info/warnings."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    init = tqdm.tqdm.__init__
    if not getattr(init, "_hf_tokred_quiet", False):  # lm-eval's and our own progress bars (even disable=False)

        @functools.wraps(init)
        def quiet(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "disable": True})

        quiet._hf_tokred_quiet = True
        tqdm.tqdm.__init__ = quiet
