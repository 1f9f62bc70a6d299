"""The `kerasmp` command as a user runs it: a subprocess of this Python.

Each command runs `python -m kerasmp.apps.cli` with the tested package first on
PYTHONPATH (the worktree in development, the editable install in CI). Most
cases are user errors, which must be found before Keras/TensorFlow/JAX is
imported: a small driver reports which heavy modules the command imported,
so those runs stay fast (a fraction of a second each).
"""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import subprocess_env
from _models import single_dense

import kerasmp
from kerasmp.apps import cli
from kerasmp.apps.choices import BENCH_POLICIES
from kerasmp.apps.choices import BENCH_PRESETS
from kerasmp.apps.choices import DEMO_POLICIES
from kerasmp.apps.cli.loading import unsafe_contents
from kerasmp.export import FORMATS

ROOT = Path(kerasmp.__file__).resolve().parents[1]
HEAVY = ("keras", "tensorflow", "jax")
C_LOG = re.compile(r"^(?:[IWEF]\d{4} |WARNING: All log messages)", re.M)

# Runs the command like `python -m kerasmp.apps.cli ARGS`, then reports on
# stderr which heavy modules it imported.
DRIVER = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: print('HEAVY=' + ','.join(sorted(m for m in "
    f"{HEAVY!r} if m in sys.modules)), file=sys.stderr))\n"
    "sys.argv = ['kerasmp'] + sys.argv[1:]\n"
    "runpy.run_module('kerasmp.apps.cli', run_name='__main__',\n"
    "                 alter_sys=True)\n"
)


def run_kerasmp(*args, cwd=None, env=None, timeout=300, driver=True):
    """Runs the tested package's `kerasmp`; returns (rc, out, err, heavy)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
    command = ([sys.executable, "-c", DRIVER] if driver
               else [sys.executable, "-m", "kerasmp.apps.cli"])
    proc = subprocess.run(
        command + [str(a) for a in args], cwd=cwd, env=full_env,
        capture_output=True, text=True, timeout=timeout)
    err, heavy = proc.stderr, None
    match = re.search(r"^HEAVY=(.*)$", err, re.M)
    if match:
        heavy = [m for m in match.group(1).split(",") if m]
        err = err[:match.start()] + err[match.end() + 1:]
    return proc.returncode, proc.stdout, err, heavy


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """A tiny .keras model and other inputs, saved once per session."""
    d = tmp_path_factory.mktemp("cli_files")
    model = keras.Sequential([
        keras.Input((4,), name="x"),
        keras.layers.Dense(3, name="dense", dtype="float32"),
        keras.layers.Activation("softmax", name="probs", dtype="float32"),
    ])
    model.set_weights([np.linspace(-2, 2, 12).reshape(4, 3)
                       .astype("float32"), np.zeros(3, "float32")])
    model.save(d / "tiny.keras")
    np.save(d / "x.npy", np.random.default_rng(0).normal(
        size=(16, 4)).astype("float32"))
    (d / "notes.txt").write_text("not a model\n")
    (d / "model.tflite").write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(64))
    np.save(d / "objects.npy", np.array([{"a": 1}], dtype=object),
            allow_pickle=True)
    saved = d / "saved"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"")
    (d / "existing_out").write_text("keep me\n")
    return d


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---------------------------------------------------------------- start-up


@pytest.mark.parametrize("args, code", [
    (["--help"], 0),
    (["doctor", "--help"], 0),
    (["inspect", "--help"], 0),
    (["demo", "--help"], 0),
    (["export", "--help"], 0),
    (["bench", "--help"], 0),
    ([], 2),
    (["nope"], 2),
    (["export", "m.keras", "out", "--dtype", "float8"], 2),
    (["export", "m.keras", "out", "--format", "pt"], 2),
    (["export", "m.keras", "out", "--max-diff", "-1"], 2),
    (["export", "m.keras", "out", "--keep-float32", "("], 2),
    (["export", "m.keras"], 2),
    (["demo", "--epochs", "0"], 2),
    (["demo", "--seed", "x"], 2),
    (["demo", "--policy", "float16"], 2),
    (["bench", "--steps", "1"], 2),
    (["bench", "--models", "resnet"], 2),
])
def test_help_and_argument_errors_import_no_framework(args, code, tmp_path):
    rc, out, err, heavy = run_kerasmp(*args, cwd=tmp_path)
    assert rc == code, err
    assert heavy == [], f"imported {heavy} for {args}"
    assert "Traceback" not in err
    if code == 0:
        assert out.startswith("usage: kerasmp")
    else:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kerasmp"), err
        assert "error:" in lines[0]
    assert _listing(tmp_path) == []


def test_help_names_every_export_format_and_the_parity_gate():
    top = cli.build_parser().format_help()
    assert "onnx" in top and "tflite" in top and "savedmodel" in top
    export_help = " ".join(cli.build_parser().commands["export"]
                           .format_help().split())
    assert "{keras,savedmodel,tflite,onnx,torch}" in export_help
    assert "leaves NOTHING at OUT" in export_help
    assert "RUNS THE FILE'S CODE" in export_help


def test_import_kerasmp_is_lazy_and_keeps_its_api():
    script = (
        "import sys\n"
        "import kerasmp\n"
        "assert not {'keras', 'tensorflow', 'jax'} & set(sys.modules), "
        "sorted(sys.modules)\n"
        "assert set(kerasmp.__all__) <= set(dir(kerasmp))\n"
        "assert callable(kerasmp.doctor)  # the function\n"
        "import keras\n"
        "# Loading needs kerasmp's classes registered: a bare import does.\n"
        "for name in ('kerasmp>Policy', 'kerasmp>LossScaleOptimizer',\n"
        "             'kerasmp>Float32Override'):\n"
        "    assert keras.saving.get_registered_object(name) is not None\n"
        "from kerasmp import Policy, callbacks, export\n"
        "from kerasmp import *  # noqa\n"
        "assert kerasmp.Policy is Policy and callbacks.LossScaleMonitor\n"
        "# The monitors also sit beside Float8Monitor at the top level.\n"
        "assert kerasmp.LossScaleMonitor is callbacks.LossScaleMonitor\n"
        "assert kerasmp.NonFiniteMonitor is callbacks.NonFiniteMonitor\n"
        "assert kerasmp.export.export and kerasmp.doctor().backend\n"
        "for name in kerasmp.__all__:\n"
        "    getattr(kerasmp, name)\n"
        "print('ok')\n"
    )
    proc = _run_fresh(script)
    assert proc.stdout.strip() == "ok"


def _run_fresh(script):
    """Runs `script` in a new Python process that imports this checkout's
    kerasmp; fails the test with its stderr when it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("first", [
    "import kerasmp\nkerasmp.set_global_policy('mixed_float16')",
    "from kerasmp.policy import Policy, set_global_policy\n"
    "set_global_policy(Policy('mixed_float16'))",
    "import kerasmp\nimport keras\nkerasmp.set_global_policy('mixed_float16')",
])
def test_the_policy_works_whichever_is_imported_first(first):
    # kerasmp's first use imports Keras from inside a kerasmp module: the
    # patches then install when that import finishes (installing them in
    # the middle of it failed, silently, and a LayerNormalization built
    # under kerasmp's policy computed in float16).
    script = (
        f"{first}\n"
        "import keras\n"
        "norm = keras.layers.LayerNormalization()\n"
        "dense = keras.layers.Dense(2)\n"
        "print(norm.compute_dtype, dense.compute_dtype)\n"
    )
    proc = _run_fresh(script)
    assert proc.stdout.split() == ["float32", "float16"]


@pytest.mark.tensorflow
def test_inspect_is_quiet_and_prints_the_report(files):
    env = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": None}
    rc, out, err, heavy = run_kerasmp("inspect", files / "tiny.keras",
                                      env=env)
    assert rc == 0, err
    assert re.search(r"dense\s+Dense\s+float32", out)
    assert re.search(r"probs\s+Activation\s+float32", out)
    assert not C_LOG.search(err), err  # no TensorFlow C++/absl start-up logs
    assert "Traceback" not in err


def test_inspect_says_what_the_file_holds(tmp_path, capsys):
    """Issue 35 item 9: a layer's kerasmp policy is what the saved file
    holds, not compared with the inspecting process's global policy."""
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16")):
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, name="dense")])
    model.save(tmp_path / "m.keras")
    # The reference: the policy the file holds for that layer.
    with zipfile.ZipFile(tmp_path / "m.keras") as z:
        dtype = re.search(r'"name": "dense".*?"dtype": (\{.*?\}), "units"',
                          z.read("config.json").decode()).group(1)
    assert '"kerasmp": {"class_name": "Policy", "config": {"name": ' \
        '"mixed_float16"' in dtype
    assert cli.main(["inspect", str(tmp_path / "m.keras")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "Dense" in line)
    assert re.search(r"dense\s+Dense\s+float16\s+float32\s+kerasmp policy "
                     r"mixed_float16 \(saved in the file\)", row), out
    assert "now" not in out


# ---------------------------------------------------------------- user errors


def _user_error_cases(d):
    m, out = d / "tiny.keras", d / "new_out"
    return [
        (["inspect", d / "notes.txt"], "notes.txt"),
        (["inspect", d / "missing.keras"], "missing.keras"),
        (["inspect", d / "saved"], "SavedModel folder"),
        (["inspect", d / "model.tflite"], "TFLite"),
        (["export", d / "notes.txt", out], "notes.txt"),
        (["export", m, d / "existing_out"], "--overwrite"),
        (["export", m, out, "--format", "keras"], "must end in '.keras'"),
        (["export", m, d / "a.keras"], "--format 'savedmodel'"),
        (["export", m, d / "m.onnx", "--format", "tflite"], "'.tflite'"),
        (["export", m, m, "--format", "keras", "--overwrite"],
         "is the input model"),
        (["export", m, d / "no_dir" / "o.keras", "--format", "keras"],
         "does not exist"),
        (["export", m, out, "--sample", d / "notes.txt"], "--sample"),
        (["export", m, out, "--sample", d / "objects.npy"], "--sample"),
        (["export", m, out, "--sample", d / "none.npy"], "--sample"),
        # A .keras is a zip as an .npz is: named for what a sample is.
        (["export", m, out, "--sample", m], "a sample is a .npy file"),
        (["check", m, "--sample", m], "a sample is a .npy file"),
        (["export", m, d / "o.tflite", "--format", "tflite", "--dtype",
          "bfloat16"], "--dtype"),
        (["bench", "--quick", "--json", d / "no_dir" / "x.json"],
         "--json"),
        (["bench", "--json", d / "notes.txt"], "--overwrite"),
        (["bench", "--preset", "gpu", "--models", "mlp"], "--models"),
        (["bench", "--policies", "float32", "float32"], "--policies"),
        (["demo", "--out", d / "notes.txt"], "--out"),
        (["demo", "--out", d / "notes.txt" / "sub"], "--out"),
    ]


def test_user_errors_are_one_line_exit_2_and_write_nothing(files):
    before = _listing(files)
    env = {"KERAS_BACKEND": "tensorflow"}  # nothing imports it here
    for args, expected in _user_error_cases(files):
        rc, out, err, heavy = run_kerasmp(*args, cwd=files, env=env)
        shown = " ".join(str(a) for a in args)
        assert rc == 2, f"{shown}: rc {rc}\n{err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1, f"{shown}:\n{err}"
        assert lines[0].startswith(f"kerasmp {args[0]}: error: "), err
        assert expected in lines[0], f"{shown}: {lines[0]}"
        assert heavy == [], f"{shown}: imported {heavy} before checking"
        assert _listing(files) == before, f"{shown} wrote files"
    assert (files / "existing_out").read_text() == "keep me\n"


def test_debug_shows_the_traceback_of_a_user_error(files):
    rc, _, err, _ = run_kerasmp("--debug", "inspect", files / "notes.txt")
    assert rc != 0
    assert "Traceback" in err and "UsageError" in err


def test_misspelt_flag_points_at_the_subcommands_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--jsn"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "kerasmp doctor: error: unrecognized arguments: --jsn" in err
    assert "did you mean --json?" in err
    assert "(see 'kerasmp doctor --help')" in err


# ---------------------------------------------------------------- export


def test_failed_parity_gate_leaves_nothing(files, tmp_path, capsys):
    model, sample = files / "tiny.keras", files / "x.npy"
    out = tmp_path / "half.keras"
    rc, stdout, err, _ = run_kerasmp(
        "export", model, out, "--format", "keras", "--sample", sample,
        "--max-diff", "1e-9", cwd=tmp_path)
    assert rc == 1, err
    assert "parity FAILED" in err and "nothing was written" in err
    assert "kerasmp export report" in stdout
    assert _listing(tmp_path) == []  # no artifact, no staging folder
    # In-process from here (the same code, without another TensorFlow
    # start-up). An existing OUT stays as it was when --overwrite meets a
    # failed gate.
    out.write_text("earlier artifact\n")
    args = ["export", str(model), str(out), "--format", "keras", "--sample",
            str(sample), "--overwrite"]
    assert cli.main(args + ["--max-diff", "1e-9"]) == 1
    assert "parity FAILED" in capsys.readouterr().err
    assert out.read_text() == "earlier artifact\n"
    assert _listing(tmp_path) == ["half.keras"]
    # A gate the export meets: written, and it loads with plain Keras.
    assert cli.main(args + ["--json"]) == 0
    assert '"max_abs_diff"' in capsys.readouterr().out
    half = keras.saving.load_model(out, compile=False)
    x = np.load(sample)
    reference = keras.saving.load_model(model, compile=False).predict(
        x, verbose=0)
    np.testing.assert_allclose(half.predict(x, verbose=0), reference,
                               atol=1e-2)
    assert _listing(tmp_path) == ["half.keras"]


# ---------------------------------------------------------------- untrusted


def _evil_keras(folder):
    """A .keras file whose kerasmp policy names a module next to it."""
    path = folder / "evil.keras"
    marker = folder / "PWNED"
    (folder / "evil_rule.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "class Rule:\n    pass\n")
    with kerasmp.policy_scope(kerasmp.Policy(
            "mixed_float16", float32_layers=[keras.layers.Softmax],
            float32_defaults=False)):
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, name="dense"),
                                  keras.layers.Softmax(name="probs")])
    model.save(folder / "clean.keras")
    with zipfile.ZipFile(folder / "clean.keras") as src, \
            zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "config.json":
                assert b'"keras.src.layers.activations.softmax"' in data
                data = data.replace(
                    b'"module": "keras.src.layers.activations.softmax", '
                    b'"class_name": "Softmax"',
                    b'"module": "evil_rule", "class_name": "Rule"')
                assert b"evil_rule" in data
            dst.writestr(item, data)
    return path, marker


