"""The `kerasmp` command: doctor, inspect, check, demo, export, bench.

Start-up is cheap: the modules of this package import only the standard
library (and Keras-free kerasmp modules), so `kerasmp --help`, every
sub-command's `--help` and every argument error return without importing
Keras, TensorFlow or JAX. A command imports them once its arguments are
valid, with TensorFlow's C++/absl start-up logs silenced unless `--verbose`
is given or `TF_CPP_MIN_LOG_LEVEL` is set.

User errors (a missing, unreadable or wrong kind of file, a bad flag value,
an unwritable or existing output, a framework the command needs that is not
installed) print one line naming the file or flag and
what was expected, exit with status 2 and write nothing. Output paths and
their suffixes are checked before any model is loaded. A traceback means a
bug in kerasmp: without `--debug` it is summarized in one line (exit 1);
`--debug` shows it, and the traceback of user errors too.

Saved models are loaded in Keras's safe mode, and a `.keras` file whose
config names a module outside Keras/kerasmp, or holds a Python lambda, is
refused before anything is loaded, unless `--unsafe` is given (which imports
the modules the file names and runs its code: only for files you trust).

- `parser.py`: `build_parser`, the options every command takes and the
  README's generated reference (`markdown_reference`),
- one module per command (`doctor.py`, `inspect.py`, `check.py`, `demo.py`,
  `export.py`, `bench.py`): its arguments and its handler,
- `loading.py`: Keras's import, model-file checks and loading, samples,
- `base.py`: `UsageError`, `Command`, argument types, `cli_words`.
"""

import difflib
import os
import sys

from kerasmp._utils.requires import NeedsExtra
from kerasmp._utils.warn import once_each
from kerasmp.apps.cli.base import UsageError
from kerasmp.apps.cli.parser import build_parser
from kerasmp.apps.cli.parser import markdown_reference

__all__ = ["build_parser", "main", "markdown_reference"]


def _unrecognized(sub, extra):
    """The error for unknown arguments, with a near miss of `sub`'s."""
    options = [o for a in sub.arguments for o in a.option_strings]
    message = "unrecognized arguments: " + " ".join(extra)
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=")[0], options, 1)
            if close:
                message += f" (did you mean {close[0]}?)"
                break
    return message


def _silence_stdout():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (tests)
        pass


def main(argv=None):
    """Runs the `kerasmp` command; returns the exit status.

    Args:
        argv: The arguments (defaults to `sys.argv[1:]`).

    Returns:
        0 on success; 1 for a failed check or parity gate, or a bug; 2 for
        a user error; 130 when interrupted; 141 when stdout was closed.

    Example:

    >>> main(["doctor", "--json"])
    0
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Name the subcommand's help, not the top-level one, and a near miss.
        sub = parser.commands[args.command]
        sub.error(_unrecognized(sub, extra))
    prog = f"kerasmp {args.command}"
    try:
        with once_each():  # a load, rebuild or parity run warns again
            status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        # `kerasmp ... | head`: the reader has gone. Stop quietly, as Unix
        # tools do, and keep Python from complaining when it flushes stdout
        # at exit.
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for `cat | head`
    except (UsageError, NeedsExtra) as e:
        # NeedsExtra: a framework the command needs is not installed (one
        # line naming the `pip install "kerasmp[...]"` extra).
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        message = " ".join(str(e).split())[:300]
        print(f"{prog}: internal error: {type(e).__name__}: {message} (a "
              "kerasmp bug: rerun with --debug for the traceback, and "
              "please report it)", file=sys.stderr)
        return 1
