"""kerasmp's train step, installed by `compile` (`steps`)."""
