"""The ``hf-tokred`` command: one module per subcommand, one error policy (:mod:`.common`).

Exit codes: 0 success, 2 bad usage or invalid settings (one line naming the flag), 1 a model or file that cannot
be found or read (one line).  ``-v`` shows library logs, progress bars and full tracebacks.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, convert, eval, generate, push, report, schedule
from .common import ArgumentParser, UsageError, cli_wording, quiet_libraries

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

#: modules whose ``add_parser(subparsers)`` registers subcommands, in help order
COMMANDS = (generate, schedule, bench, eval, report, push, convert)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="hf-tokred",
        description="Token reduction for Hugging Face Mamba / Mamba-2 / Falcon Mamba models (UTRC and baselines).",
        epilog="Example: hf-tokred generate --model bundled:mamba --flops-reduction 0.2",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show library logs, progress bars and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, so the line names the subcommand and its --help
        parser._subparsers._group_actions[0].choices[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if not args.verbose:
        quiet_libraries()
    try:
        return args.func(args)
    except UsageError as err:
        return _fail(args, err, 2)
    except (FileNotFoundError, OSError) as err:  # a model or data file that cannot be found or read
        if args.verbose:
            raise
        return _fail(args, err, 1)
    except (ValueError, TypeError) as err:  # invalid input found deeper down (settings, shapes, lengths)
        if args.verbose:
            raise
        return _fail(args, err, 2)


def _fail(args: argparse.Namespace, err: Exception, code: int) -> int:
    """One line on stderr (the first line of the message, settings named as flags); ``code`` is the exit code."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    print(f"hf-tokred {args.command}: error: {cli_wording(text)}", file=sys.stderr)
    return code
