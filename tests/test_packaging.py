"""What pyproject.toml declares for users: an SPDX license string (the
form setuptools keeps supporting) and a `jax` extra the README installs."""

import re

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
