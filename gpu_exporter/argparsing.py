"""The command line's parser class: a mistake is one line and a hint, never a usage screen.

argparse prints 10–14 lines of usage before the one line that says what is wrong, and an
unknown flag after a subcommand is reported by the top-level parser with the top-level
usage. :class:`Parser` (for the top parser and, through ``parser_class=``, every subparser)
prints ``gpu-exporter choose: error: …`` and ``try 'gpu-exporter choose --help'``, exit 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

EXIT_USAGE = 2
T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line plus a pointer to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\ntry '{self.prog} --help'\n")


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` from a parser whose ValueError says what is wrong, as it says it."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown argument after a subcommand is reported by
    that subcommand's parser (argparse leaves it to the top one), naming the subcommand."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser_of(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def parser_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The subcommand's parser that parsed ``args`` (``parser`` itself when there is none)."""
    for action in parser._actions:  # argparse keeps no public list of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            command = getattr(args, action.dest, None)
            if isinstance(command, str) and command in action.choices:
                chosen: argparse.ArgumentParser = action.choices[command]
                return chosen
    return parser
