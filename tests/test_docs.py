"""Every ```python block of README.md and docs/*.md runs as written.

How the blocks are found and run (also in docs/architecture.md,
"Contributor notes"):

- Every fenced block whose opening fence is exactly ```python is a test
  (blocks in other languages, ```text / ```bash / plain ```, are not run).
- HTML comments on the lines directly above the fence (no blank line in
  between) are markers; one per comment:

  - There is no "not run" marker: a block that only makes sense in
    context `continues` the block that builds its context, and
    `<!-- fragment -->` (which skipped a block) is refused, so that every
    example a reader sees has run.
  - `<!-- name: NAME -->`: names the block, so that a later block can
    continue it. Names are unique within a file.
  - `<!-- continues: NAME -->`: runs after the named earlier block of the
    same file, in the same namespace and folder (it sees that block's
    variables). A named block and all blocks continuing it (directly or
    through each other) form one chain and one test, run in file order.
  - `<!-- backend: jax -->`, `<!-- backend: tensorflow -->`,
    `<!-- backend: torch -->`, `<!-- backend: any -->`: which Keras backend
    the block is for. Without the marker a block is a TensorFlow block. A
    test runs only on its backend (this file runs under
    KERAS_BACKEND=tensorflow and =jax; its `any` and `torch` blocks also
    under =torch, marked `torch`); a continuation inherits its chain's
    backend.
  - `<!-- processes: N -->`: the block is a multi-process job (docs/
    scaling_out.md): it runs as N fresh Python processes on 127.0.0.1,
    under its backend, each with the variables a launcher such as
    `torchrun` sets: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
    and `TF_CONFIG` (a worker cluster of N free ports). Every process
    must exit with status 0 within `PROCESS_TIMEOUT` seconds, else the
    whole process group is killed and the test fails with each one's
    output tail. Such a block stands alone (no `name`/`continues`), and
    its test is marked `slow`.

- Each chain runs in this process (TensorFlow or JAX is imported once), in
  a fresh namespace, in an empty temporary folder as the working
  directory, after `keras.utils.set_random_seed(0)` with the global dtype
  policy and the distribution reset (tests/conftest.py and the fixture
  below). A traceback points at the Markdown file and line.

Keep blocks small: the data that ships with kerasmp (the 8x8 digits,
`kerasmp.data.load_digits()`), tiny models, a few epochs; the whole file
should stay under about two minutes per backend on a CPU.
"""

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BACKEND = keras.backend.backend()

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")
_KEYED = re.compile(r"^(name|continues|backend|processes):\s*(\S+)$")
BACKENDS = ("tensorflow", "jax", "torch", "any")
PROCESS_TIMEOUT = 300  # seconds for a `processes` block's whole job


