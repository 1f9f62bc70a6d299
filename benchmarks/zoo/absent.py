"""kerasmp made unimportable, as on a machine where it is not installed.

`BLOCK_KERASMP` is the source of a few lines that, run first in a process
(a subprocess script starts with them, or `block()` executes them), make
every later `import kerasmp` raise ImportError. The census's stock stage
and its reader of exported artifacts (`reload.py`) run so, and the tests'
"loads without kerasmp" scripts start with the same lines
(`tests/_helpers.py` imports them from here). The lines also import `json`
and `sys`, which those scripts use.
"""

BLOCK_KERASMP = """
import json, sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "kerasmp" or name.startswith("kerasmp."):
            raise ImportError("kerasmp is not installed here")
sys.meta_path.insert(0, _Blocker())
"""


def block():
    """Makes kerasmp unimportable in this process from now on."""
    exec(BLOCK_KERASMP, {})
