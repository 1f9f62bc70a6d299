"""Transitional: the callbacks still import the train step under its old
module name while they are being moved; removed with that move."""

from kerasmp._utils.arrays import to_numpy as read  # noqa: F401
from kerasmp.train_step import ROW_FIELDS  # noqa: F401
from kerasmp.train_step import SCALE_KEY  # noqa: F401
from kerasmp.train_step import SKIPPED_KEY  # noqa: F401
from kerasmp.train_step import batch  # noqa: F401
from kerasmp.train_step import install  # noqa: F401
from kerasmp.train_step import keep_batches  # noqa: F401
from kerasmp.train_step import optimizer_state  # noqa: F401
from kerasmp.train_step import rows  # noqa: F401
from kerasmp.train_step import scaled  # noqa: F401
from kerasmp.train_step import supported  # noqa: F401
