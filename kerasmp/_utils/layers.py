"""Layer paths: the one naming scheme every kerasmp report uses.

`dtype_report`, `find_nonfinite`, the monitors' events, the fallback and
`ExportReport.kept_float32` all name a layer by its path from the model
root, as `walk` gives it.
"""

from kerasmp import _keras_internals as _ki


def walk(layer, prefix=""):
    """Yields `(path, sublayer)` for every sublayer of `layer`, depth first.

    The path joins layer names from the model root (`"block/mha/softmax"`;
    the root's own name is left out). Unlike `Layer.path` it exists for
    layers that were never built (a Softmax has no `build`, so Keras never
    gives it a path) and it keeps every parent, also for layers without
    weights. Paths are unique within the model: when two sublayers of one
    parent share a name (Keras only makes names unique per class and
    session), the later ones get `#2`, `#3`, ... appended. A layer reachable
    from several parents is listed once, under its first path.

    Args:
        layer: The root (`keras.Model` or `keras.layers.Layer`).
        prefix: A path to prepend to every path.
    """
    seen = {id(layer)}

    def rec(parent, pre):
        taken = {}
        for child in _ki.direct_sublayers(parent):
            if id(child) in seen:
                continue
            seen.add(id(child))
            count = taken.get(child.name, 0) + 1
            taken[child.name] = count
            name = child.name if count == 1 else f"{child.name}#{count}"
            path = f"{pre}/{name}" if pre else name
            yield path, child
            yield from rec(child, path)

    yield from rec(layer, prefix)
