"""The PyTorch side of the export: a `torch.nn.Module` that serves a Keras
model (flat inputs in `input_specs` order, float inputs and outputs in
`io_dtype`), captured by `torch.export` with a free batch; the `torch`
format (a `.pt2` program: `torch.export.save`), its reader
(`torch.export.load(path).module()`) and its weight counter. The ONNX and
TFLite writers of the PyTorch backend convert the same program.

Each dimension the model leaves unknown (the batch, a sequence length) is
a `torch.export.Dim`; where the model's code fixes one (a reshape to a
constant), `exported` tries again with only the batch free, then with the
parity inputs' shapes, and says which shapes the artifact then takes.
"""

import keras
import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp.export.inputs import PREDICT_BATCH
from kerasmp.export.inputs import batched
from kerasmp.export.inputs import pack
from kerasmp.export.quiet import say

# Rows of the sample inputs: torch.export specializes a dimension of size 1.
_SAMPLE_ROWS = 2


def serving_module(model, specs, io_dtype="float32"):
    """A `torch.nn.Module` that runs `model` in inference mode.

    Its `forward(*inputs)` takes the flat inputs (`specs` order), casts
    them to the dtypes the model takes, and returns the flat outputs as a
    tuple, float ones cast to `io_dtype`.
    """
    import torch

    wanted = [getattr(torch, d) for _, _, d in specs]
    out_dtype = getattr(torch, io_dtype)

    class Serve(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model  # its variables are the module's parameters

        def forward(self, *inputs):
            args = [x.to(d) if x.dtype != d else x
                    for x, d in zip(inputs, wanted)]
            y = self.model(pack(self.model, args), training=False)
            return tuple(t.to(out_dtype) if t.is_floating_point() else t
                         for t in keras.tree.flatten(y))

    return Serve().eval()


def sample_args(specs, example, io_dtype):
    """The first rows of the parity inputs as torch tensors (float ones in
    `io_dtype`)."""
    import torch

    return tuple(
        torch.from_numpy(np.ascontiguousarray(
            a[:_SAMPLE_ROWS].astype(io_dtype if is_float(d) else d)))
        for a, (_, _, d) in zip(example, specs))


def dynamic_shapes(specs, free="all"):
    """`torch.export` dynamic shapes for the inputs: the batch and, with
    `free="all"`, every unknown dimension free; `"batch"`: the batch only;
    `"none"`: None (every shape fixed to the sample's)."""
    import torch

    if free == "none":
        return None
    shapes = []
    for i, (_, shape, _) in enumerate(specs):
        dims = {0: torch.export.Dim("batch")}
        if free == "all":
            for axis, d in enumerate(shape[1:], start=1):
                if d is None:
                    dims[axis] = torch.export.Dim(f"d{i}_{axis}")
        shapes.append(dims)
    return (tuple(shapes),)


def exported(model, specs, io_dtype, example, convert=None):
    """`convert(module, args, dynamic_shapes)` (default `torch.export.export`)
    with every unknown dimension free, else the batch only, else fixed
    shapes; says which shapes a result that is not fully free takes.

    Returns:
        What `convert` returned.
    """
    import torch

    convert = convert or (lambda m, a, d: torch.export.export(
        m, a, dynamic_shapes=d, strict=False))
    module = serving_module(model, specs, io_dtype)
    args = sample_args(specs, example, io_dtype)
    unknown = any(d is None for _, s, _ in specs for d in s[1:])
    tries = ["all", "batch", "none"] if unknown else ["all", "none"]
    first = None
    for i, free in enumerate(tries):
        if free == "none":  # one example per call: any number of rows
            args = tuple(a[:1] for a in args)
        try:
            with torch.no_grad():
                result = convert(module, args, dynamic_shapes(specs, free))
        except Exception as e:  # torch.export's constraint errors
            first = first or e
            continue
        if i:
            _say_fixed(model, specs, args, free, first)
        return result
    raise first


def _say_fixed(model, specs, args, free, error):
    def shape(a):
        dims = tuple(a.shape)
        return (None,) + dims[1:] if free == "batch" else dims

    shapes = ", ".join(f"{n}: {shape(a)}" for (n, _, _), a in zip(specs, args))
    what = ("the batch may vary" if free == "batch"
            else "one example per call")
    say(f"kerasmp.export: the exported program of {model.name!r} takes "
        f"inputs of fixed shape ({shapes}; {what}), since torch.export "
        f"cannot keep them free ({type(error).__name__}); pass `sample=` "
        "inputs of the shape you serve.")


def write_torch(model, path, specs, dtype, io_dtype, example=None):
    """Writes `model` (the half-precision `HalfModel`, or the float32 one)
    as a `torch.export` program."""
    import torch

    program = exported(model, specs, io_dtype, example)
    torch.export.save(program, path)


def _fixed_batch(program):
    """The batch size a program fixed to its sample's (see `exported`), or
    None when it is free."""
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in (
                program.graph_signature.user_inputs):
            size = node.meta["val"].shape[0]
            return int(size) if isinstance(size, int) else None
    return None


def run_torch(path, arrays, specs):
    """Loads the `.pt2` at `path` with `torch.export.load` and runs it."""
    import torch

    program = torch.export.load(path)
    names = program.graph_signature.user_inputs
    placeholders = {n.name: n for n in program.graph.nodes
                    if n.op == "placeholder"}
    ins = [str(placeholders[n].meta["val"].dtype).replace("torch.", "")
           for n in names]
    module = program.module()

    def run_batch(batch):
        with torch.no_grad():
            y = module(*[torch.from_numpy(np.ascontiguousarray(a.astype(d)))
                         for a, d in zip(batch, ins)])
        return [t.detach().cpu().numpy() for t in y]

    outs = batched(run_batch, arrays, _fixed_batch(program) or PREDICT_BATCH)
    return outs, ins, [o.dtype.name for o in outs]


def weights_torch(path):
    """Bytes of the parameters, buffers and tensor constants of the `.pt2`
    program at `path`."""
    import torch

    program = torch.export.load(path)
    tensors = list(program.state_dict.values()) + [
        t for t in program.constants.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)