def test_inspect_and_export_refuse_files_that_run_code(tmp_path):
    evil, marker = _evil_keras(tmp_path)
    lam = tmp_path / "lambda.keras"
    keras.Sequential([keras.Input((4,)),
                      keras.layers.Lambda(lambda x: x * 2, name="times2")]
                     ).save(lam)
    env = {"PYTHONPATH": str(tmp_path)}  # the module is importable
    for args, expected in [
        (["inspect", evil], "evil_rule"),
        (["export", evil, tmp_path / "o.keras", "--format", "keras"],
         "evil_rule"),
        (["inspect", lam], "times2"),
        (["export", lam, tmp_path / "o.keras", "--format", "keras"],
         "times2"),
    ]:
        rc, _, err, _ = run_kerasmp(*args, cwd=tmp_path, env=env)
        lines = err.strip().splitlines()
        assert rc == 2, err
        assert len(lines) == 1 and expected in lines[0], err
        assert "--unsafe" in lines[0]
        assert not marker.exists(), "the file's module was imported"
        assert not (tmp_path / "o.keras").exists()
    # --unsafe is the explicit opt-in: the lambda model then loads.
    rc, out, err, _ = run_kerasmp("inspect", lam, "--unsafe", cwd=tmp_path)
    assert rc == 0, err
    assert re.search(r"times2\s+Lambda", out)


