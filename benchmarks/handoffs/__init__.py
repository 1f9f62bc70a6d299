"""The hand-off matrix (issue 35, `benchmarks/handoffs.py`, docs/export.md).

Where a file or a model leaves kerasmp: every artifact a user writes from
a model trained under kerasmp, on every backend, read by every consumer
that should read it.

- `cells`: the spec of the cells (producer backend x artifact x consumer x
  model), the consumers of each artifact, the quick cells. Imports
  neither Keras nor kerasmp.
- `models`: the three models (the demo's CNN, a small transformer, a tiny
  keras-hub GPT-OSS whose MoE routers kerasmp moves to float32), their
  inputs and labels. Imports no kerasmp: a consumer without it rebuilds
  them for a `.weights.h5`.
- `produce`: one producer backend and model in its own process: trains
  under kerasmp and writes every artifact (or its one-line refusal).
- `consume`: one consumer in its own process (the chosen backend, kerasmp
  blocked where it is plain Keras or a runtime): loads, runs, checks
  parity against the producer's outputs, and trains on a training file.
- `runner`: the processes, each with a time limit; the JSON.
- `report`: counts and the tables the README and docs/ hold.
"""
