"""`kerasmp demo`: float32 vs mixed precision on the 8x8 digits, with
export (`kerasmp.apps.demo`)."""

import json

from kerasmp._utils.paths import check_output_folder
from kerasmp.apps.choices import DEMO_DEFAULT_EPOCHS
from kerasmp.apps.choices import DEMO_POLICIES
from kerasmp.apps.choices import DEMO_QUICK_EPOCHS
from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.base import UsageError
from kerasmp.apps.cli.base import cli_words
from kerasmp.apps.cli.base import int_at_least
from kerasmp.apps.cli.loading import import_keras


def add_arguments(parser):
    parser.add_argument(
        "--out", default="kerasmp-demo", metavar="DIR",
        help="folder for the artifacts (default: ./kerasmp-demo)")
    parser.add_argument(
        "--policy", choices=DEMO_POLICIES, default="mixed_float16",
        help="mixed policy to compare with float32 (default: mixed_float16)")
    parser.add_argument(
        "--epochs", type=int_at_least(1), default=None, metavar="N",
        help=f"epochs per run (default {DEMO_DEFAULT_EPOCHS}, "
        f"{DEMO_QUICK_EPOCHS} with --quick)")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        metavar="S", help="seed of both runs (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run for smoke tests")
    parser.add_argument(
        "--json", action="store_true",
        help="print the summary as JSON instead of the table")


def run(args):
    try:
        check_output_folder(args.out, "out")
    except (TypeError, ValueError) as e:
        raise UsageError(cli_words(str(e), path="--out")) from None
    import_keras(args.verbose, tensorflow_too=True)
    from kerasmp.apps.demo import run_demo

    try:
        summary = run_demo(out=args.out, policy=args.policy,
                           epochs=args.epochs, seed=args.seed,
                           quick=args.quick, verbose=not args.json)
    except (ValueError, TypeError, FileExistsError) as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


DEMO = Command(
    name="demo",
    help="train a small CNN on 8x8 digits in float32 and in mixed "
    "precision, compare, export",
    description="Train the same small CNN on the 8x8 digits shipped with "
    "kerasmp in float32 and in mixed precision, export the mixed model in "
    "half precision, and print the comparison. A rerun into the same --out "
    "replaces the demo's earlier artifacts there (and only those) once it "
    "is complete; an interrupted rerun leaves them as they were.",
    add_arguments=add_arguments,
    run=run,
)
