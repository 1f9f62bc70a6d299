"""`kerasmp tune`: the fewest layers of a saved `.keras` model to keep in
float32 for its outputs to come within a target of float32's
(`kerasmp.tune`); `--out` writes the model under the tuned policy."""

import os

from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.base import UsageError
from kerasmp.apps.cli.base import cli_words
from kerasmp.apps.cli.base import nonnegative_float
from kerasmp.apps.cli.loading import check_model_file
from kerasmp.apps.cli.loading import import_keras
from kerasmp.apps.cli.loading import load_model
from kerasmp.apps.cli.loading import load_sample


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL", help="a .keras model file")
    parser.add_argument(
        "--sample", metavar="FILE", required=True,
        help="the inputs the outputs are compared on: .npy (one input) or "
        ".npz (keyed by input name, or arr_0, arr_1, ... in input order)")
    parser.add_argument(
        "--target", type=nonnegative_float, default=1e-2, metavar="T",
        help="max |difference| / range of the float32 output to meet "
        "(default 0.01)")
    parser.add_argument(
        "--out", metavar="OUT", default=None,
        help="write the model under the tuned policy to this .keras file "
        "(written whole or not at all)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON")


def _check_out(out, overwrite):
    if out is None:
        return
    if not out.endswith(".keras"):
        raise UsageError(f"--out {out!r}: expected a .keras file")
    if os.path.exists(out) and not overwrite:
        raise UsageError(f"--out {out!r} exists; pass --overwrite to "
                         "replace it")


def run(args):
    _check_out(args.out, args.overwrite)
    modules = check_model_file(args.model, args.unsafe)
    sample = load_sample(args.sample)
    import_keras(args.verbose)
    from kerasmp.tune import tune

    model = load_model(args, args.model, modules)
    try:
        report = tune(model, sample, target=args.target)
    except (ValueError, TypeError) as e:
        if args.debug:
            raise
        raise UsageError(cli_words(str(e))) from None
    if args.out is not None:
        from kerasmp.export.publish import Staging

        report.apply(model)
        with Staging(args.out) as staging:
            staged = os.path.join(staging.dir, os.path.basename(args.out))
            model.save(staged)
            staging.publish(staged, args.overwrite)
    if args.json:
        print(report.to_json())
    else:
        print(report)
        if args.out is not None:
            print(f"wrote: {args.out}")
    return 0 if report.met else 1


TUNE = Command(
    name="tune",
    help="find the fewest layers of a .keras model to keep in float32 for "
    "an accuracy target",
    description="Find, by forward passes on --sample, the fewest layers of "
    "a saved .keras model to keep in float32 so that its outputs come "
    "within --target (max |diff| / range) of a float32 run of the same "
    "weights. Prints each kept layer with its error and FLOP share; --out "
    "writes the model under the tuned policy. Exits 0 when the target is "
    "met, 1 when no set of layers meets it (the report says why).",
    add_arguments=add_arguments,
    run=run,
    loads_models=True,
)
