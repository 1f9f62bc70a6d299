"""`kerasmp check`: the precision hazards of a saved `.keras` model before
training (`kerasmp.check`); exit status 1 when one is an error."""

from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.loading import check_model_file
from kerasmp.apps.cli.loading import load_model
from kerasmp.apps.cli.loading import load_sample


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL", help="a .keras model file")
    parser.add_argument(
        "--sample", metavar="FILE",
        help="the sample batch of the traced checks: .npy (one input) or "
        ".npz (keyed by input name, or arr_0, arr_1, ... in input order); "
        "default: zeros, ones for masks, normal draws for floats")
    parser.add_argument(
        "--gpu", action="store_true",
        help="include GPU advice (tensor-core sizes, severity info) even "
        "when no GPU is visible")
    parser.add_argument("--json", action="store_true",
                        help="print the findings as JSON")


def run(args):
    modules = check_model_file(args.model, args.unsafe)
    sample = load_sample(args.sample) if args.sample else None
    model = load_model(args, args.model, modules)
    from kerasmp.debug.hazards import check

    report = check(model, x=sample, gpu=True if args.gpu else None)
    if args.json:
        print(report.to_json())
    else:
        print(report)
    return 1 if report.has_errors else 0


CHECK = Command(
    name="check",
    help="list the precision hazards of a saved .keras model before "
    "training",
    description="List the precision hazards of a saved .keras model "
    "(severity, layer, why, fix): normalizations, softmax, exp or log in "
    "float16, epsilons float16 cannot hold, half-precision variables and "
    "optimizer slots, weights beyond float16, inf/NaN from a float16 layer "
    "on a sample batch, half-precision outputs, a stock mixed policy; GPU "
    "tensor-core sizes with --gpu or when a GPU is visible. Exits 0 when no "
    "finding is an error, 1 otherwise (for CI). The file is loaded in "
    "Keras's safe mode; a file that would run code is refused.",
    add_arguments=add_arguments,
    run=run,
    loads_models=True,
)
