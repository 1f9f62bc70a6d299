"""The `kerasmp` command: doctor, inspect, demo, export, bench."""

import argparse
import sys


def _doctor(args):
    from kerasmp.doctor import main

    return main(as_json=args.json)


def _inspect(args):
    import keras

    import kerasmp

    model = keras.saving.load_model(args.model, compile=False)
    print(kerasmp.dtype_report(model))
    return 0


def _demo(args):
    from kerasmp import demo

    return demo.run(args)


def _export(args):
    from kerasmp import export

    return export.run(args)


def _bench(args):
    from kerasmp import bench

    return bench.run(args)


def _add_from_module(sub, name, help, module):
    """A sub-command whose arguments come from `kerasmp.<module>`."""
    import importlib

    p = sub.add_parser(name, help=help)
    importlib.import_module(f"kerasmp.{module}").add_arguments(p)
    return p


def build_parser():
    parser = argparse.ArgumentParser(
        prog="kerasmp",
        description="Mixed-precision training for Keras 3: correct, "
        "observable, exportable.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="report this machine's mixed-precision "
                       "support and the policy to use")
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("inspect", help="print the per-layer dtype report of "
                       "a saved .keras model")
    p.add_argument("model", help="path to a .keras file")
    p.set_defaults(func=_inspect)

    p = _add_from_module(
        sub, "demo", "train a small CNN on 8x8 digits in float32 and in "
        "mixed precision, compare, export", "demo")
    p.set_defaults(func=_demo)

    p = _add_from_module(
        sub, "export", "export a .keras model in half precision (keras, "
        "savedmodel, tflite) with a parity report", "export")
    p.set_defaults(func=_export)

    p = _add_from_module(
        sub, "bench", "steps/s and memory of float32 vs mixed_float16 vs "
        "mixed_bfloat16 on this device", "bench")
    p.set_defaults(func=_bench)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
