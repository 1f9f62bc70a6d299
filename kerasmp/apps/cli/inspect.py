"""`kerasmp inspect`: the per-layer dtype report of a saved `.keras` model
(`kerasmp.policy.report.dtype_report`)."""

import json

from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.loading import check_model_file
from kerasmp.apps.cli.loading import load_model


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL", help="a .keras model file")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON")


def run(args):
    modules = check_model_file(args.model, args.unsafe)
    model = load_model(args, args.model, modules)
    from kerasmp.policy.report import dtype_report

    report = dtype_report(model, from_file=True)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report)
    return 0


INSPECT = Command(
    name="inspect",
    help="print the per-layer dtype report of a saved .keras model",
    description="Print the per-layer dtype report (compute and variable "
    "dtype, and why) of a saved .keras model. The file is loaded in Keras's "
    "safe mode; a file that would run code is refused.",
    add_arguments=add_arguments,
    run=run,
    loads_models=True,
)
