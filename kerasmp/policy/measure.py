"""The float32 rules kerasmp finds by running the model: decided by
measurement, once per model, at its first call (`model(x)`, `predict`,
building a larger model on it) or its `compile`, whichever comes first.

A class list or a name cannot say which layers of a model break in half
precision; a symbolic run of the model in training mode can (nothing is
computed and no weight changes: `kerasmp._keras_internals.
trace_symbolically`), on its own inputs and, where a size is unknown, once
more with every size known, as `fit` and `predict` trace.
`measure(model, policy)`, called by kerasmp's patches (`kerasmp/_patches.py`)
for a model a half-precision `kerasmp.Policy` governs, applies two rules:

1. **Layers that fail in half precision.** A layer whose own code mixes
   float16 and float32 tensors in one op (an `add`, a `matmul`), or calls an
   op that has no half-precision form (TensorFlow's `range` with a float16
   dtype and a known length), fails at the first call of `fit`, under stock
   Keras's `mixed_float16` too (keras-hub's SAM prompt encoder, Moonshine's
   encoder block, ESM's rotary embedding, the Qwen3-MoE router's auxiliary
   loss, RoFormerV2's and D-FINE's position embeddings). The
   innermost layer whose `call` raises is moved to float32 (or, when that is
   not enough, the layer with its sublayers), with a one-line warning naming
   it, and the run goes on (at most `MAX_MOVES` times). A failure that
   moving the layer does not cure is left for `fit` to report, and the
   layer keeps its policy.
2. **MoE routers.** A layer that calls `keras.ops.top_k` (the router of a
   mixture of experts: top-k routing, its softmax or sigmoid and its
   auxiliary loss) computes in float32, with the
   `Dense`/`EinsumDense` sublayer that produces those scores (one unit per
   expert). In float16 near-equal scores round to ties and the router picks
   other experts (keras-hub GPT-OSS: features 7.4e-2 off float32, 9e-4 with
   the router in float32); the Switch Transformer computes its router in
   float32 ("selective precision"). Other sublayers (the experts) keep the
   half policy.

Each moved layer gets a `Float32Override` whose rule says why, so
`dtype_report`, `kerasmp check` and a saved file say so too. The run needs
the model's symbolic inputs (a Functional or Sequential model, or any model
after it was called once); without them nothing is measured.
"""

import contextlib
import re
import warnings

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.instrument import running_layers
from kerasmp._utils.instrument import watching_ops
from kerasmp._utils.layers import walk
from kerasmp._utils.warn import at_caller
from kerasmp._utils.warn import user_stacklevel
from kerasmp.policy.plan import plan_of
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import stored_policy
from kerasmp.policy.rules import outputs_as_computed
from kerasmp.policy.saving import portable_policy_name

MAX_MOVES = 8
"""The most layers one `measure` moves to float32 because they failed."""

FAILS_RULE = "fails in {dtype}"
ROUTER_RULE = "MoE router (calls top_k)"
PROJECTION_RULE = "MoE router scores ({router})"
TUNE_RULE = "kept by kerasmp.tune"
"""The rule of a layer `kerasmp.tune` keeps in float32 (a `Policy.measured`
entry): recorded again, like the rules above, when the model is
measured."""

_HALF = ("float16", "bfloat16")
_DT = {"HALF": "float16", "BFLOAT16": "bfloat16"}  # TensorFlow's DT_ names
_MEASURED = "_kerasmp_measured"  # in a model's __dict__ once measured
_running = [0]  # measurements in progress


def is_measured(model):
    """Whether `model` was measured (once per model: at its first call or
    its compile, whichever comes first)."""
    return _MEASURED in model.__dict__


def can_measure(model):
    """Whether `model` can be measured now: it has the symbolic inputs a
    measurement runs on (a Functional model, a Sequential one once built),
    and no measurement is running (whose symbolic run calls models)."""
    return not _running[0] and _symbolic_inputs(model) is not None


def measure_once(model):
    """Measures `model` (`measure`) if a half-precision kerasmp policy
    governs it and it was not measured yet: what its first call or its
    `compile` does (`kerasmp._patches`), and what `kerasmp.export` does
    for a model never called. Does nothing while `can_measure` is False.
    """
    if is_measured(model) or not can_measure(model):
        return
    mark_measured(model)
    governing = plan_of(model)
    if governing.governed:
        measure(model, governing.policy)


