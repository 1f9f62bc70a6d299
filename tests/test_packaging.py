"""What pyproject.toml declares for users: an SPDX license string (the
form setuptools keeps supporting) and a `jax` extra the README installs."""

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
