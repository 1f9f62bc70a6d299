"""The `kerasmp` argument parser and the README reference generated from it.

`build_parser` adds each command of `COMMANDS` (one module each, beside
this one) with the options every command takes: `--verbose` and `--debug`,
and `--unsafe` for those that load model files. `markdown_reference` writes
the README's "Command line" section from it (`tests/apps/test_cli.py`
checks they agree).
"""

import argparse

from kerasmp.apps.cli.base import Parser
from kerasmp.apps.cli.bench import BENCH
from kerasmp.apps.cli.check import CHECK
from kerasmp.apps.cli.demo import DEMO
from kerasmp.apps.cli.doctor import DOCTOR
from kerasmp.apps.cli.export import EXPORT
from kerasmp.apps.cli.inspect import INSPECT
from kerasmp.apps.cli.tune import TUNE

COMMANDS = (DOCTOR, INSPECT, CHECK, TUNE, DEMO, EXPORT, BENCH)


def add_common(parser, default):
    """--verbose and --debug, accepted before or after the sub-command."""
    parser.add_argument(
        "--verbose", action="store_true", default=default,
        help="show TensorFlow's start-up logs (silenced by default unless "
        "TF_CPP_MIN_LOG_LEVEL is set)")
    parser.add_argument(
        "--debug", action="store_true", default=default,
        help="show Python tracebacks, also for user errors")


def add_unsafe(parser):
    """--unsafe, for the commands that load model files."""
    parser.add_argument(
        "--unsafe", action="store_true",
        help="load a model whose file names Python modules or holds "
        "lambdas: imports those modules and RUNS THE FILE'S CODE. Only for "
        "files you trust; without it such a file is refused")


def build_parser():
    """The `kerasmp` argument parser (standard library only).

    Returns:
        A `Parser` (an `argparse.ArgumentParser`); `parser.commands` maps
        each command's name to its sub-parser, whose defaults hold the
        command's `run`.

    Example:

    >>> args = build_parser().parse_args(["demo", "--quick"])
    >>> args.command, args.epochs, args.quick
    ('demo', None, True)
    """
    parser = Parser(
        prog="kerasmp",
        description="Mixed-precision training for Keras 3: correct, "
        "observable, exportable.",
        epilog="User errors exit with status 2 and print one line; "
        "`kerasmp COMMAND --help` for each command's options.",
    )
    add_common(parser, False)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help,
                           description=command.description)
        command.add_arguments(p)
        if command.loads_models:
            add_unsafe(p)
        add_common(p, argparse.SUPPRESS)
        p.set_defaults(run=command.run)
        parser.commands[command.name] = p
    return parser


def markdown_reference():
    """The README's "Command line" reference, generated from the parser.

    Returns:
        Markdown text: the options every command takes, then one entry per
        sub-command with its usage and each of its options.
    """
    parser = build_parser()
    common = {"-h", "--help", "--verbose", "--debug"}
    lines = ["Every command also takes `--verbose` and `--debug`:", ""]
    for action in parser.arguments:
        if set(action.option_strings) & {"--verbose", "--debug"}:
            lines.append(f"- `{action.option_strings[0]}`: "
                         + " ".join(action.help.split()))
    lines.append("")
    for command in COMMANDS:
        sub = parser.commands[command.name]
        usage = " ".join(sub.format_usage().split())
        usage = usage.replace("usage: ", "")
        for flag in common:
            usage = usage.replace(f" [{flag}]", "")
        lines.append(f"- `{usage}`: {command.help}.")
        for action in sub.arguments:
            if set(action.option_strings) & common:
                continue
            flag = (", ".join(action.option_strings)
                    or (action.metavar or action.dest))
            text = " ".join(action.help.split())
            if action.choices and action.option_strings:
                text += f" (one of: {', '.join(action.choices)})"
            lines.append(f"  - `{flag}`: {text}")
    return "\n".join(lines) + "\n"