class Block:
    def __init__(self, path, line, source, markers):
        self.path = path
        self.line = line  # 1-based line of the first code line
        self.source = source
        self.markers = markers  # dict: name/continues/backend

    @property
    def where(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_markers(comment_lines, where):
    markers = {}
    for text in comment_lines:
        body = _MARKER.match(text).group(1)
        if body == "fragment":
            raise ValueError(
                f"{where}: `<!-- fragment -->` skips the block; make it run "
                "(its own imports and data) or `<!-- continues: NAME -->` "
                "the block that builds its context"
            )
        keyed = _KEYED.match(body)
        if not keyed:
            continue  # another kind of comment (ci:..., cli-reference:...)
        key, value = keyed.groups()
        if key in markers:
            raise ValueError(f"{where}: two `{key}` markers")
        if key == "backend" and value not in BACKENDS:
            raise ValueError(
                f"{where}: backend must be one of {', '.join(BACKENDS)}; "
                f"got {value!r}"
            )
        if key == "processes" and not (value.isdigit() and int(value) > 1):
            raise ValueError(
                f"{where}: processes must be an integer of 2 or more; "
                f"got {value!r}"
            )
        markers[key] = value
    return markers


def parse_blocks(path):
    """The ```python blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        language = fence.group(1)
        start = i + 1
        end = start
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if language == "python":
            comments = []
            j = i - 1
            while j >= 0 and _MARKER.match(lines[j]):
                comments.insert(0, lines[j])
                j -= 1
            where = f"{path.relative_to(ROOT)}:{i + 1}"
            blocks.append(
                Block(
                    path,
                    start + 1,
                    "\n".join(lines[start:end]) + "\n",
                    parse_markers(comments, where),
                )
            )
        i = end + 1
    return blocks


def chains():
    """Runnable chains: (root block, [root, continuation, ...])."""
    result = []
    for path in DOC_FILES:
        blocks = parse_blocks(path)
        by_name = {}
        chain_of = {}
        for block in blocks:
            if "processes" in block.markers and (
                    {"name", "continues"} & set(block.markers)):
                raise ValueError(
                    f"{block.where}: a `processes` block stands alone "
                    "(no `name` or `continues`)"
                )
            name = block.markers.get("name")
            if name is not None:
                if name in by_name:
                    raise ValueError(f"{block.where}: duplicate name {name!r}")
                by_name[name] = block
            parent = block.markers.get("continues")
            if parent is None:
                chain = [block]
                result.append(chain)
            else:
                if parent not in by_name or id(by_name[parent]) not in chain_of:
                    raise ValueError(
                        f"{block.where}: `continues: {parent}` names no "
                        "earlier runnable block of this file"
                    )
                chain = chain_of[id(by_name[parent])]
                chain.append(block)
            chain_of[id(block)] = chain
    return result


def chain_backend(chain):
    return chain[0].markers.get("backend", "tensorflow")


def _params():
    params = []
    for chain in chains():
        backend = chain_backend(chain)
        marks = []
        if backend not in ("any", BACKEND):
            marks.append(
                pytest.mark.skip(reason=f"a {backend} block ({BACKEND} run)")
            )
        if backend == "tensorflow":
            marks.append(pytest.mark.tensorflow)
        if backend in ("any", "torch"):
            marks.append(pytest.mark.torch)
        if "processes" in chain[0].markers:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(chain, id=chain[0].where, marks=marks))
    return params


def run_block(block, namespace):
    # Pad with newlines so that tracebacks give the Markdown line numbers.
    source = "\n" * (block.line - 1) + block.source
    code = compile(source, str(block.path), "exec")
    exec(code, namespace)


@pytest.fixture
def doc_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keras.utils.set_random_seed(0)
    yield tmp_path
    if BACKEND == "jax":
        keras.distribution.set_distribution(None)


def run_processes(block, folder, timeout=PROCESS_TIMEOUT):
    """Runs a `processes: N` block as N fresh processes on 127.0.0.1 (see
    the module docstring); fails with every process's output tail unless
    all exit with status 0 in time."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _helpers import free_ports
    from _helpers import subprocess_env

    count = int(block.markers["processes"])
    backend = block.markers.get("backend", "tensorflow")
    script = folder / "job.py"
    # Pad with newlines so that tracebacks give the Markdown line numbers.
    script.write_text("\n" * (block.line - 1) + block.source)
    ports = free_ports(count + 1)
    procs = []
    for rank in range(count):
        env = subprocess_env(BACKEND if backend == "any" else backend)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(count), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(ports[0]),
            TF_CONFIG=json.dumps({
                "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports[1:]]},
                "task": {"type": "worker", "index": rank},
            }),
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(script)], cwd=folder, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, killed whole below
        ))
    outputs, failed = [], False
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                outputs.append(f"(killed after {timeout} s)")
                failed = True
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if failed or any(codes):
        tails = "\n".join(
            f"--- process {rank} (status {code}):\n{out[-2000:]}"
            for rank, (code, out) in enumerate(zip(codes, outputs))
        )
        raise AssertionError(f"the block at {block.where} failed:\n{tails}")


