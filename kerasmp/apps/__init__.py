"""kerasmp's applications: the `kerasmp` command and what it runs.

- `cli/`: the `kerasmp` command (argument parsing and checks; standard
  library only, so `kerasmp --help` imports no framework), one module per
  command,
- `choices.py`: the choices and defaults the command, the demo and the
  benchmark share (standard library only),
- `demo.py`: `kerasmp demo`, float32 vs mixed precision on the 8x8 digits,
- `bench.py`: `kerasmp bench`, steps/s and memory per policy,
- `doctor.py`: `kerasmp doctor` and `kerasmp.doctor()`, versions, devices
  and the policy to use on this machine,
- `zoo.py`: the models the demo and the benchmark train.

They use the library (`kerasmp.policy`, `kerasmp.optimizer`,
`kerasmp.callbacks`, `kerasmp.export`, ...) as a user would; nothing in
the library imports them (`kerasmp/__init__` re-exports `doctor`, which
imports only `kerasmp._utils.devices`). This package's `__init__` imports
nothing. `python -m kerasmp.apps.cli` runs the command as `kerasmp` does.
"""
