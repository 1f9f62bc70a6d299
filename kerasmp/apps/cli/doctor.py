"""`kerasmp doctor`: this machine's mixed-precision support and the policy
to use (`kerasmp.doctor`)."""

import json

from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.base import UsageError
from kerasmp.apps.cli.loading import import_keras


def add_arguments(parser):
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON")
    parser.add_argument("--bench", metavar="FILE",
                        help="a `kerasmp bench --json` result measured on "
                        "this machine: recommend on those measurements")


def _read_bench(path):
    """The `kerasmp bench --json` result at `path` (`--bench`)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--bench {path}: cannot read it "
                         f"({e.strerror})") from None
    except ValueError:
        raise UsageError(f"--bench {path}: not a JSON file (write one with "
                         "`kerasmp bench --json FILE`)") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UsageError(f"--bench {path}: not a `kerasmp bench --json` "
                         "result (no \"rows\")")
    return data


def run(args):
    bench = None if args.bench is None else _read_bench(args.bench)
    import_keras(args.verbose)
    from kerasmp.apps.doctor import main

    return main(as_json=args.json, bench=bench)


DOCTOR = Command(
    name="doctor",
    help="report this machine's mixed-precision support and the policy to "
    "use",
    description="Versions, devices, and the policy to use on this machine, "
    "with the reason.",
    add_arguments=add_arguments,
    run=run,
)
