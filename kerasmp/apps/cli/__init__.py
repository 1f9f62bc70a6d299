"""The `kerasmp` command: doctor, inspect, check, demo, export, bench.

Start-up is cheap: this module imports only the standard library, so
`kerasmp --help`, every sub-command's `--help` and every argument error
return without importing Keras, TensorFlow or JAX. The heavy imports happen
once the arguments are valid, with TensorFlow's C++/absl start-up logs
silenced unless `--verbose` is given or `TF_CPP_MIN_LOG_LEVEL` is set.

User errors (a missing, unreadable or wrong kind of file, a bad flag value,
an unwritable or existing output) print one line naming the file or flag and
what was expected, exit with status 2 and write nothing. Output paths and
their suffixes are checked before any model is loaded. A traceback means a
bug in kerasmp: without `--debug` it is summarized in one line (exit 1);
`--debug` shows it, and the traceback of user errors too.

Saved models are loaded in Keras's safe mode, and a `.keras` file whose
config names a module outside Keras/kerasmp, or holds a Python lambda, is
refused before anything is loaded, unless `--unsafe` is given (which imports
the modules the file names and runs its code: only for files you trust).

The README's "Command line" section is generated from this parser
(`markdown_reference()`; `tests/test_cli.py` checks they agree).

Length: one argparse parser for six sub-commands, their argument checks
and the generated README reference; kept in one module because it must
import only the standard library (the sub-commands' code lives in
`kerasmp/doctor.py`, `kerasmp/export/api.py`, and `demo.py` and `bench.py`
beside this module in `kerasmp/apps/`).
"""

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import zipfile

from kerasmp.export.specs import SPECS

# Choices and defaults of the sub-commands. The export formats come from
# their Keras-free specs; the others mirror constants of `kerasmp.apps.demo`,
# `kerasmp.export` and `kerasmp.apps.bench`, which import Keras, so the
# parser keeps its own copies; tests/test_cli.py checks they agree.
DEMO_POLICIES = ("mixed_float16", "mixed_bfloat16")
DEMO_DEFAULT_EPOCHS = 12
DEMO_QUICK_EPOCHS = 2
EXPORT_FORMATS = tuple(SPECS)
EXPORT_DTYPES = ("float16", "bfloat16", "float32")
EXPORT_SUFFIXES = {n: s.suffix for n, s in SPECS.items() if s.suffix}
ONNX_PACKAGES = SPECS["onnx"].packages
BENCH_MODELS = ("mlp", "cnn", "transformer")
BENCH_POLICIES = ("float32", "float32_highest", "mixed_float16",
                  "mixed_bfloat16", "float8_mixed_bfloat16")
BENCH_DEFAULT_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
BENCH_PRESET_MODELS = {
    "quick": ("mlp", "cnn", "transformer"),
    "default": ("mlp", "cnn", "transformer"),
    "gpu": ("transformer",),
    "smoke": ("transformer",),
}

