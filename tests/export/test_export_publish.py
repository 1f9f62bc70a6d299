"""kerasmp.export: what is at the output path, at every instant (issues
10.1/10.2), the parity gate and the target checks (issue 11).

Races and kills are made deterministic with
`kerasmp.export.publish._before_publish`, a test hook that a child process
uses to stop right before it publishes.
"""

import glob
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from _models import single_dense

from kerasmp import export as kx
from kerasmp.export import publish as _publish

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np, keras
    from kerasmp import export as kx
    from kerasmp.export import publish as _publish

    path, overwrite, ready, go = sys.argv[1:5]
    mode = sys.argv[5] if len(sys.argv) > 5 else ""

    def pause(staged, target):
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)

    _publish._before_publish = pause
    if mode == "no_renameat2":
        # The fallback: two renames; die between them.
        import signal
        _publish._renameat2_fn = False
        real = os.rename
        def rename(a, b):
            real(a, b)
            if b.endswith("previous"):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename
    keras.utils.set_random_seed(int(sys.argv[6]) if len(sys.argv) > 6 else 1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    fmt = "savedmodel" if mode == "no_renameat2" else "keras"
    try:
        kx.export(model, path, format=fmt, overwrite=overwrite == "1",
                  sample=np.zeros((4, 4), "float32"))
    except FileExistsError as e:
        print("EXISTS:", e, flush=True)
        sys.exit(3)
    print("OK", flush=True)
""")


def _sample():
    return np.random.default_rng(0).standard_normal((8, 4)).astype("float32")


class Child:
    """An export in a child process that stops before publishing."""

    def __init__(self, tmp_path, path, overwrite=False, mode="", seed=1):
        self.ready = str(tmp_path / f"ready-{id(self)}")
        self.go = str(tmp_path / f"go-{id(self)}")
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(path), "1" if overwrite else
             "0", self.ready, self.go, mode, str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )

    def wait_ready(self, timeout=240):
        deadline = time.time() + timeout
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise AssertionError(
                    "the export finished without pausing before its "
                    f"publish: rc={self.proc.returncode}\n{out}\n"
                    f"{err[-2000:]}")
            if time.time() > deadline:
                self.proc.kill()
                raise AssertionError("timed out waiting for the child")
            time.sleep(0.05)

    def resume(self):
        open(self.go, "w").close()
        out, err = self.proc.communicate(timeout=240)
        return self.proc.returncode, out, err

    def kill(self, sig):
        self.proc.send_signal(sig)
        self.proc.communicate(timeout=240)  # reaps it: no zombie pid
        return self.proc.returncode


def _leftovers(folder):
    return sorted(os.path.basename(p)
                  for p in glob.glob(os.path.join(folder, ".kerasmp-*")))


def _predict(path, x):
    return keras.saving.load_model(path, compile=False).predict(x, verbose=0)


# --------------------------------------------------------------------------
# Races
# --------------------------------------------------------------------------


def test_concurrent_export_to_same_path_fails_and_keeps_first(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    path = str(out / "m.keras")
    first = Child(tmp_path, path)
    first.wait_ready()
    # A second export to the same path while the first is running.
    with pytest.raises(FileExistsError, match="Another export is writing"):
        kx.export(single_dense(4, 3), path, format="keras", sample=_sample())
    rc, stdout, err = first.resume()
    assert rc == 0, err[-2000:]
    assert "OK" in stdout
    assert os.path.exists(path)
    assert _leftovers(str(out)) == []


def test_file_created_during_export_is_kept(tmp_path):
    path = tmp_path / "m.keras"
    child = Child(tmp_path, str(path))
    child.wait_ready()
    path.write_bytes(b"someone else's file")
    rc, stdout, _ = child.resume()
    assert rc == 3 and "appeared while exporting" in stdout
    assert path.read_bytes() == b"someone else's file"
    assert _leftovers(str(tmp_path)) == []


def test_sigkill_before_publish_keeps_old_and_next_export_cleans(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    path = str(out / "m.keras")
    x = _sample()
    model = single_dense(4, 3)
    kx.export(model, path, format="keras", sample=x)
    before = _predict(path, x)

    child = Child(tmp_path, path, overwrite=True)
    child.wait_ready()
    assert child.kill(signal.SIGKILL) == -signal.SIGKILL
    np.testing.assert_array_equal(_predict(path, x), before)
    stale = [p for p in _leftovers(str(out)) if "lock" not in p]
    assert stale  # the killed run's staging folder (Python never saw it)

    with pytest.warns(UserWarning, match="removed staging folders"):
        kx.export(model, str(out / "other.keras"), format="keras",
                  sample=x)
    assert _leftovers(str(out)) == []
    np.testing.assert_array_equal(_predict(path, x), before)


def test_sigterm_removes_staging(tmp_path):
    path = tmp_path / "m.keras"
    child = Child(tmp_path, str(path))
    child.wait_ready()
    assert _leftovers(str(tmp_path))  # staging and lock exist now
    assert child.kill(signal.SIGTERM) == -signal.SIGTERM
    assert not path.exists()
    assert _leftovers(str(tmp_path)) == []


def test_keyboard_interrupt_removes_staging(tmp_path, monkeypatch):
    def interrupt(staged, target):
        assert os.path.exists(staged)
        raise KeyboardInterrupt

    monkeypatch.setattr(_publish, "_before_publish", interrupt)
    path = tmp_path / "m.keras"
    with pytest.raises(KeyboardInterrupt):
        kx.export(single_dense(4, 3), str(path), format="keras",
                  sample=_sample())
    assert os.listdir(tmp_path) == []


def test_overwrite_swaps_atomically(tmp_path, monkeypatch):
    path = str(tmp_path / "m.keras")
    x = _sample()
    old, new = single_dense(4, 3), single_dense(4, 3)
    kx.export(old, path, format="keras", sample=x)
    seen = []

    # At the last instant before publishing, the old artifact is complete.
    def check(staged, target):
        seen.append(_predict(target, x))

    monkeypatch.setattr(_publish, "_before_publish", check)
    kx.export(new, path, format="keras", sample=x, overwrite=True)
    np.testing.assert_allclose(seen[0], old.predict(x, verbose=0),
                               atol=1e-2)
    np.testing.assert_allclose(_predict(path, x), new.predict(x, verbose=0),
                               atol=1e-2)
    assert os.listdir(tmp_path) == ["m.keras"]


def _tree(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            full = os.path.join(root, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, folder)] = fh.read()
    return out


@pytest.mark.tensorflow
def test_fallback_kill_between_renames_is_recovered(tmp_path):
    # Without renameat2 (another OS or filesystem) replacing a folder takes
    # two renames; a kill between them leaves the complete old artifact in
    # the staging folder, and the next export to the folder puts it back.
    out = tmp_path / "out"
    out.mkdir()
    path = str(out / "served")
    x = _sample()
    model = single_dense(4, 3)
    kx.export(model, path, format="savedmodel", sample=x)
    before = _tree(path)
    child = Child(tmp_path, path, overwrite=True, mode="no_renameat2")
    child.wait_ready()
    rc, _, _ = child.resume()
    assert rc == -signal.SIGKILL
    assert not os.path.exists(path)  # killed between the two renames

    with pytest.warns(UserWarning, match="restored"):
        kx.export(model, str(out / "other.keras"), format="keras",
                  sample=x)
    assert _tree(path) == before
    assert _leftovers(str(out)) == []


# --------------------------------------------------------------------------
# Target checks and the parity gate
# --------------------------------------------------------------------------


def test_dangerous_paths_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "x.keras" / "work"
    work.mkdir(parents=True)
    (work / "precious.txt").write_text("keep me")
    monkeypatch.chdir(work)
    for bad in (".", os.sep, os.path.expanduser("~"), str(tmp_path),
                str(tmp_path / "x.keras"), ".."):
        with pytest.raises(ValueError, match="`path`"):
            kx.check_target(bad, "savedmodel", overwrite=True)
    # A folder holding the working directory, through export itself.
    with pytest.raises(ValueError, match=r"`path`.*working directory"):
        kx.export(single_dense(4, 3), str(tmp_path / "x.keras"), format="keras",
                  overwrite=True, sample=_sample())
    assert (work / "precious.txt").read_text() == "keep me"


@pytest.mark.tensorflow
def test_export_to_current_directory_is_refused(tmp_path, monkeypatch):
    (tmp_path / "precious.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="`path`"):
        kx.export(single_dense(4, 3), ".", format="savedmodel", overwrite=True,
                  sample=_sample())
    assert os.listdir(tmp_path) == ["precious.txt"]


def test_check_target_rules(tmp_path):
    assert kx.check_target(str(tmp_path / "m.keras"), "keras") == str(
        tmp_path / "m.keras")
    with pytest.raises(ValueError, match=r"`format`.*'onnx'"):
        kx.check_target(str(tmp_path / "m"), "pb")
    with pytest.raises(ValueError, match=r"`path`.*'\.keras'"):
        kx.check_target(str(tmp_path / "m.h5"), "keras")
    with pytest.raises(ValueError, match=r"`path`.*'\.tflite'"):
        kx.check_target(str(tmp_path / "m"), "tflite")
    # The backend comes before the suffix: JAX writes no ONNX at all.
    onnx_error = (r"cannot be written from the JAX backend"
                  if keras.backend.backend() == "jax" else r"`path`.*'\.onnx'")
    with pytest.raises(ValueError, match=onnx_error):
        kx.check_target(str(tmp_path / "m"), "onnx")
    with pytest.raises(ValueError, match=r"`dtype`.*bfloat16"):
        kx.check_target(str(tmp_path / "m.tflite"), "tflite",
                        dtype="bfloat16")
    (tmp_path / "m.keras").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        kx.check_target(str(tmp_path / "m.keras"), "keras")
    with pytest.raises(TypeError, match="`overwrite`"):
        kx.check_target(str(tmp_path / "n.keras"), "keras", overwrite="yes")
    # Checked before any model work: a bad target wins over a bad model.
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"`path`.*'\.keras'"):
        kx.export(unbuilt, str(tmp_path / "m.h5"), format="keras")
    assert "onnx" in kx.FORMATS and '"onnx"' in kx.export.__doc__


def test_docs_format_table_is_generated_from_the_registry():
    from kerasmp.export.registry import format_table

    text = (ROOT / "docs" / "export.md").read_text()
    table = text.split("<!-- formats:begin -->\n")[1].split(
        "<!-- formats:end -->")[0]
    assert table == format_table(), (
        "docs/export.md's format table is stale: paste "
        "kerasmp.export.registry.format_table() between its markers")
    assert [line.split("`")[1] for line in table.splitlines()[2:]] == list(
        kx.FORMATS)


def test_parity_gate_writes_nothing(tmp_path):
    model = single_dense(4, 3)
    x = _sample()
    path = tmp_path / "m.keras"
    with pytest.raises(kx.ParityError, match="max_diff=1e-12") as info:
        kx.export(model, str(path), format="keras", sample=x,
                  max_diff=1e-12)
    report = info.value.report
    assert report.max_abs_diff > 1e-12 and report.path == str(path)
    assert os.listdir(tmp_path) == []
    # An existing artifact survives a failed gate with overwrite=True.
    path.write_bytes(b"old")
    with pytest.raises(kx.ParityError):
        kx.export(model, str(path), format="keras", sample=x,
                  max_diff=1e-12, overwrite=True)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["m.keras"]
    # A passing gate writes.
    report = kx.export(model, str(tmp_path / "ok.keras"), format="keras",
                       sample=x, max_diff=1e-2)
    assert report.passed(1e-2) and (tmp_path / "ok.keras").exists()
    with pytest.raises(ValueError, match="`max_diff`"):
        kx.export(model, str(tmp_path / "n.keras"), format="keras",
                  max_diff=-1)