def test_unsafe_contents_finds_modules_and_lambdas():
    config = {"module": "keras", "class_name": "Sequential", "config": {
        "layers": [
            {"module": "keras.layers", "class_name": "Dense", "config": {}},
            {"module": "mypkg.layers", "class_name": "Custom", "config": {}},
            {"module": "keras.layers", "class_name": "Lambda",
             "config": {"name": "f", "function": {
                 "class_name": "__lambda__", "config": {}}}},
        ],
        "dtype": {"module": "kerasmp.policy", "class_name": "Policy"}}}
    assert unsafe_contents(config) == [("module", "mypkg.layers"),
                                           ("lambda", "f")]


# ---------------------------------------------------------------- Unix tool


@pytest.mark.parametrize("command", ["doctor", "inspect"])
def test_a_closed_pipe_is_quiet(command, tmp_path, monkeypatch, capsys):
    """`kerasmp ... | head`: the reader closes the pipe; the command stops
    without a traceback or an 'internal error' line."""
    import io

    argv = [command, "--json"]
    if command == "inspect":
        model = single_dense(3, 2)
        model.save(tmp_path / "m.keras")
        argv.append(str(tmp_path / "m.keras"))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) has exited
    stdout = io.TextIOWrapper(os.fdopen(write_end, "wb"), write_through=False)
    monkeypatch.setattr("sys.stdout", stdout)
    status = cli.main(argv)
    assert status == 141
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err, err