# Top-level packages a `.keras` config may name without --unsafe: Keras
# itself (which imports only these) and kerasmp.
SAFE_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp", "kerasmp",
                 "builtins")


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit status 2)."""

    def error(self, message):
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see "
                     f"'{self.prog} --help')\n")


# --------------------------------------------------------------------------
# argument types: checked while parsing, before anything is imported
# --------------------------------------------------------------------------


def _int_at_least(low):
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


def _nonnegative_float(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0, got {text!r}")
    return value


def _regex(text):
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(
            f"expected a regular expression, got {text!r} ({e})") from None
    return text


# --------------------------------------------------------------------------
# file checks (cheap: no Keras)
# --------------------------------------------------------------------------


def _keras_backend():
    """The backend Keras will use, read as Keras reads it (no import)."""
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    backend = os.environ.get("KERAS_BACKEND")
    if backend:
        return backend
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json"), encoding="utf-8") as f:
            return json.load(f).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def _read_keras_config(path, what):
    """Checks `path` is a readable `.keras` file; returns its config dict."""
    if not os.path.lexists(path):
        raise UsageError(f"{what} {path!r}: no such file (expected a .keras "
                         "model file)")
    if os.path.isdir(path):
        kind = ("a SavedModel folder" if os.path.exists(
            os.path.join(path, "saved_model.pb")) else "a folder")
        raise UsageError(f"{what} {path!r} is {kind}; expected a .keras "
                         "model file")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise UsageError(f"{what} {path!r}: cannot read it "
                         f"({e.strerror or e})") from None
    suffix = os.path.splitext(path)[1].lower()
    if head[4:8] == b"TFL3" or suffix == ".tflite":
        kind = "a TFLite model"
    elif suffix == ".onnx":
        kind = "an ONNX model"
    elif head.startswith(b"\x89HDF"):
        kind = "an HDF5 file (legacy Keras .h5)"
    else:
        kind = "not a .keras file (a zip archive with config.json)"
    if not head.startswith(b"PK"):
        raise UsageError(f"{what} {path!r} is {kind}; expected a .keras "
                         "model file")
    try:
        with zipfile.ZipFile(path) as z:
            config = json.loads(z.read("config.json"))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError):
        raise UsageError(f"{what} {path!r} is not a .keras file (a zip "
                         "archive with config.json); expected a .keras "
                         "model file") from None
    if not isinstance(config, dict):
        raise UsageError(f"{what} {path!r}: its config.json is not a Keras "
                         "model config")
    return config


def unsafe_contents(config):
    """What in a `.keras` config would import or run code when loaded.

    Args:
        config: The parsed `config.json` of a `.keras` file.

    Returns:
        A list of `(kind, name)`: `("module", "pkg.mod")` for every module
        outside `SAFE_PACKAGES` the config names that is not imported yet
        (Keras would not import it, but a `from_config` may; one already
        imported, as when `kerasmp.apps.cli.main` runs in the process that
        defined the class, runs no new code), `("lambda", layer name)` for
        `Lambda` layers and `("lambda", "__lambda__")` for other lambdas.
    """
    found = []

    def visit(obj):
        if isinstance(obj, dict):
            module = obj.get("module")
            if isinstance(module, str) and module:
                if (module.split(".")[0] not in SAFE_PACKAGES
                        and module not in sys.modules):
                    found.append(("module", module))
            if obj.get("class_name") == "Lambda":
                inner = obj.get("config")
                name = inner.get("name") if isinstance(inner, dict) else None
                found.append(("lambda", name or "Lambda"))
                return
            if obj.get("class_name") == "__lambda__":
                found.append(("lambda", "__lambda__"))
            for value in obj.values():
                visit(value)
        elif isinstance(obj, list):
            for value in obj:
                visit(value)

    visit(config)
    unique = []
    for item in found:
        if item not in unique:
            unique.append(item)
    return unique


def _check_model_file(path, unsafe, what="MODEL"):
    """Checks a model path; returns the modules to import with --unsafe."""
    config = _read_keras_config(path, what)
    found = unsafe_contents(config)
    if found and not unsafe:
        kind, name = found[0]
        if kind == "module":
            what_runs = f"names the Python module {name!r}"
        else:
            what_runs = ("holds Python code (a lambda"
                         + ("" if name == "__lambda__" else f" in {name!r}")
                         + ")")
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UsageError(
            f"{what} {path!r} {what_runs}{more}; loading it would run that "
            "code, so it is refused (pass --unsafe only if you trust the "
            "file)")
    return [name for kind, name in found if kind == "module"]


def _check_output(path, what, overwrite, fmt=None, source=None):
    """Checks an output path before any work; raises UsageError.

    The folder it goes in must exist and be writable; an existing path is
    refused without --overwrite.
    """
    if not path:
        raise UsageError(f"{what}: expected a non-empty path")
    if fmt in EXPORT_SUFFIXES and not path.endswith(EXPORT_SUFFIXES[fmt]):
        raise UsageError(
            f"{what} {path!r} must end in {EXPORT_SUFFIXES[fmt]!r} for "
            f"--format {fmt}")
    if fmt == "savedmodel":
        for ext in EXPORT_SUFFIXES.values():
            if path.endswith(ext):
                raise UsageError(
                    f"{what} {path!r} ends in {ext!r}, but --format "
                    "savedmodel writes a folder: name the folder, or pass "
                    f"--format {ext[1:]}")
    if source is not None and os.path.exists(path) and os.path.samefile(
            path, source):
        raise UsageError(f"{what} {path!r} is the input model; choose "
                         "another output path")
    if os.path.lexists(path):
        if not overwrite:
            raise UsageError(f"{what} {path!r} already exists; pass "
                             "--overwrite to replace it")
        if fmt is None and os.path.isdir(path):
            raise UsageError(f"{what} {path!r} is a folder; expected a file "
                             "path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        kind = "is not a folder" if os.path.exists(parent) else (
            "does not exist")
        raise UsageError(f"{what} {path!r}: its folder {parent!r} {kind}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path!r}: cannot write in {parent!r} "
                         "(permission denied)")


def _load_sample(path):
    """Loads `--sample`: a .npy array or a .npz of arrays; never pickles."""
    if not os.path.isfile(path):
        raise UsageError(
            f"--sample {path!r}: " + ("is a folder" if os.path.isdir(path)
                                      else "no such file")
            + "; expected a .npy or .npz file")
    import numpy as np

    try:
        data = np.load(path, allow_pickle=False)
    except PermissionError as e:
        raise UsageError(f"--sample {path!r}: cannot read it "
                         f"({e.strerror})") from None
    except (ValueError, OSError, EOFError):
        raise UsageError(f"--sample {path!r} is not a NumPy .npy/.npz array "
                         "file (object arrays are refused)") from None
    if isinstance(data, np.ndarray):
        return data
    try:
        keys = list(data.keys())
        if not keys:
            raise UsageError(f"--sample {path!r}: the .npz holds no arrays")
        if all(re.fullmatch(r"arr_\d+", k) for k in keys):
            return [data[k] for k in sorted(keys, key=lambda k: int(k[4:]))]
        return {k: data[k] for k in keys}
    except ValueError:
        raise UsageError(f"--sample {path!r}: holds object arrays; expected "
                         "numeric arrays") from None


# --------------------------------------------------------------------------
# heavy imports and model loading
# --------------------------------------------------------------------------


def _quiet_logs(verbose):
    """Silences TensorFlow's C++ logs unless asked for (or configured)."""
    if not verbose and "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        return True
    return False


