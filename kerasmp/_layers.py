"""Walking a model's sublayers, shared by debug and export."""


def walk(layer, prefix=""):
    """Yields `(path, sublayer)` for every sublayer of `layer`, depth first.

    The path joins layer names from the top (`"mha/softmax"`); unlike
    `Layer.path` it also exists for layers that were never built (a Softmax
    has no `build`, so Keras never gives it a path).
    """
    seen = {id(layer)}

    def rec(parent, pre):
        for child in getattr(parent, "_layers", ()):
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{pre}/{child.name}" if pre else child.name
            yield path, child
            yield from rec(child, path)

    yield from rec(layer, prefix)