@pytest.mark.parametrize("chain", _params())
def test_doc_block_runs_as_written(chain, doc_env):
    if "processes" in chain[0].markers:
        run_processes(chain[0], doc_env)
        return
    namespace = {"__name__": "__docs__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the docs' own warnings are examples
        for block in chain:
            try:
                run_block(block, namespace)
            except Exception as e:  # noqa: BLE001 - re-raised with the place
                raise AssertionError(
                    f"the block at {block.where} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e


def test_every_block_is_found_and_every_marker_is_valid():
    """The parser sees the blocks a reader sees: one per ```python fence,
    every one run (in a chain): no fragment is skipped."""
    total = 0
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        fences = len(re.findall(r"(?m)^```python\s*$", text))
        blocks = parse_blocks(path)
        assert len(blocks) == fences, path
        total += fences
    in_chains = sum(len(chain) for chain in chains())
    assert in_chains == total


def test_parser_markers(tmp_path):
    """Markers on the lines above a fence: names, continuations, backends;
    an unknown backend, a dangling `continues` or a fragment marker is an
    error."""
    global DOC_FILES
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- name: a -->\n<!-- backend: any -->\n```python\nv = 1\n```\n"
        "text\n<!-- unrelated comment -->\n```python\nu = 0\n```\n"
        "<!-- continues: a -->\n```python\nv += 1\n```\n"
        "```python\nw = 2\n```\n```bash\nls\n```\n"
    )
    saved_root, saved_files = globals()["ROOT"], DOC_FILES
    try:
        globals()["ROOT"] = tmp_path
        DOC_FILES = [doc]
        found = chains()
        assert [[b.line for b in c] for c in found] == [[4, 13], [9], [16]]
        assert chain_backend(found[0]) == "any"
        assert chain_backend(found[1]) == "tensorflow"  # not a marker
        namespace = {}
        for block in found[0]:
            run_block(block, namespace)
        assert namespace["v"] == 2
        doc.write_text("<!-- continues: nope -->\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="names no earlier"):
            chains()
        doc.write_text("<!-- backend: cobol -->\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="backend must be one of"):
            chains()
        doc.write_text("<!-- fragment -->\n```python\nundefined\n```\n")
        with pytest.raises(ValueError, match="fragment.*skips the block"):
            chains()
    finally:
        globals()["ROOT"] = saved_root
        DOC_FILES = saved_files



@pytest.mark.torch
def test_processes_blocks_run_as_separate_processes_and_stop(tmp_path):
    """A `processes: 2` block runs as two processes that see their rank;
    one that hangs is killed, as a group, and fails in bounded time; a
    `processes` block cannot be continued."""
    import time

    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- processes: 2 -->\n<!-- backend: any -->\n```python\n"
        "import os, pathlib\n"
        "assert os.environ['WORLD_SIZE'] == '2'\n"
        "pathlib.Path('rank' + os.environ['RANK']).write_text('x')\n"
        "if os.environ['RANK'] == '1' and os.environ.get('HANG'):\n"
        "    import time; time.sleep(600)\n```\n"
    )
    saved_root, saved_files = globals()["ROOT"], DOC_FILES
    try:
        globals()["ROOT"] = tmp_path
        globals()["DOC_FILES"] = [doc]
        (block,) = parse_blocks(doc)
        run_processes(block, tmp_path)
        assert (tmp_path / "rank0").exists()
        assert (tmp_path / "rank1").exists()
        block.source = "import os\nos.environ['HANG'] = '1'\n" + block.source
        block.line -= 2
        start = time.monotonic()
        with pytest.raises(AssertionError, match="killed after 3 s"):
            run_processes(block, tmp_path, timeout=3)
        assert time.monotonic() - start < 30
        with pytest.raises(ValueError, match="processes must be an integer"):
            parse_markers(["<!-- processes: one -->"], "x.md:1")
        doc.write_text("<!-- processes: 2 -->\n<!-- name: a -->\n"
                       "```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="stands alone"):
            chains()
    finally:
        globals()["ROOT"] = saved_root
        globals()["DOC_FILES"] = saved_files


def named_block(path, name):
    for block in parse_blocks(path):
        if block.markers.get("name") == name:
            return block
    raise LookupError(f"{path.relative_to(ROOT)} has no block named {name!r}")


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX custom loop")
def test_jax_custom_loop_writes_back_batch_norm_statistics(doc_env):
    """The JAX recipe of docs/loss_scaling.md carries the non-trainable
    state (batch-norm moving mean and variance) through `stateless_call` and
    must write it back: otherwise the model evaluates with the initial
    statistics (mean 0, variance 1), which the issue measured as test
    accuracy 0.415 instead of 0.889."""
    import numpy as np

    block = named_block(ROOT / "docs" / "loss_scaling.md", "jax-loop")
    namespace = {"__name__": "__docs__"}
    run_block(block, namespace)
    model = namespace["model"]
    norm = next(
        layer
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    )
    mean = keras.ops.convert_to_numpy(norm.moving_mean)
    variance = keras.ops.convert_to_numpy(norm.moving_variance)
    # Initial values: mean 0, variance 1. After 66 steps with momentum 0.99
    # about half of the batch statistics have been blended in; the ReLU
    # outputs of the convolution have a positive mean.
    assert mean.min() >= 0 and mean.max() > 1e-2, mean
    assert np.abs(variance - 1).max() > 1e-2, variance
    # The optimizer state came back too: the scale and its step counter.
    optimizer = namespace["optimizer"]
    assert int(keras.ops.convert_to_numpy(optimizer.step_counter)) == 66


@pytest.mark.tensorflow  # the README's quickstart is a TensorFlow chain
def test_readme_snippet_reruns_in_the_same_folder(doc_env):
    """Rerunning the README's quickstart and training snippet (same folder,
    'served.keras' already there) must not lose the training to a
    FileExistsError."""
    readme = [c for c in chains() if c[0].path.name == "README.md"]
    chain = next(c for c in readme if c[0].markers.get("name") == "quickstart")
    assert len(chain) == 2  # the quickstart and its continuation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            namespace = {"__name__": "__docs__"}
            for block in chain:
                run_block(block, namespace)
    assert (doc_env / "served.keras").is_file()


@pytest.mark.torch
def test_readme_quickstart_runs_on_pytorch(doc_env):
    """The README's quickstart and its continuation are a TensorFlow chain
    here, but nothing in them is TensorFlow's: a PyTorch user runs them
    as written (its export was format="savedmodel", which PyTorch
    refuses)."""
    if BACKEND != "torch":
        pytest.skip("the PyTorch run of a TensorFlow chain")
    readme = [c for c in chains() if c[0].path.name == "README.md"]
    chain = next(c for c in readme if c[0].markers.get("name") == "quickstart")
    namespace = {"__name__": "__docs__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in chain:
            run_block(block, namespace)
    assert (doc_env / "served.keras").is_file()