@contextlib.contextmanager
def _stderr_silenced(active):
    """Sends file descriptor 2 to /dev/null (C++ logs written before absl
    is initialized ignore TF_CPP_MIN_LOG_LEVEL)."""
    if not active:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _import_keras(args):
    """Imports Keras (and its backend) once the arguments are valid."""
    quiet = getattr(args, "_quiet", False)
    with _stderr_silenced(quiet and "keras" not in sys.modules):
        import keras

        backend = keras.backend.backend()
        if quiet and (backend == "tensorflow" or _imports_tensorflow(args)):
            import tensorflow as tf

            tf.get_logger().setLevel("ERROR")
    return keras


def _imports_tensorflow(args):
    """Whether a command on another backend will import TensorFlow anyway:
    Keras's `set_random_seed` and its saving code import it when it is
    installed. Importing it here, with stderr silenced, keeps its start-up
    lines (oneDNN, cuInit) out of `demo`, `export` and `bench` on JAX."""
    import importlib.util

    return (getattr(args, "command", None) in ("demo", "export", "bench")
            and importlib.util.find_spec("tensorflow") is not None)


def _load_model(args, path, modules):
    keras = _import_keras(args)
    import kerasmp.optimizer.loss_scale_optimizer  # noqa: F401  (registers kerasmp's classes)
    import kerasmp.policy.policy  # noqa: F401

    if args.unsafe:
        import importlib

        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as e:
                if getattr(args, "debug", False):
                    raise
                raise UsageError(
                    f"MODEL {path!r} names the module {module!r}, which "
                    f"cannot be imported ({e}); put it on PYTHONPATH"
                ) from None
    try:
        if args.unsafe:
            return keras.saving.load_model(path, compile=False,
                                           safe_mode=False)
        return keras.saving.load_model(path, compile=False, safe_mode=True)
    except (ValueError, TypeError, KeyError, OSError) as e:
        if getattr(args, "debug", False):
            raise
        message = " ".join(str(e).split())
        if "safe_mode" in message or "unsafe" in message.lower():
            raise UsageError(
                f"MODEL {path!r} needs code execution to load (Keras safe "
                "mode refused it); pass --unsafe only if you trust the "
                "file") from None
        cut = re.split(r"(?<=[.!]) | Full object config", message)[0]
        raise UsageError(f"MODEL {path!r} cannot be loaded: "
                         f"{cut[:300]}") from None


