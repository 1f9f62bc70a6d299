"""`kerasmp bench`: steps/s and memory of each policy on this device
(`kerasmp.apps.bench`)."""

import contextlib
import json
import os
import tempfile

from kerasmp._utils.paths import check_output
from kerasmp.apps.choices import BENCH_MODELS
from kerasmp.apps.choices import BENCH_POLICIES
from kerasmp.apps.choices import BENCH_PRESETS
from kerasmp.apps.cli.base import Command
from kerasmp.apps.cli.base import UsageError
from kerasmp.apps.cli.base import cli_words
from kerasmp.apps.cli.base import int_at_least
from kerasmp.apps.cli.loading import check_model_file
from kerasmp.apps.cli.loading import import_keras
from kerasmp.apps.cli.loading import load_model
from kerasmp.apps.cli.loading import load_sample


def add_arguments(parser):
    parser.add_argument(
        "--quick", action="store_true",
        help="the 'quick' preset: tiny models, few steps (under two minutes "
        "on a CPU; a smoke test, no guide to a real model's speed: the "
        "'cpu' preset is)")
    parser.add_argument(
        "--preset", choices=tuple(BENCH_PRESETS), default=None,
        help="model sizes, steps and repeats (default: 'default', or "
        "'quick' with --quick)")
    parser.add_argument(
        "--models", nargs="+", choices=BENCH_MODELS, default=None,
        metavar="MODEL", help="models to run (default: all of the preset's)")
    parser.add_argument(
        "--policies", nargs="+", choices=BENCH_POLICIES,
        default=None, metavar="POLICY",
        help="policies to compare; ratios are relative to the first "
        "(default: float32 mixed_bfloat16 on a CPU, where float16 has no "
        "fast kernels; float32 mixed_float16 mixed_bfloat16 on a GPU)")
    parser.add_argument("--steps", type=int_at_least(2), default=None,
                        metavar="N", help="steps per timed call (>= 2)")
    parser.add_argument("--repeats", type=int_at_least(1), default=None,
                        metavar="N",
                        help="timed calls per model and policy")
    parser.add_argument("--batch-size", type=int_at_least(1), default=None,
                        metavar="N", help="batch size of every model")
    parser.add_argument(
        "--model", metavar="FILE", default=None,
        help="time your own .keras model instead of the presets' (rebuilt "
        "under each policy, its weights copied; the loss is a stand-in, "
        "the mean squared output)")
    parser.add_argument(
        "--sample", metavar="FILE", default=None,
        help="with --model: its inputs, .npy (one input) or .npz (keyed by "
        "input name, or arr_0, arr_1, ... in input order), repeated to fill "
        "the steps; default: draws that respect the model, as export's")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the result as JSON to PATH")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --json PATH")


def _preset(args):
    """The preset to run, checked against --quick and --models."""
    preset = args.preset or ("quick" if args.quick else "default")
    if args.quick and args.preset not in (None, "quick"):
        raise UsageError(f"--quick conflicts with --preset {args.preset}; "
                         "pass one of them")
    models = tuple(BENCH_PRESETS[preset]["models"])
    unknown = [m for m in args.models or () if m not in models]
    if unknown:
        raise UsageError(f"--models {' '.join(unknown)}: the {preset!r} "
                         f"preset has {', '.join(models)}")
    return preset


def _write_json(path, obj):
    """Writes `obj` as JSON atomically (a temporary file, then a rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kerasmp-", suffix=".json",
                               dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _check_model_args(args):
    """The checks of --model and --sample, before anything is loaded."""
    if args.model is None:
        if args.sample is not None:
            raise UsageError("--sample needs --model: the presets' models "
                             "make their own inputs")
        return None
    given = [flag for flag, value in (
        ("--quick", args.quick), ("--preset", args.preset),
        ("--models", args.models)) if value]
    if given:
        raise UsageError(f"--model times your model; {' and '.join(given)} "
                         "choose the presets' models: pass one of them")
    modules = check_model_file(args.model, args.unsafe, what="--model")
    sample = None if args.sample is None else load_sample(args.sample)
    return modules, sample


def _run_model(args, checked, on_progress):
    modules, sample = checked
    from kerasmp.apps.bench_model import run_model_bench

    model = load_model(args, args.model, modules)
    steps = 10 if args.steps is None else args.steps
    repeats = 3 if args.repeats is None else args.repeats
    result = run_model_bench(
        model, sample, policies=args.policies, steps=steps,
        repeats=repeats, batch_size=args.batch_size,
        label=os.path.basename(args.model))
    return result


def run(args):
    checked = _check_model_args(args)
    preset = None if checked else _preset(args)
    if args.policies and len(set(args.policies)) != len(args.policies):
        raise UsageError(f"--policies {' '.join(args.policies)}: expected "
                         "distinct policies")
    if args.json is not None:
        try:
            check_output(args.json, args.overwrite)
        except (TypeError, ValueError, OSError) as e:
            raise UsageError(cli_words(str(e), path="--json")) from None
    import_keras(args.verbose, tensorflow_too=True)
    from kerasmp.apps.bench import format_table
    from kerasmp.apps.bench import run_bench

    on_progress = None
    if args.json:
        # Partial results are saved after every row, so an interrupted
        # run keeps what it measured ("complete": false).
        def on_progress(partial):
            _write_json(args.json, partial)

    try:
        if checked:
            result = _run_model(args, checked, on_progress)
        else:
            result = run_bench(
                preset, models=args.models, policies=args.policies,
                steps=args.steps, repeats=args.repeats,
                batch_size=args.batch_size, on_progress=on_progress)
    except (ValueError, TypeError) as e:
        if args.debug:
            raise
        raise UsageError(" ".join(str(e).split())) from None
    print()
    print(format_table(result))
    if args.json:
        _write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


BENCH = Command(
    name="bench",
    help="steps/s and memory of float32 vs mixed precision on this device",
    description="Train a small model zoo (or your own model, --model) for a "
    "few steps under each policy and report steps/s and memory. --json "
    "PATH is checked before the benchmark starts and rewritten after every "
    "model and policy, so an interrupted run keeps its partial results.",
    add_arguments=add_arguments,
    run=run,
    loads_models=True,
)
