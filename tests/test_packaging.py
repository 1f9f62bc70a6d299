"""What pyproject.toml declares for users: an SPDX license string (the
form setuptools keeps supporting) with its license file, which the wheel
carries, and a `jax` extra the README installs."""

import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from _helpers import ROOT


def test_pyproject_spdx_license_and_jax_extra():
    """setuptools deprecates a `license` table (builds stop on 2027-02-18);
    JAX users get an extra, and the README says how to install it."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    assert any(r.startswith("setuptools>=77")
               for r in project["build-system"]["requires"])
    jax = project["project"]["optional-dependencies"]["jax"]
    assert any(r.split(">")[0].split("[")[0] == "jax" for r in jax)
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "kerasmp[jax]"' in readme
    assert "KERAS_BACKEND=jax kerasmp demo" in readme


def test_readme_installs_torch_as_the_extra_pins_it():
    """The PyTorch setup is the `torch` extra; where the README or
    pyproject.toml names torch's own CPU index, the torch it installs from
    there is the extra's pin (an unpinned one need not be a version the
    suite passes on; pip retries an unreachable index for minutes, so it is
    never the only way)."""
    tomllib = pytest.importorskip("tomllib")

    text = (ROOT / "pyproject.toml").read_text()
    (pin,) = tomllib.loads(text)["project"]["optional-dependencies"]["torch"]
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[torch]"' in readme
    for name, source in (("README.md", readme), ("pyproject.toml", text)):
        installs = re.findall(
            r"pip install\s+(\S+)\s+--index-url\s+"
            r"https://download\.pytorch\.org", source)
        assert installs, name
        for spec in installs:
            assert spec.strip("\"'") == pin, (name, spec)


def _requirement_names(requirements):
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower()
            for r in requirements}


def test_tensorflow_is_an_extra_not_a_base_dependency():
    """A PyTorch or JAX user installs no TensorFlow (1.9 GB, issue 44 item
    8): it is the `tensorflow` extra, which `dev` (the test command) and
    `tflite` (its TensorFlow/JAX route) include; the `torch` and `jax`
    extras do not."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "tensorflow" not in _requirement_names(project["dependencies"])
    extras = {name: _requirement_names(reqs) for name, reqs
              in project["optional-dependencies"].items()}
    for extra in ("tensorflow", "dev", "tflite", "cuda"):
        assert "tensorflow" in extras[extra], extra
    for extra in ("torch", "jax", "plot", "tflite-torch"):
        assert "tensorflow" not in extras[extra], extra
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "kerasmp[tensorflow]"' in readme
    assert "`tensorflow` | tensorflow |" in readme


def test_license_file_is_declared_and_is_the_apache_text():
    """pyproject.toml says Apache-2.0; the LICENSE it names (PEP 639
    `license-files`) is there and is the Apache License 2.0's text."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.slow
def test_wheel_carries_the_license(tmp_path):
    """The built wheel holds LICENSE under its .dist-info and its METADATA
    names it (`License-File`) with the SPDX expression. Built from a copy
    of the sources, so the checkout gets no build/ or .egg-info, with the
    installed setuptools (pyproject.toml asks for 77 or newer)."""
    pytest.importorskip("setuptools", minversion="77")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "kerasmp", source / "kerasmp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--no-build-isolation", "-q", "-w", str(tmp_path / "out"),
         str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "out").glob("kerasmp-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (license_path,) = [n for n in names
                           if n.endswith(".dist-info/licenses/LICENSE")]
        assert (archive.read(license_path).decode()
                == (ROOT / "LICENSE").read_text())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    assert "License-Expression: Apache-2.0" in lines
    assert "License-File: LICENSE" in lines