# --------------------------------------------------------------------------
# sub-commands
# --------------------------------------------------------------------------


def _check_doctor(args):
    if args.bench is None:
        return
    try:
        with open(args.bench, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--bench {args.bench}: cannot read it "
                         f"({e.strerror})") from None
    except ValueError:
        raise UsageError(f"--bench {args.bench}: not a JSON file (write one "
                         "with `kerasmp bench --json FILE`)") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UsageError(f"--bench {args.bench}: not a `kerasmp bench "
                         "--json` result (no \"rows\")")
    args.bench = data


def _doctor(args):
    _import_keras(args)
    from kerasmp.doctor import main

    return main(as_json=args.json, bench=args.bench)


def _check_inspect(args):
    args._modules = _check_model_file(args.model, args.unsafe)


def _inspect(args):
    model = _load_model(args, args.model, args._modules)
    from kerasmp.policy.report import dtype_report

    report = dtype_report(model)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report)
    return 0


def _check_check(args):
    args._modules = _check_model_file(args.model, args.unsafe)
    args._sample = _load_sample(args.sample) if args.sample else None


def _check(args):
    model = _load_model(args, args.model, args._modules)
    from kerasmp.debug.hazards import check

    report = check(model, x=args._sample, gpu=True if args.gpu else None)
    if args.json:
        print(report.to_json())
    else:
        print(report)
    return 1 if report.has_errors else 0


def _check_demo(args):
    out = args.out
    if not out:
        raise UsageError("--out: expected a folder path")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out!r} is a file; expected a folder for "
                         "the demo's artifacts")
    target = out if os.path.isdir(out) else os.path.dirname(
        os.path.abspath(out))
    if not os.path.isdir(target):
        # Like export: a missing parent is a typo, not a folder to create.
        kind = "is not a folder" if os.path.exists(target) else (
            "does not exist")
        raise UsageError(f"--out {out!r}: its folder {target!r} {kind}")
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out!r}: cannot write in {target!r} "
                         "(permission denied)")


def _demo(args):
    _import_keras(args)
    from kerasmp.apps import demo

    return demo.run(args)


def _check_export(args):
    from kerasmp.export import specs as _format_specs

    try:
        _format_specs.check_target(args.out, args.format, args.overwrite,
                                   args.dtype, backend=_keras_backend(),
                                   io_dtype=args.io_dtype)
    except (ValueError, FileExistsError, TypeError, ImportError) as e:
        raise UsageError(_cli_words(str(e))) from None
    args._modules = _check_model_file(args.model, args.unsafe)
    _check_output(args.out, "OUT", args.overwrite, fmt=args.format,
                  source=args.model)
    args._sample = _load_sample(args.sample) if args.sample else None


def _export(args):
    _import_keras(args)
    from kerasmp.export import api as kx

    model = _load_model(args, args.model, args._modules)
    report, failed = None, None
    try:
        report = kx.export(
            model, args.out, format=args.format, dtype=args.dtype,
            sample=args._sample, keep_float32=args.keep_float32,
            overwrite=args.overwrite, max_rel_diff=args.max_rel_diff,
            max_diff=args.max_diff, io_dtype=args.io_dtype, gate=True)
    except kx.ParityError as e:
        report, failed = e.report, e
    except (ValueError, TypeError, ImportError, FileExistsError) as e:
        if args.debug:
            raise
        raise UsageError(_cli_words(" ".join(str(e).split()))) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    if failed is not None:
        print(f"kerasmp export: parity FAILED: "
              f"{_cli_words(str(failed))}", file=sys.stderr)
        return 1
    return 0


def _cli_words(message):
    """An API error message in the CLI's words (flags, not arguments)."""
    return (message.replace("pass overwrite=True", "pass --overwrite")
            .replace("`path`", "OUT").replace("`format`", "--format")
            .replace("`dtype`", "--dtype").replace("`io_dtype`", "--io-dtype")
            .replace("max_rel_diff=", "--max-rel-diff ")
            .replace("max_diff=", "--max-diff ")
            .replace("format=", "--format ")
            .replace("pass real inputs with `sample=` (`kerasmp export "
                     "--sample FILE.npy|.npz`)",
                     "pass real inputs with --sample FILE.npy|.npz"))


