"""Command-line parsers whose argument errors are one line: ``prog: error: message``, exit status 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

Value = TypeVar("Value")


def command_name() -> str:
    """The command as the user typed it, for its error lines: ``export.py``, or ``poet-hf export`` (argparse's own
    ``prog``)."""
    return os.path.basename(sys.argv[0])


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that reports an invalid argument in one line naming it, with exit status 2.

    argparse prints its usage block first; a training script's lists every ``TrainingArguments`` flag, a hundred lines
    above the one that says what is wrong. ``--help`` still prints the usage.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def option_type(convert: Callable[[str], Value]) -> Callable[[str], Value]:
    """``convert`` as an argparse ``type`` whose ``ValueError`` message is the error line (argparse's own line would
    say only ``invalid convert value``, without the values allowed)."""

    def parse(text: str) -> Value:
        try:
            return convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    parse.__name__ = convert.__name__
    return parse
