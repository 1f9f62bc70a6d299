"""kerasmp's applications: the `kerasmp` command and what it runs.

- `cli.py`: the `kerasmp` command (argument parsing and checks; standard
  library only, so `kerasmp --help` imports no framework),
- `demo.py`: `kerasmp demo`, float32 vs mixed precision on the 8x8 digits,
- `bench.py`: `kerasmp bench`, steps/s and memory per policy,
- `zoo.py`: the models the demo and the benchmark train.

They use the library (`kerasmp.policy`, `kerasmp.optimizer`,
`kerasmp.callbacks`, `kerasmp.export`, `kerasmp.doctor`, ...) as a user
would; nothing in the library imports them. This package's `__init__`
imports nothing.
"""
