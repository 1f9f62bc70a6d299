"""The model zoo of the census (`benchmarks/zoo_census.py`, docs/zoo.md).

- `hub`: a tiny config for every backbone keras-hub 0.32 ships (the numbers
  of keras-hub's own `*_backbone_test.py`), and the backbones without one.
- `applications`: one `keras.applications` model per family, at the
  smallest input it accepts (`weights=None`).
- `spec`: what the census does with a model, the same for both: its inputs
  (`Gen` draws), the output it compares (`primary`), the head it trains,
  which layers are normalizations. Imports neither kerasmp nor keras-hub.
- `worker`: one model, one stage (float32 + stock `mixed_float16` in a
  process where kerasmp cannot be imported, or kerasmp), in its own
  process; prints a `RESULT` line.
- `reload`: reads exported artifacts back where kerasmp is absent.

Nothing here imports kerasmp at module level: the stock stage runs with
kerasmp blocked.
"""