def mark_measured(model):
    """Records that `model` is measured; later compiles do not measure."""
    object.__setattr__(model, _MEASURED, True)


@contextlib.contextmanager
def suspended():
    """No model is measured while the block runs (`kerasmp.check`'s traced
    run calls the model but must leave it as it was)."""
    _running[0] += 1
    try:
        yield
    finally:
        _running[0] -= 1


def _symbolic_inputs(model):
    try:
        return model.input
    except (AttributeError, ValueError):
        return None


def _run(model, inputs, layers):
    """One symbolic training-mode run; returns `(routers, failure)`:
    `{path: (layer, units)}` of the layers that called `top_k` (`units`:
    the last axis of what they ranked, one score per expert), and
    `(path, layer, error)` of the innermost layer whose call raised (or
    None)."""
    routers = {}

    def on_call(current, name, x):
        if current is not None:
            path, layer = current
            units = x.shape[-1] if getattr(x, "shape", None) else None
            routers.setdefault(path, (layer, units))

    with running_layers(layers) as watch:
        with watching_ops(watch, ("top_k",), on_call):
            try:
                _ki.trace_symbolically(
                    lambda x: model(x, training=True), inputs)
            except Exception as e:  # noqa: BLE001 (what fit would raise)
                if watch.failed_in is None:
                    return routers, (None, None, e)
                return routers, (*watch.failed_in, e)
    return routers, None


def _governing(layer, policy):
    stored = stored_policy(layer)
    if isinstance(stored, Float32Override):
        stored = stored.policy
    return stored if isinstance(stored, Policy) else None


def _move(layers, policy, rule):
    """Puts each `(path, layer)` still computing in half precision in
    float32 under `rule`; returns `[(path, layer, previous policy)]`."""
    moved = []
    for path, layer in layers:
        if _governing(layer, policy) and layer.compute_dtype in _HALF:
            moved.append((path, layer, stored_policy(layer)))
            layer.dtype_policy = Float32Override(policy, rule)
    return moved