def _check_bench(args):
    preset = args.preset or ("quick" if args.quick else "default")
    if args.quick and args.preset not in (None, "quick"):
        raise UsageError(f"--quick conflicts with --preset {args.preset}; "
                         "pass one of them")
    if args.models:
        unknown = [m for m in args.models
                   if m not in BENCH_PRESET_MODELS[preset]]
        if unknown:
            raise UsageError(
                f"--models {' '.join(unknown)}: the {preset!r} preset has "
                f"{', '.join(BENCH_PRESET_MODELS[preset])}")
    if len(set(args.policies)) != len(args.policies):
        raise UsageError(f"--policies {' '.join(args.policies)}: expected "
                         "distinct policies")
    if args.json:
        _check_output(args.json, "--json", args.overwrite)


def _write_json(path, obj):
    """Writes `obj` as JSON atomically (a temporary file, then a rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
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


def _bench(args):
    _import_keras(args)
    from kerasmp.apps import bench

    preset = args.preset or ("quick" if args.quick else "default")
    on_progress = None
    if args.json:
        # Partial results are saved after every row, so an interrupted
        # run keeps what it measured ("complete": false).
        def on_progress(partial):
            _write_json(args.json, partial)

    try:
        result = bench.run_bench(
            preset, models=args.models, policies=args.policies,
            steps=args.steps, repeats=args.repeats,
            batch_size=args.batch_size, on_progress=on_progress)
    except (ValueError, TypeError) as e:
        if args.debug:
            raise
        raise UsageError(" ".join(str(e).split())) from None
    print()
    print(bench.format_table(result))
    if args.json:
        _write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


# --------------------------------------------------------------------------
# the parser
# --------------------------------------------------------------------------


def _common(parser, default):
    """--verbose and --debug, accepted before or after the sub-command."""
    parser.add_argument(
        "--verbose", action="store_true", default=default,
        help="show TensorFlow's start-up logs (silenced by default unless "
        "TF_CPP_MIN_LOG_LEVEL is set)")
    parser.add_argument(
        "--debug", action="store_true", default=default,
        help="show Python tracebacks, also for user errors")


def _unsafe(parser):
    parser.add_argument(
        "--unsafe", action="store_true",
        help="load a model whose file names Python modules or holds "
        "lambdas: imports those modules and RUNS THE FILE'S CODE. Only for "
        "files you trust; without it such a file is refused")


def build_parser():
    """The `kerasmp` argument parser (standard library only).

    Returns:
        An `argparse.ArgumentParser`.
    """
    parser = _Parser(
        prog="kerasmp",
        description="Mixed-precision training for Keras 3: correct, "
        "observable, exportable.",
        epilog="User errors exit with status 2 and print one line; "
        "`kerasmp COMMAND --help` for each command's options.",
    )
    _common(parser, False)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="COMMAND", parser_class=_Parser)
    suppress = argparse.SUPPRESS

    p = sub.add_parser(
        "doctor", help="report this machine's mixed-precision support and "
        "the policy to use",
        description="Versions, devices, and the policy to use on this "
        "machine, with the reason.")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON")
    p.add_argument("--bench", metavar="FILE",
                   help="a `kerasmp bench --json` result measured on this "
                   "machine: recommend on those measurements")
    _common(p, suppress)
    p.set_defaults(func=_doctor, check=_check_doctor)

    p = sub.add_parser(
        "inspect", help="print the per-layer dtype report of a saved .keras "
        "model",
        description="Print the per-layer dtype report (compute and variable "
        "dtype, and why) of a saved .keras model. The file is loaded in "
        "Keras's safe mode; a file that would run code is refused.")
    p.add_argument("model", metavar="MODEL", help="a .keras model file")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON")
    _unsafe(p)
    _common(p, suppress)
    p.set_defaults(func=_inspect, check=_check_inspect)

    p = sub.add_parser(
        "check", help="list the precision hazards of a saved .keras model "
        "before training",
        description="List the precision hazards of a saved .keras model "
        "(severity, layer, why, fix): normalizations, softmax, exp or log "
        "in float16, epsilons float16 cannot hold, half-precision "
        "variables and optimizer slots, weights beyond float16, inf/NaN "
        "from a float16 layer on a sample batch, half-precision outputs, a "
        "stock mixed policy; GPU tensor-core sizes with --gpu or when a GPU "
        "is visible. Exits 0 when no finding is an error, 1 otherwise (for "
        "CI). The file is loaded in Keras's safe mode; a file that would "
        "run code is refused.")
    p.add_argument("model", metavar="MODEL", help="a .keras model file")
    p.add_argument("--sample", metavar="FILE",
                   help="the sample batch of the traced checks: .npy (one "
                   "input) or .npz (keyed by input name, or arr_0, arr_1, "
                   "... in input order); default: zeros, ones for masks, "
                   "normal draws for floats")
    p.add_argument("--gpu", action="store_true",
                   help="include GPU advice (tensor-core sizes, severity "
                   "info) even when no GPU is visible")
    p.add_argument("--json", action="store_true",
                   help="print the findings as JSON")
    _unsafe(p)
    _common(p, suppress)
    p.set_defaults(func=_check, check=_check_check)

    p = sub.add_parser(
        "demo", help="train a small CNN on 8x8 digits in float32 and in "
        "mixed precision, compare, export",
        description="Train the same small CNN on the 8x8 digits shipped "
        "with kerasmp in float32 and in mixed precision, export the mixed "
        "model in half precision, and print the comparison. A rerun into "
        "the same --out replaces the demo's earlier artifacts there (and "
        "only those).")
    p.add_argument("--out", default="kerasmp-demo", metavar="DIR",
                   help="folder for the artifacts (default: ./kerasmp-demo)")
    p.add_argument("--policy", choices=DEMO_POLICIES,
                   default="mixed_float16",
                   help="mixed policy to compare with float32 (default: "
                   "mixed_float16)")
    p.add_argument("--epochs", type=_int_at_least(1), default=None,
                   metavar="N",
                   help=f"epochs per run (default {DEMO_DEFAULT_EPOCHS}, "
                   f"{DEMO_QUICK_EPOCHS} with --quick)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, metavar="S",
                   help="seed of both runs (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="a short run for smoke tests")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON instead of the table")
    _common(p, suppress)
    p.set_defaults(func=_demo, check=_check_demo)

    p = sub.add_parser(
        "export", help="export a .keras model in half precision (keras, "
        "savedmodel, tflite, onnx) with a parity report",
        description="Export a .keras model in half precision and print a "
        "size and parity report against its float32 master weights. OUT "
        "is checked (suffix, --overwrite) before the model is loaded. If "
        "parity fails (max |diff| > --max-diff) the command exits 1 and "
        "leaves NOTHING at OUT (an existing OUT is kept as it was).")
    p.add_argument("model", metavar="MODEL", help="a .keras model file")
    p.add_argument("out", metavar="OUT",
                   help="output path: a .keras file (--format keras), a "
                   "SavedModel folder (savedmodel), a .tflite file (tflite) "
                   "or a .onnx file (onnx)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="savedmodel",
                   help="artifact format (default: savedmodel; tflite needs "
                   "pip install kerasmp[tflite], onnx kerasmp[onnx])")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float16",
                   help="weight dtype (default: float16; bfloat16 not for "
                   "tflite/onnx; float32 for comparison)")
    p.add_argument("--sample", metavar="FILE",
                   help="parity inputs: .npy (one input) or .npz (keyed by "
                   "input name, or arr_0, arr_1, ... in input order); "
                   "default: 512 draws that respect the model (token ids "
                   "within the vocabulary, a front Rescaling/Normalization "
                   "layer's range, else uniform [0, 1))")
    p.add_argument("--max-rel-diff", type=_nonnegative_float, default=None,
                   metavar="X",
                   help="parity gate on max |difference| / range of the "
                   "float32 output, per output: above X, exit 1 and write "
                   "nothing (default 0.02 for float16, 0.1 for bfloat16, "
                   "1e-4 for float32)")
    p.add_argument("--max-diff", type=_nonnegative_float, default=None,
                   metavar="X",
                   help="also gate on the absolute max |difference| vs "
                   "float32 (default: no absolute gate)")
    p.add_argument("--io-dtype", choices=("float32", "float16"),
                   default="float32",
                   help="dtype of the artifact's float inputs and outputs "
                   "(savedmodel, tflite, onnx; default float32)")
    p.add_argument("--keep-float32", action="append", default=None,
                   metavar="REGEX", type=_regex,
                   help="keep layers whose name matches in float32 "
                   "(repeatable; replaces the default softmax/normalization "
                   "rules)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON")
    _unsafe(p)
    _common(p, suppress)
    p.set_defaults(func=_export, check=_check_export)

    p = sub.add_parser(
        "bench", help="steps/s and memory of float32 vs mixed_float16 vs "
        "mixed_bfloat16 on this device",
        description="Train a small model zoo for a few steps under each "
        "policy and report steps/s and memory. --json PATH is checked "
        "before the benchmark starts and rewritten after every model and "
        "policy, so an interrupted run keeps its partial results.")
    p.add_argument("--quick", action="store_true",
                   help="the 'quick' preset: tiny models, few steps (under "
                   "two minutes on a CPU)")
    p.add_argument("--preset", choices=tuple(BENCH_PRESET_MODELS),
                   default=None,
                   help="model sizes, steps and repeats (default: 'default', "
                   "or 'quick' with --quick)")
    p.add_argument("--models", nargs="+", choices=BENCH_MODELS, default=None,
                   metavar="MODEL",
                   help="models to run (default: all of the preset's)")
    p.add_argument("--policies", nargs="+", choices=BENCH_POLICIES,
                   default=list(BENCH_DEFAULT_POLICIES), metavar="POLICY",
                   help="policies to compare; ratios are relative to the "
                   "first (default: float32 mixed_float16 mixed_bfloat16)")
    p.add_argument("--steps", type=_int_at_least(2), default=None,
                   metavar="N", help="steps per timed call (>= 2)")
    p.add_argument("--repeats", type=_int_at_least(1), default=None,
                   metavar="N", help="timed calls per model and policy")
    p.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   metavar="N", help="batch size of every model")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result as JSON to PATH")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --json PATH")
    _common(p, suppress)
    p.set_defaults(func=_bench, check=_check_bench)
    return parser


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def markdown_reference():
    """The README's "Command line" reference, generated from the parser.

    Returns:
        Markdown text: the options every command takes, then one entry per
        sub-command with its usage and each of its options.
    """
    parser = build_parser()
    common = {"-h", "--help", "--verbose", "--debug"}
    lines = ["Every command also takes `--verbose` and `--debug`:", ""]
    for action in parser._actions:
        if set(action.option_strings) & {"--verbose", "--debug"}:
            lines.append(f"- `{action.option_strings[0]}`: "
                         + " ".join(action.help.split()))
    lines.append("")
    helps = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
    for name, sub in _subparsers(parser).items():
        usage = " ".join(sub.format_usage().split())
        usage = usage.replace("usage: ", "")
        for flag in common:
            usage = usage.replace(f" [{flag}]", "")
        lines.append(f"- `{usage}`: {helps.get(name, '')}.")
        for action in sub._actions:
            if set(action.option_strings) & common:
                continue
            flag = (", ".join(action.option_strings)
                    or (action.metavar or action.dest))
            text = " ".join(action.help.split())
            if action.choices and action.option_strings:
                text += f" (one of: {', '.join(action.choices)})"
            lines.append(f"  - `{flag}`: {text}")
    return "\n".join(lines) + "\n"


def _subcommand_parser(parser, command):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command, parser)
    return parser


def _unrecognized(parser, command, extra):
    import difflib

    sub = _subcommand_parser(parser, command)
    options = [o for a in sub._actions for o in a.option_strings]
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
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Name the subcommand's help, not the top-level one, and a near miss.
        _subcommand_parser(parser, args.command).error(
            _unrecognized(parser, args.command, extra))
    prog = f"kerasmp {args.command}"
    args._quiet = _quiet_logs(args.verbose)
    try:
        if args.check is not None:
            args.check(args)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        # `kerasmp ... | head`: the reader has gone. Stop quietly, as Unix
        # tools do, and keep Python from complaining when it flushes stdout
        # at exit.
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for `cat | head`
    except UsageError as e:
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


if __name__ == "__main__":
    sys.exit(main())
