"""What the distribution ships and declares: one version, the license, the typing marker, and a
package whose subpackages are reachable from a bare ``import mila_py``."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import mila_py

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_version_has_one_source() -> None:
    project = PYPROJECT["project"]
    # setuptools reads the version from the package, so pyproject.toml cannot disagree with it
    assert "version" not in project and "version" in project["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "mila_py.__version__"
    assert isinstance(mila_py.__version__, str) and mila_py.__version__[0].isdigit()


def test_the_installed_metadata_has_the_packages_version() -> None:
    try:
        installed = importlib.metadata.version("mila-py")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mila-py is not installed (pip install -e . installs it)")
    assert installed == mila_py.__version__


def test_the_license_ships_and_is_declared() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "Copyright (c) 2026 The mila_py authors" in text
    assert PYPROJECT["project"]["license"] == "MIT"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    requires = PYPROJECT["build-system"]["requires"]
    assert requires == ["setuptools>=77"]  # the first setuptools that reads an SPDX license


def test_the_typing_marker_ships() -> None:
    assert (Path(mila_py.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["mila_py"]


def test_subpackages_are_attributes_after_a_bare_import() -> None:
    # a fresh interpreter: this process has imported the subpackages already
    code = (
        "import sys, mila_py\n"
        "assert 'mila_py.components' not in sys.modules\n"
        "print(mila_py.components.Rope.__module__, mila_py.optim.AdamW.__name__)\n"
        "assert 'mila_py.interop' not in sys.modules\n"
        "print(mila_py.models.Llama.__module__, mila_py.interop.hf.__name__)\n"
        "try:\n"
        "    mila_py.interop.no_such_module\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
        "try:\n"
        "    mila_py.no_such_module\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "mila_py.components.rope AdamW"
    assert lines[1] == "mila_py.models.llama.network mila_py.interop.hf"
    assert lines[2] == "module 'mila_py.interop' has no attribute 'no_such_module'"
    assert lines[3] == "module 'mila_py' has no attribute 'no_such_module'"
