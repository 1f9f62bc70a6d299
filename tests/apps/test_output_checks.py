"""Where kerasmp writes, checked before any work: the same checks (and
messages) for the Python API (`kerasmp.export.check_target`,
`kerasmp.export.export`, `run_demo`) and the `kerasmp` command, which names
its flags instead of the arguments."""

import os

import pytest

import kerasmp.export as kx
from kerasmp.apps.cli import main
from kerasmp.apps.demo import run_demo
from kerasmp.export.specs import check_target


def _error(capsys, argv):
    """Runs `kerasmp argv` in-process; returns its one error line."""
    assert main([str(a) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.keras"
    path.write_bytes(b"not read: the output is checked first")
    return path


def test_a_savedmodel_is_a_folder_not_a_suffixed_file(tmp_path, capsys,
                                                      model_file):
    for suffix, fmt in ((".keras", "keras"), (".tflite", "tflite"),
                        (".onnx", "onnx")):
        path = str(tmp_path / f"served{suffix}")
        with pytest.raises(ValueError, match=(
                rf"`path` .* ends in '\{suffix}', but format='savedmodel' "
                rf"writes a folder: name the folder, or pass "
                rf"format='{fmt}'")):
            kx.check_target(path, "savedmodel")
    line = _error(capsys, ["export", model_file, tmp_path / "a.keras"])
    assert "OUT" in line and "--format 'keras'" in line
    assert not (tmp_path / "a.keras").exists()


def test_the_input_model_is_not_an_output(model_file, capsys):
    with pytest.raises(ValueError, match="`path` .* is the input model"):
        check_target(str(model_file), "keras", overwrite=True,
                     source=str(model_file))
    line = _error(capsys, ["export", model_file, model_file, "--format",
                           "keras", "--overwrite"])
    assert "OUT" in line and "is the input model" in line
    assert model_file.read_bytes().startswith(b"not read")


def test_a_folder_where_a_file_goes_and_the_reverse(tmp_path, capsys,
                                                    model_file):
    folder = tmp_path / "taken.keras"
    folder.mkdir()
    file = tmp_path / "taken_savedmodel"
    file.write_text("a file")
    with pytest.raises(ValueError, match="is a folder; expected a file"):
        kx.check_target(str(folder), "keras", overwrite=True)
    with pytest.raises(ValueError, match="is a file; expected a folder"):
        kx.check_target(str(file), "savedmodel", overwrite=True)
    line = _error(capsys, ["export", model_file, folder, "--format", "keras",
                           "--overwrite"])
    assert line.startswith("kerasmp export: error: OUT ")
    assert "is a folder; expected a file path" in line
    line = _error(capsys, ["bench", "--json", folder, "--overwrite"])
    assert "--json" in line and "is a folder" in line
    line = _error(capsys, ["demo", "--out", file])
    assert "--out" in line and "is a file; expected a folder" in line
    with pytest.raises(ValueError, match="`out` .* is a file"):
        run_demo(out=file, verbose=False)
    assert folder.is_dir() and file.read_text() == "a file"


def test_a_missing_folder_is_not_created(tmp_path, capsys, model_file):
    missing = tmp_path / "missing"
    file = tmp_path / "file"
    file.write_text("x")
    for parent, kind in ((missing, "does not exist"),
                         (file, "is not a folder")):
        for fmt, name in (("keras", "m.keras"), ("savedmodel", "m")):
            with pytest.raises(ValueError, match=f"its folder .* {kind}"):
                kx.check_target(str(parent / name), fmt)
        # Checked before the model: nothing is exported, no folder made.
        with pytest.raises(ValueError, match=kind):
            kx.export(None, str(parent / "m.keras"), format="keras")
        line = _error(capsys, ["export", model_file, parent / "m",
                               "--overwrite"])
        assert line.startswith("kerasmp export: error: OUT ") and kind in line
        line = _error(capsys, ["bench", "--json", parent / "r.json"])
        assert "--json" in line and kind in line
    assert not missing.exists() and file.read_text() == "x"


def test_an_unwritable_folder_is_refused(tmp_path, capsys, model_file,
                                         monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # A stand-in for chmod, which does not stop root (as in CI containers).
    monkeypatch.setattr(os, "access", lambda p, mode: (
        os.path.realpath(p) != str(locked.resolve())
        and real_access(p, mode)))
    with pytest.raises(ValueError, match="cannot write in .*permission"):
        kx.check_target(str(locked / "m.keras"), "keras")
    with pytest.raises(ValueError, match="`out` .* cannot write in"):
        run_demo(out=locked, verbose=False)
    line = _error(capsys, ["export", model_file, locked / "m.keras",
                           "--format", "keras"])
    assert "OUT" in line and "cannot write in" in line
    line = _error(capsys, ["bench", "--json", locked / "r.json"])
    assert "--json" in line and "cannot write in" in line
    line = _error(capsys, ["demo", "--out", locked / "sub"])
    assert "--out" in line and "cannot write in" in line
    assert os.listdir(locked) == []


def test_an_existing_output_needs_overwrite(tmp_path, capsys):
    result = tmp_path / "r.json"
    result.write_text("{}")
    line = _error(capsys, ["bench", "--json", result])
    assert "--json" in line and "pass --overwrite" in line
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        kx.check_target(str(tmp_path), "savedmodel")
    assert result.read_text() == "{}"