def _first_line(error):
    """The first line of `error` that says what went wrong (not Keras's
    "Exception encountered when calling ..." wrapper), at most 100
    characters, cut at a word."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    # Keras's "Could not automatically infer the output shape ... Error
    # encountered:" (a symbolic call at build) holds the cause after it.
    text = text.split("Error encountered:", 1)[-1].splitlines()
    lines = [t.strip() for t in text if t.strip() and not t.startswith(
        "Exception encountered when calling")]
    line = lines[0] if lines else type(error).__name__
    # TensorFlow names the graph node (also behind Keras's "Could not
    # automatically infer the output shape"): say the op and the dtype.
    node = re.search(r"Unsupported dtype\d+ for '\{\{node [^}]*\}\} = "
                     r"(\w+)\[\w+=DT_(\w+)", " ".join(text))
    if node:
        line = (f"TensorFlow's {node.group(1)} op takes no "
                f"{_DT.get(node.group(2), node.group(2).lower())} with a "
                "known size")
    return line if len(line) <= 100 else line[:97].rsplit(" ", 1)[0] + " ..."


def _cure(model, inputs, layers, failure, policy):
    """Moves the layer that failed to float32, then it and its sublayers;
    returns `(moved, run)` for the first that lets the run get past it,
    `run` the next `(routers, failure)`; None when neither does (nothing is
    left moved)."""
    path, layer, _ = failure
    rule = FAILS_RULE.format(dtype=layer.compute_dtype)
    for targets in ([(path, layer)],
                    [(path, layer)] + list(walk(layer, prefix=path))):
        moved = _move(targets, policy, rule)
        run = _run(model, inputs, layers)
        if run[1] is None or run[1][1] is not layer:
            return [(p, rule) for p, _, _ in moved], run
        for _, target, previous in reversed(moved):
            target.dtype_policy = previous
    return None


@at_caller  # Keras's warnings in the symbolic run, at the caller's
def measure(model, policy, dry_run=False):
    """Finds, by symbolic runs, the layers of `model` that must compute in
    float32, and moves them (see the module docstring).

    Args:
        model: A `keras.Model` that `policy` governs.
        policy: The governing `kerasmp.Policy` (half-precision compute).
        dry_run: Whether to put every layer back as it was before
            returning (what `kerasmp.check` reports; no warning).

    Returns:
        `[(path, rule)]` of the layers moved to float32.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> kerasmp.policy.measure.measure(model, kerasmp.global_policy())
    []
    >>> kerasmp.set_global_policy("float32")
    """
    inputs = _symbolic_inputs(model)
    if inputs is None or policy.compute_dtype not in _HALF:
        return []
    with suspended():  # its symbolic runs call models
        return _measure(model, policy, inputs, dry_run)


def _measure(model, policy, inputs, dry_run):
    layers = plan_of(model).walk()
    before = [(layer, stored_policy(layer)) for _, layer in layers]
    moved = _moves(model, policy, inputs, layers, dry_run)
    sized = _sized(inputs)
    if sized is not None:
        # Once more with every unknown size known, as `fit` and `predict`
        # trace: TensorFlow folds a known length into constants and then
        # refuses a float16 `range` ("Unsupported dtype19", keras-hub's
        # RoFormerV2 and D-FINE) that a free length let through, and a layer
        # that traces only with known sizes (Python control flow on a shape,
        # Qwen3.5's GatedDeltaNet, in float32 too) ends the first run
        # before the layers behind it.
        moved += _moves(model, policy, sized, layers, dry_run)
    if dry_run:
        for layer, policy in before:
            if stored_policy(layer) is not policy:
                layer.dtype_policy = policy
    else:
        _record(model, policy, inputs, layers)
    return moved


def _is_measured(rule):
    return isinstance(rule, str) and (
        rule.startswith(FAILS_RULE.split("{")[0]) or rule == ROUTER_RULE
        or rule == TUNE_RULE
        or rule.startswith(PROJECTION_RULE.split("{")[0]))


def _record(model, policy, inputs, layers):
    """Records, in the governing policy of `model`'s layers
    (`Policy.with_measured`), the float32 layers a saved file must name by
    path, so that it reloads them in float32 with kerasmp or without
    (`kerasmp.policy.saving.stock_measured`):

    - the layers measurement moved to float32 (with the sublayers they
      handed their override that kept half precision), portable or not;
    - the layers kerasmp's rules keep in float32 (an RMS norm, a softmax)
      that plain Keras reloads in float32 only if a file says so by path,
      because their parent creates them in its own code with its own
      policy: those stock Keras computes as kerasmp does (`_portable`).
      Keras's own normalization layers are not among them: they compute
      in float32 inside under the mixed policy they are saved with
      (`kerasmp.policy.saving.portable_policy_name`).
    """
    moved = {}  # Layer.path -> (layer, rule)
    ruled = {}
    at = dict(layers)
    for path, layer in layers:
        resolved = layer.dtype_policy
        if not (isinstance(resolved, Float32Override) and layer.path):
            continue
        if _is_measured(resolved.rule):
            moved[layer.path] = (layer, resolved.rule)
        elif (portable_policy_name(resolved) == "float32"
              and not _rebuilt_from_own_config(
                  at.get(path.rpartition("/")[0], model))):
            ruled[layer.path] = (layer, resolved.rule)
    if not moved and not ruled and not policy.measured:
        return
    portable = _portable(model, inputs, layers, {**moved, **ruled})
    # A moved layer hands its override to the sublayers it creates when it
    # is rebuilt: those that computed in half precision are recorded too.
    half = {sub.path: {"half": True} for layer, _ in moved.values()
            for _, sub in walk(layer)
            if sub.path and sub.compute_dtype in _HALF}
    recorded = policy.with_measured({
        **half,
        **{path: {"rule": rule, "portable": True}
           for path, (_, rule) in ruled.items() if path in portable},
        **{path: {"rule": rule, "portable": path in portable}
           for path, (_, rule) in moved.items()}})
    for layer in [model] + [layer for _, layer in layers]:
        stored = stored_policy(layer)
        if isinstance(stored, Policy) and stored == policy:
            layer.dtype_policy = recorded


def _outputs(model, inputs, layers, as_computed=()):
    """`{path: ((dtype, tensor), ...)}` of what each layer's `call`
    returned in one symbolic run, with `as_computed` handing their outputs
    on as stock Keras does; None when the run raised."""
    seen = {}

    def around(path, call, args, kwargs):
        outputs = call(*args, **kwargs)
        seen[path] = tuple((str(getattr(t, "dtype", type(t).__name__)), t)
                           for t in keras.tree.flatten(outputs))
        return outputs

    with outputs_as_computed(as_computed), running_layers(layers, around):
        try:
            _ki.trace_symbolically(lambda x: model(x, training=True), inputs)
        except Exception:  # noqa: BLE001 (stock Keras would fail there)
            return None
    return seen


def _dtypes(outputs):
    return tuple(dtype for dtype, _ in outputs or ())


def _portable(model, inputs, layers, moved):
    """The paths of `moved` that stock Keras, which hands a float32 layer's
    outputs on as computed, reloads as kerasmp computes them: in a symbolic
    run without kerasmp's hand-backs every other layer returns the same
    dtypes as under kerasmp (the caller casts them, or a layer takes them
    next), or, for a container (a keras-hub backbone ending in its final
    norm), hands a moved layer's output on as it is (the layers that take
    it are compared in turn). A group (a moved layer and the moved layers
    inside it) whose float32 outputs meet float16 ones in its caller's own
    arithmetic (GPT-OSS's router scores times its experts' outputs:
    TensorFlow raises) is not portable; nor is one whose float16 sublayers'
    outputs meet its own float32 arithmetic (Qwen3-MoE's experts in its
    moved block)."""
    if not moved:
        return set()
    reference = _outputs(model, inputs, layers)
    if reference is None:
        return set()

    # Stock Keras hands back nothing: neither the group's float32 outputs
    # nor a half-precision sublayer's to a float32 member of the group.
    # (Float32 layers outside the group reload under the mixed policy, with
    # their sublayers: their hand-backs, and those of the half-precision
    # sublayers inside them, stand for that.)
    half = [layer for _, layer in layers if layer.compute_dtype in _HALF]
    paths = {id(layer): path for path, layer in layers}
    if not any(any(h in d for d in _dtypes(reference.get(paths[id(layer)]))
                   for h in _HALF) for layer in half):
        # The trace does not show half precision where it is computed
        # (PyTorch's meta-device trace gives float32 throughout): it cannot
        # tell, so the file keeps the moves for kerasmp only.
        return set()

    def keeps_dtypes(group):
        members = {id(moved[p][0]) for p in group}
        inside = [sub for p in group for _, sub in walk(moved[p][0])
                  if sub.compute_dtype in _HALF]
        seen = _outputs(model, inputs, layers,
                        [moved[p][0] for p in group] + inside)
        if seen is None:
            return False
        theirs = {id(t) for p in group
                  for _, t in seen.get(paths[id(moved[p][0])], ())}
        for path, layer in layers:
            if id(layer) in members:
                continue
            got, want = seen.get(path), _dtypes(reference.get(path))
            if _dtypes(got) == want:
                continue
            if got is None or len(got) != len(want) or not all(
                    dtype == was or id(t) in theirs
                    for (dtype, t), was in zip(got, want)):
                return False
        return True

    roots = [p for p in moved if not any(
        p.startswith(q + "/") for q in moved if q != p)]
    groups = [[p for p in moved if p == root or p.startswith(root + "/")]
              for root in roots]
    return set(_passing(groups, keeps_dtypes))


def _passing(groups, passes):
    """The paths of the `groups` (lists of paths) that `passes` together:
    all of them if they pass at once, else those found by halving (a few
    symbolic runs for many norms and one router that cannot move), then
    checked together once more, and, should they interfere, added one group
    at a time."""

    def halve(part):
        flat = [p for group in part for p in group]
        if not part or passes(flat):
            return part
        if len(part) == 1:
            return []
        mid = len(part) // 2
        return halve(part[:mid]) + halve(part[mid:])

    found = halve(groups)
    flat = [p for group in found for p in group]
    if len(found) == len(groups) or not found or passes(flat):
        return flat
    kept = []
    for group in found:
        if passes(kept + group):
            kept += group
    return kept


def _rebuilt_from_own_config(parent):
    """Whether `parent` (a `Functional` or `Sequential` model with Keras's
    own `get_config`) saves its sublayers' configs and rebuilds each from
    its own, dtype included; other layers, keras-hub's backbones among
    them, create their sublayers in code and hand them their own policy."""
    return type(parent).get_config in (
        _ki.functional_class().get_config, keras.Sequential.get_config)


def move_failed_at_build(layer, error):
    """Moves `layer`, whose symbolic call raised `error` while a model was
    being built (its `__call__` on KerasTensors), to float32 when a
    half-precision kerasmp policy governs it: a layer whose code has no
    float16 path (keras-hub Flux's `TimestepEmbedding`: a float16 `range`
    TensorFlow refuses) fails there, before the model exists to be
    measured. The caller calls the layer again; `keep()` (with the warning
    naming the layer) when that works, `undo()` when it fails too.

    Returns:
        `(keep, undo)`, or None when nothing was moved (a float32 layer, a
        policy kerasmp does not govern, a model: its layers are measured at
        its first call or compile).
    """
    if _running[0] or isinstance(layer, keras.Model):
        return None
    policy = _governing(layer, None)
    dtype = layer.compute_dtype
    if policy is None or dtype not in _HALF:
        return None
    previous = stored_policy(layer)
    layer.dtype_policy = Float32Override(policy, FAILS_RULE.format(
        dtype=dtype))

    def keep():
        name = getattr(layer, "path", None) or layer.name
        warnings.warn(
            f"kerasmp: layer {name!r} ({type(layer).__name__}) fails in "
            f"{dtype} ({_first_line(error)}); it computes in float32.",
            stacklevel=user_stacklevel())

    def undo():
        layer.dtype_policy = previous

    return keep, undo


def _sized(inputs):
    """`inputs` with every unknown size set (2 for the batch, 8 for the
    others, as `kerasmp.check`'s sample batch), or None when all are
    known."""
    flat = keras.tree.flatten(inputs)
    if all(None not in tuple(t.shape) for t in flat):
        return None
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(
            tuple((2 if i == 0 else 8) if d is None else d
                  for i, d in enumerate(t.shape)),
            dtype=t.dtype, name=t.name), inputs)


def _moves(model, policy, inputs, layers, dry_run):
    """The runs and moves of one measurement on `inputs`: `[(path, rule)]`
    of the layers moved. A failure that float32 does not cure ends it."""
    moved = []
    routers, failure = _run(model, inputs, layers)
    for _ in range(MAX_MOVES):
        if failure is None:
            now_moved = _routers(routers, policy)
            if not now_moved:
                break
            moved += now_moved
        else:
            path, layer, error = failure
            if layer is None or _governing(layer, policy) is None or (
                    layer.compute_dtype not in _HALF):
                return moved  # not a layer kerasmp can move
            cured = _cure(model, inputs, layers, failure, policy)
            if cured is None:
                return moved
            now_moved, (routers, failure) = cured
            moved += now_moved
            if dry_run:
                continue
            warnings.warn(
                f"kerasmp: layer {path!r} ({type(layer).__name__}) fails in "
                f"{policy.compute_dtype} ({_first_line(error)}); it computes "
                "in float32"
                + (" with its sublayers." if len(now_moved) > 1 else "."),
                stacklevel=user_stacklevel(),
            )
            continue
        routers, failure = _run(model, inputs, layers)
    return moved


def _routers(routers, policy):
    """Moves each router still computing in half precision, and its score
    projection, to float32."""
    moved = []
    for path, (layer, units) in routers.items():
        rule = ROUTER_RULE
        moved += [(p, rule) for p, _, _ in _move([(path, layer)], policy,
                                                  rule)]
        projections = [(p, sub) for p, sub in walk(layer, prefix=path)
                       if _projects_scores(sub, units)]
        rule = PROJECTION_RULE.format(router=path)
        moved += [(p, rule) for p, _, _ in _move(projections, policy, rule)]
    return moved


def _projects_scores(layer, units):
    """Whether `layer` is a Dense/EinsumDense with one output per expert."""
    if units is None or not isinstance(
            layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return False
    if isinstance(layer, keras.layers.Dense):
        return layer.units == units
    shape = getattr(layer, "full_output_shape", None) or ()
    return bool(shape) and shape[-1] == units
