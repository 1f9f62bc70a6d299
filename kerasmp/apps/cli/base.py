"""What every `kerasmp` command module uses (standard library only).

`UsageError` (a user error: one line, exit status 2), `Command` (a
sub-command: its name, help, arguments and handler), `Parser` (argparse with
one-line errors and its arguments and sub-commands listed), the argument
types checked while parsing, and `cli_words` (an error message of the
Python API in the command's words).
"""

import argparse
import dataclasses
import math
import re
import typing


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One `kerasmp` sub-command.

    Attributes:
        name: What the user types after `kerasmp`.
        help: One line for `kerasmp --help` and the README.
        description: The paragraph of `kerasmp NAME --help`.
        add_arguments: `add_arguments(parser)` adds the command's own
            arguments to its parser.
        run: `run(args)` checks the arguments (raising `UsageError`) before
            it imports Keras, then runs the command; returns the exit
            status.
        loads_models: Whether it loads `.keras` files (and so takes
            `--unsafe`).
    """

    name: str
    help: str
    description: str
    add_arguments: typing.Callable
    run: typing.Callable
    loads_models: bool = False


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit status 2).

    It lists what was added to it: `arguments` (the actions of
    `add_argument`, in order) and `commands` (sub-command name: its
    `Parser`, filled by `build_parser`).
    """

    def __init__(self, *args, **kwargs):
        self.arguments = []  # before argparse adds -h/--help
        self.commands = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.arguments.append(action)
        return action

    def error(self, message):
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see "
                     f"'{self.prog} --help')\n")


# --------------------------------------------------------------------------
# argument types: checked while parsing, before anything is imported
# --------------------------------------------------------------------------


def int_at_least(low):
    """An argument type: an integer >= `low`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def nonnegative_float(text):
    """An argument type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0, got {text!r}")
    return value


def regex(text):
    """An argument type: a regular expression (returned as text)."""
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(
            f"expected a regular expression, got {text!r} ({e})") from None
    return text


# --------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------


def cli_words(message, path="OUT"):
    """An error message of the Python API in the command's words.

    Args:
        message: The message, naming the API's arguments (`path`,
            `format=...`, `overwrite=True`, ...).
        path: What the command calls the API's `path` or `out` argument
            (`"OUT"`, `"--json"`, `"--out"`).

    Returns:
        The message on one line, naming the command's flags instead.

    Example:

    >>> cli_words("`path` 'm.keras' already exists; pass overwrite=True "
    ...           "to replace it.")
    "OUT 'm.keras' already exists; pass --overwrite to replace it."
    """
    message = " ".join(message.split())
    return (message.replace("pass overwrite=True", "pass --overwrite")
            .replace("`path`", path).replace("`out`", path)
            .replace("`format`", "--format").replace("`dtype`", "--dtype")
            .replace("`io_dtype`", "--io-dtype")
            .replace("max_rel_diff=", "--max-rel-diff ")
            .replace("max_diff=", "--max-diff ")
            .replace("format=", "--format ")
            .replace("pass real inputs with `sample=` (`kerasmp export "
                     "--sample FILE.npy|.npz`)",
                     "pass real inputs with --sample FILE.npy|.npz"))
