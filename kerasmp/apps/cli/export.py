"""`kerasmp export`: a `.keras` model in half precision (keras, savedmodel,
tflite, onnx, torch) with a parity report (`kerasmp.export`)."""

import json
import sys

from kerasmp._utils.requires import keras_backend
from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.base import UsageError
from kerasmp.apps.cli.base import cli_words
from kerasmp.apps.cli.base import nonnegative_float
from kerasmp.apps.cli.base import regex
from kerasmp.apps.cli.loading import check_model_file
from kerasmp.apps.cli.loading import import_keras
from kerasmp.apps.cli.loading import load_model
from kerasmp.apps.cli.loading import load_sample
from kerasmp.export.specs import EXPORT_DTYPES
from kerasmp.export.specs import FORMATS
from kerasmp.export.specs import IO_DTYPES
from kerasmp.export.specs import check_target


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL", help="a .keras model file")
    parser.add_argument(
        "out", metavar="OUT",
        help="output path: a .keras file (--format keras), a SavedModel "
        "folder (savedmodel), a .tflite file (tflite), a .onnx file (onnx) "
        "or a .pt2 file (torch)")
    parser.add_argument(
        "--format", choices=FORMATS, default="savedmodel",
        help="artifact format (default: savedmodel; tflite needs pip "
        "install kerasmp[tflite], onnx kerasmp[onnx]; savedmodel needs "
        "kerasmp[tensorflow] and KERAS_BACKEND=tensorflow or jax, torch (a "
        "torch.export .pt2) KERAS_BACKEND=torch)")
    parser.add_argument(
        "--dtype", choices=EXPORT_DTYPES, default="float16",
        help="weight dtype (default: float16; bfloat16 not for tflite/onnx; "
        "float32 for comparison)")
    parser.add_argument(
        "--sample", metavar="FILE",
        help="parity inputs: .npy (one input) or .npz (keyed by input name, "
        "or arr_0, arr_1, ... in input order); default: 512 draws that "
        "respect the model (token ids within the vocabulary, a front "
        "Rescaling/Normalization layer's range, else uniform [0, 1))")
    parser.add_argument(
        "--max-rel-diff", type=nonnegative_float, default=None, metavar="X",
        help="parity gate on max |difference| / range of the float32 "
        "output, per output: above X, exit 1 and write nothing (default "
        "0.02 for float16, 0.1 for bfloat16, 1e-4 for float32)")
    parser.add_argument(
        "--max-diff", type=nonnegative_float, default=None, metavar="X",
        help="also gate on the absolute max |difference| vs float32 "
        "(default: no absolute gate)")
    parser.add_argument(
        "--io-dtype", choices=IO_DTYPES, default="float32",
        help="dtype of the artifact's float inputs and outputs (savedmodel, "
        "tflite, onnx, torch; default float32)")
    parser.add_argument(
        "--keep-float32", action="append", default=None, metavar="REGEX",
        type=regex,
        help="keep layers whose name matches in float32 (repeatable; "
        "replaces the default softmax/normalization rules); or 'tune': "
        "the model's rules plus the fewest layers that pass the parity "
        "gate, found by kerasmp tune on the parity inputs")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing OUT")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON")


def _keep_float32(patterns):
    """`--keep-float32` as `export` takes it: the patterns, or "tune"
    alone."""
    if patterns and "tune" in patterns:
        if len(patterns) > 1:
            raise UsageError("--keep-float32 tune picks the layers itself: "
                             "give it alone, without name patterns")
        return "tune"
    return patterns


def run(args):
    keep_float32 = _keep_float32(args.keep_float32)
    try:
        check_target(args.out, args.format, args.overwrite, args.dtype,
                     backend=keras_backend(), io_dtype=args.io_dtype,
                     source=args.model)
    except (ValueError, TypeError, ImportError, OSError) as e:
        raise UsageError(cli_words(str(e))) from None
    modules = check_model_file(args.model, args.unsafe)
    sample = load_sample(args.sample) if args.sample else None
    import_keras(args.verbose, tensorflow_too=True)
    from kerasmp.export import ParityError
    from kerasmp.export import export

    model = load_model(args, args.model, modules)
    failed = None
    try:
        report = export(
            model, args.out, format=args.format, dtype=args.dtype,
            sample=sample, keep_float32=keep_float32,
            overwrite=args.overwrite, max_rel_diff=args.max_rel_diff,
            max_diff=args.max_diff, io_dtype=args.io_dtype, gate=True,
            verbose=bool(args.verbose))
    except ParityError as e:
        report, failed = e.report, e
    except (ValueError, TypeError, ImportError, FileExistsError) as e:
        if args.debug:
            raise
        raise UsageError(cli_words(str(e))) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    if failed is not None:
        print(f"kerasmp export: parity FAILED: {cli_words(str(failed))}",
              file=sys.stderr)
        return 1
    return 0


EXPORT = Command(
    name="export",
    help="export a .keras model in half precision (keras, savedmodel, "
    "tflite, onnx, torch) with a parity report",
    description="Export a .keras model in half precision and print a size "
    "and parity report against its float32 master weights. OUT is checked "
    "(suffix, --overwrite) before the model is loaded. If parity fails (max "
    "|diff| > --max-diff) the command exits 1 and leaves NOTHING at OUT (an "
    "existing OUT is kept as it was).",
    add_arguments=add_arguments,
    run=run,
    loads_models=True,
)
