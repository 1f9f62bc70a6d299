"""How far a census model's float32 output moves when only its weights are
rounded to float16: the parity floor of any float16 computation.

A layer computing in float16 reads a float16 copy of its float32 weights.
So before arithmetic is even considered, a `mixed_float16` model runs with
weights rounded to 11 significant bits. This script measures what that
rounding alone costs, in float32 arithmetic: it builds a census model in
float32 (seed 0, the census's weights), predicts the census's parity
inputs, then predicts them again, still in float32, with every float32
weight rounded to float16 and back. The census's figure (max |diff| /
range of the float32 output; bound 2e-2) is taken of both.

A row whose rounded-weights figure is above the bound is one that no
precision rule can bring within it while its layers compute in float16:
the model (a random-init tiny config) amplifies a relative perturbation of
~5e-4 in its weights into that much at its output. docs/zoo.md lists the
census rows whose parity is off under kerasmp and stock alike with this
figure beside them.

    KERAS_BACKEND=jax python benchmarks/zoo_rounding.py \
        --models Gemma4Backbone FluxBackbone [--results benchmarks/results]

It prints one line per model and writes
`<results>/zoo_rounding_<backend>.json` (the kerasmp and stock figures are
copied from that backend's census JSON when it has the row). Models run in
this process, one after the other, and need no kerasmp.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

BOUND = 2e-2


def round_to_half(weights):
    """`weights` with each float32 array rounded to float16 and back."""
    import numpy as np

    return [np.asarray(w).astype("float16").astype("float32")
            if np.asarray(w).dtype == np.float32 else w for w in weights]


def measure(name):
    """`{"rounded_weights": figure, "absmax", "range", "params"}` for one
    census model (`absmax` and `range` of its float32 output: below
    float16's smallest normal number, 6.1e-5, float16 keeps fewer than 11
    significant bits)."""
    import numpy as np
    from zoo import spec
    from zoo.worker import build
    from zoo.worker import data
    from zoo.worker import predict
    from zoo.worker import zoo_model

    zoo = zoo_model(name)
    x = data(zoo)["parity"]
    features, train = build(zoo)
    reference = predict(features, x)
    weights = train.get_weights()
    features, train = build(zoo, round_to_half(weights))
    rounded = predict(features, x)
    reference = np.asarray(reference, "float64")
    return {"rounded_weights": spec.rel_diff(reference, rounded),
            "absmax": float(np.abs(reference).max()),
            "range": float(reference.max() - reference.min()),
            "params": int(train.count_params())}


def census_figures(results, backend, name):
    """The census's parity figures of `name` (kerasmp, stock), or Nones."""
    path = os.path.join(results, f"zoo_census_{backend}.json")
    if not os.path.exists(path):
        return None, None
    with open(path) as f:
        row = json.load(f)["rows"].get(name) or {}

    def figure(column):
        forward = (row.get(column) or {}).get("forward") or {}
        return forward.get("rel_diff")

    return figure("kerasmp"), figure("stock")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--results",
                        default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)

    import keras

    backend = keras.backend.backend()
    rows = {}
    print(f"{'model':28s} {'kerasmp':>9s} {'stock':>9s} "
          f"{'f32, f16 weights':>17s} {'f32 |max|':>9s}")
    for name in args.models:
        start = time.time()
        try:
            row = measure(name)
        except Exception as e:  # one model's failure costs its row
            row = {"error": f"{type(e).__name__}: {e}"[:300]}
        row["kerasmp"], row["stock"] = census_figures(args.results, backend,
                                                      name)
        row["seconds"] = round(time.time() - start, 1)
        rows[name] = row

        def cell(value):
            return "-" if value is None else f"{value:.1e}"

        print(f"{name:28s} {cell(row['kerasmp']):>9s} "
              f"{cell(row['stock']):>9s} "
              f"{cell(row.get('rounded_weights')):>17s} "
              f"{cell(row.get('absmax')):>9s}"
              f"{'  ' + row['error'] if 'error' in row else ''}",
              flush=True)
    out = {
        "backend": backend,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} CPUs",
        "command": "python benchmarks/zoo_rounding.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "bound": BOUND,
        "rows": rows,
    }
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"zoo_rounding_{backend}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