@pytest.mark.tensorflow  # runs a JAX subprocess; once is enough
def test_no_tensorflow_start_up_lines_on_jax(tmp_path):
    """On JAX, Keras still imports TensorFlow when it is installed
    (`set_random_seed`, saving); its C++ start-up lines (oneDNN, cuInit)
    must stay out of `kerasmp export` as they do on TensorFlow."""
    model = single_dense(3, 2)
    model.save(tmp_path / "m.keras")
    env = subprocess_env("jax")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user's shell has it
    proc = subprocess.run(
        [sys.executable, "-m", "kerasmp.apps.cli", "export",
         str(tmp_path / "m.keras"), str(tmp_path / "h.keras"),
         "--format", "keras"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kerasmp export report" in proc.stdout
    for noise in ("I0000", "E0000", "W0000", "oneDNN", "InitializeLog",
                  "cuInit"):
        assert noise not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- docs


def _readme_block():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("<!-- cli-reference:start -->\n")
    end = text.index("<!-- cli-reference:end -->")
    return text[start + len("<!-- cli-reference:start -->\n"):end], text


def test_readme_cli_reference_is_generated_from_the_parser():
    block, text = _readme_block()
    assert block.strip() == cli.markdown_reference().strip(), (
        "README.md's command-line reference is stale: regenerate it with "
        "python -c 'from kerasmp.apps import cli; "
        "print(cli.markdown_reference())'")
    parser = cli.build_parser()
    for name, sub in parser.commands.items():
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in block, (name, flag)
    for fmt in FORMATS:
        assert fmt in block
    # The two commands .ci/run reads stay as they are.
    assert ("<!-- ci:demo -->\n```bash\npip install -e "
            "\".[tensorflow,plot]\" && "
            "kerasmp demo\n```") in text
    assert ("<!-- ci:test -->\n```bash\npip install -e \".[dev]\" && "
            "bash tests/run.sh -q\n```") in text


def test_help_lists_the_choices_demo_and_bench_accept():
    from kerasmp.apps import bench
    from kerasmp.apps import demo

    subs = cli.build_parser().commands
    demo_help = " ".join(subs["demo"].format_help().split())
    bench_help = " ".join(subs["bench"].format_help().split())
    assert "{mixed_float16,mixed_bfloat16}" in demo_help
    assert "(default 12, 2 with --quick)" in demo_help
    assert "{quick,default,cpu,gpu,smoke}" in bench_help
    # --models and --policies show a metavar; the reference lists them.
    reference = cli.markdown_reference()
    assert ("`--policies`: policies to compare; ratios are relative to the "
            "first (default: float32 mixed_bfloat16 on a CPU, where float16 "
            "has no fast kernels; float32 mixed_float16 mixed_bfloat16 on a "
            "GPU) (one of: "
            "float32, float32_highest, mixed_float16, mixed_bfloat16, "
            "float8_mixed_bfloat16)") in reference
    assert "(one of: mlp, cnn, transformer)" in reference
    # What --help offers is what the modules accept, and nothing else.
    for policy in DEMO_POLICIES:
        demo._check_args(policy, None, 0, False, 32)
    with pytest.raises(ValueError, match="policy"):
        demo._check_args("float16", None, 0, False, 32)
    with pytest.raises(ValueError, match="policies"):
        bench.run_bench("quick", policies=["float16"])
    for preset, spec in BENCH_PRESETS.items():
        models = tuple(s.name for s in bench.PRESETS[preset]["models"])
        assert models == tuple(spec["models"])
        args = cli.build_parser().parse_args(
            ["bench", "--preset", preset, "--models", *models,
             "--policies", *BENCH_POLICIES])
        assert args.models == list(models)
        with pytest.raises(ValueError, match="`models`"):
            bench.run_bench(preset, models=["resnet"])


# ---------------------------------------------------------------- run.sh


def _fake_python(tmp_path, body):
    """A folder holding a fake `python`: a shell script running `body`
    (`{log}` in it: the log file's path), then exiting 0; returns
    `(folder, log)`."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "calls.txt"
    (fake / "python").write_text(
        "#!/bin/sh\n" + body.replace("{log}", str(log)) + "exit 0\n")
    (fake / "python").chmod(0o755)
    return fake, log


def _fake_run_sh(tmp_path, failing, args, status=1):
    """tests/run.sh with a fake `python` that logs its arguments and exits
    with `status` for pytest under the backend `failing`."""
    fake, log = _fake_python(
        tmp_path, "echo \"$KERAS_BACKEND $*\" >> {log}\n"
        "case \"$*\" in *pytest*) "
        f"[ \"$KERAS_BACKEND\" = \"$FAILING\" ] && exit {status};; esac\n")
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
               FAILING=failing)
    env.pop("KERASMP_TEST_WORKERS", None)  # the default count, two
    proc = subprocess.run(["bash", str(ROOT / "tests" / "run.sh"), *args],
                          env=env, capture_output=True, text=True,
                          timeout=60)
    calls = [c for c in log.read_text().splitlines() if "-m pytest" in c]
    return proc, calls


@pytest.mark.parametrize("is_nightly", [True, False])
def test_run_sh_keras_nightly_runs_with_the_nightly_first_or_stops(
        is_nightly, tmp_path):
    # A fake `python` (the caller's, a venv's or not): `-m pip` installs
    # nothing, `python -` (the script's check that keras imports as the
    # installed nightly) passes or fails, and every call logs its
    # PYTHONPATH; no network.
    fake, log = _fake_python(
        tmp_path, "echo \"$KERAS_BACKEND|$PYTHONPATH|$*\" >> {log}\n"
        f"[ \"$1\" = - ] && exit {0 if is_nightly else 1}\n")
    folder = tmp_path / "nightly"
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
               KERASMP_NIGHTLY_DIR=str(folder), PYTHONPATH="/elsewhere")
    env.pop("KERASMP_TEST_WORKERS", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "run.sh"), "--keras-nightly", "-q"],
        env=env, capture_output=True, text=True, timeout=60)
    calls = [line.split("|") for line in log.read_text().splitlines()]
    # The nightly alone, into the folder, with the caller's python.
    assert calls[0][2] == (
        "-m pip install --quiet --disable-pip-version-check --no-deps "
        f"--upgrade --target {folder} keras-nightly")
    # The check and every pass import from the folder first, then this
    # checkout, then the caller's PYTHONPATH.
    path = f"{folder}:{ROOT}:/elsewhere"
    assert calls[1][1:] == [path, "-"]
    passes = [c for c in calls if "-m pytest" in c[2]]
    if is_nightly:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [c[0] for c in passes] == ["tensorflow", "jax", "torch"]
        assert {c[1] for c in passes} == {path}
    else:
        # Not the nightly: no pass runs, and the script fails.
        assert proc.returncode == 1 and passes == []


@pytest.mark.parametrize("failing, code", [
    ("tensorflow", 1), ("jax", 1), ("torch", 1), ("none", 0)])
def test_run_sh_runs_every_backend(failing, code, tmp_path):
    proc, calls = _fake_run_sh(tmp_path, failing, ["-q"])
    assert proc.returncode == code, proc.stdout + proc.stderr
    if code:
        assert f"FAILED on: {failing}" in proc.stderr
    # The fake python also answers run.sh's `import xdist` and `import
    # torch` probes (yes), so the three passes get two xdist workers; the
    # slow tests are left out; PyTorch runs the tests marked `torch`.
    assert calls == [
        "tensorflow -m pytest -m not slow -n 2 --dist worksteal -q",
        "jax -m pytest -m not tensorflow and (not slow) -n 2 --dist worksteal"
        " -q",
        "torch -m pytest -m torch and not tensorflow and (not slow) -n 2 "
        "--dist worksteal -q"]


@pytest.mark.parametrize("flag, tf_marks, jax_marks", [
    ("--slow", "-m slow ", "not tensorflow and (slow)"),
    ("--all", "", "not tensorflow")])
def test_run_sh_slow_and_all(flag, tf_marks, jax_marks, tmp_path):
    torch_marks = jax_marks.replace("not tensorflow",
                                    "torch and not tensorflow")
    # pytest's status 5 (nothing selected: no slow test runs on JAX) is not
    # a failure; status 1 is.
    proc, calls = _fake_run_sh(tmp_path, "jax", [flag, "-q"], status=5)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls == [
        f"tensorflow -m pytest {tf_marks}-n 2 --dist worksteal -q",
        f"jax -m pytest -m {jax_marks} -n 2 --dist worksteal -q",
        f"torch -m pytest -m {torch_marks} -n 2 --dist worksteal -q"]


def _fake_pyenv(tmp_path):
    """A pyenv root holding Pythons 3.12.1 and 3.12.9: a `python` that logs
    how it was called (its own path first), makes a venv as a copy of
    itself, answers run.sh's probes (xdist yes, torch no) and runs the
    lane's inline scripts with this Python."""
    log = tmp_path / "calls.txt"
    script = (
        "#!/bin/sh\n"
        f"echo \"$0 $KERAS_BACKEND $*\" >> {log}\n"
        "case \"$1 $2\" in\n"
        "  '-m venv') mkdir -p \"$3/bin\"; cp \"$0\" \"$3/bin/python\";;\n"
        "  '-c import torch') exit 1;;\n"
        f"  '- ') exec {sys.executable} -;;\n"
        "esac\n"
        "exit 0\n")
    for version in ("3.12.1", "3.12.9"):
        bin_dir = tmp_path / "pyenv" / "versions" / version / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "python").write_text(script)
        (bin_dir / "python").chmod(0o755)
    return tmp_path / "pyenv", log


def test_run_sh_python_lane(tmp_path):
    root, log = _fake_pyenv(tmp_path)
    env = dict(os.environ, PYENV_ROOT=str(root))
    # As a user calls it: not from inside a pass of run.sh (which sets
    # KERAS_BACKEND, which the fake logs), with the default worker count.
    for name in ("KERASMP_PYTHON_VENV", "KERAS_BACKEND",
                 "KERASMP_TEST_WORKERS"):
        env.pop(name, None)
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "run.sh"), "--python", "3.12", "-q"],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    base = str(root / "versions" / "3.12.9" / "bin" / "python")  # newest
    assert calls[0].startswith(f"{base}  -m venv /tmp/kerasmp-python-3.12.")
    venv = Path(calls[0].split()[-1])
    python = str(venv / "bin" / "python")
    pip = [c for c in calls if " -m pip install " in c]
    assert len(pip) == 1 and pip[0].startswith(python)
    words = pip[0].split()
    assert "-e" in words and ".[jax,tensorflow,plot,onnx,tflite]" in words
    assert "pytest" in words and "pytest-xdist" in words
    assert not [w for w in words if "torch" in w], words
    # The suite's TensorFlow and JAX passes, with the venv's python; no
    # PyTorch pass.
    assert [c for c in calls if "-m pytest" in c] == [
        f"{python} tensorflow -m pytest -m not slow -n 2 --dist worksteal "
        "-q",
        f"{python} jax -m pytest -m not tensorflow and (not slow) -n 2 "
        "--dist worksteal -q"]
    assert "KERAS_BACKEND=torch: skipped" in proc.stdout
    assert not venv.exists()  # the throwaway environment is deleted


@pytest.mark.parametrize("args, words", [
    ([], "--python needs a version such as 3.12 (got '')"),
    (["3.99"], "no Python 3.99 found"),
])
def test_run_sh_python_lane_errors(tmp_path, args, words):
    root, log = _fake_pyenv(tmp_path)
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "run.sh"), "--python", *args, "-q"]
        if args else ["bash", str(ROOT / "tests" / "run.sh"), "--python"],
        env=dict(os.environ, PYENV_ROOT=str(root)), capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert "bash tests/run.sh --python 3.12" in lines[0] or "3.99" in lines[0]
    assert not log.exists()  # nothing ran
