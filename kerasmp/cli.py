"""The `kerasmp` command: doctor, inspect (and demo, export, bench)."""

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
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
