"""The CUDA ops' kernel sources: every ``.cu`` file packaged and in the kernel emulator's
library, compiled for sm_90 by ``nvcc`` where it is installed, and by NVRTC through CuPy where
CuPy and NVRTC load (no GPU needed for either)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

import pytest
from kernel_emulator import FILES, NAME_EXPRESSIONS, SOURCES, names_in

from mila_py.ops.cuda import _kernels

NVCC = shutil.which("nvcc")


def test_every_kernel_file_is_emulated_and_packaged() -> None:
    """Every ``.cu`` file beside the CUDA ops is in the emulator's library, and the package data
    of ``pyproject.toml`` takes it and the header, so an installed package has what
    ``_kernels.source`` reads."""
    import fnmatch
    import tomllib
    from pathlib import Path

    here = Path(_kernels.__file__).parent
    assert sorted(FILES) == sorted(path.name for path in here.glob("*.cu"))
    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mila_py"]
    for path in [*here.glob("*.cu"), here / _kernels.HEADER]:
        name = path.relative_to(root / "mila_py").as_posix()
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
        assert _kernels.source(path.name) == path.read_text()


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_sources_compile_for_sm90(tmp_path) -> None:
    """Every kernel file, after the header as NVRTC sees it, compiles for Hopper (one nvcc
    run: each source in a namespace of its own, so none relies on another's helpers), every
    template instantiation the ops launch included, and no kernel spills registers."""
    qualified = [  # each instantiation in its source's namespace, its types too
        f"source{i}::" + re.sub(r"\b(mila_half|mila_bf16)\b", rf"source{i}::\1", name)
        for i, source in enumerate(SOURCES)
        for name in names_in(source)
    ]
    assert len(qualified) == len(NAME_EXPRESSIONS)
    path = tmp_path / "sources.cu"
    path.write_text(
        "\n".join(
            f"namespace source{i} {{\n{_kernels.source(_kernels.HEADER)}{source}\n}}"
            for i, source in enumerate(SOURCES)
        )
        # taking a template kernel's address instantiates it
        + "\nvoid* const mila_instances[] = {\n"
        + ",\n".join(f"    (void*)&{name}" for name in qualified)
        + "\n};\n"
    )
    command = [NVCC, "-std=c++17", "-arch=sm_90", "--resource-usage", "-c", str(path)]
    result = subprocess.run(
        [*command, "-o", str(tmp_path / "sources.o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = result.stdout + result.stderr
    entries = re.findall(r"Compiling entry function '([^']+)'", report)
    assert len(entries) == len(NAME_EXPRESSIONS) + sum(
        source.count('extern "C" __global__') for source in SOURCES
    ), report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(entries), report
    assert all(stores == "0" and loads == "0" for stores, loads in spills), report


def _nvrtc() -> Any:
    """CuPy's NVRTC bindings when they load (no GPU needed), else None."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception:  # no CuPy, or no NVRTC library beside it
        return None
    return nvrtc


NVRTC = _nvrtc()


def _nvrtc_compile(source: str, names: Sequence[str]) -> Any:
    """The NVRTC program of ``source`` as :func:`_kernels.module` hands it to CuPy (header,
    options, name expressions), compiled for sm_90; the test fails on an error or a warning."""
    header = _kernels.source(_kernels.HEADER)
    program = NVRTC.createProgram(header + source, "kernels.cu", [], [])
    for name in names:
        NVRTC.addNameExpression(program, name)
    try:
        NVRTC.compileProgram(program, [*_kernels.NVRTC_OPTIONS, "-arch=sm_90"])
    except NVRTC.NVRTCError as exc:
        pytest.fail(f"{exc}\n{NVRTC.getProgramLog(program)}")
    assert NVRTC.getProgramLog(program).strip() == ""
    return program


@pytest.mark.skipif(NVRTC is None, reason="CuPy's NVRTC is not loadable")
@pytest.mark.parametrize("index", range(len(SOURCES)))
def test_cuda_sources_compile_with_nvrtc(index: int) -> None:
    """Each source compiles as :func:`_kernels.module` hands it to CuPy (header, options, the
    name expressions), with NVRTC and no warning, and every instantiation the ops launch gets a
    lowered name. NVRTC has no host headers, unlike nvcc; this needs no GPU, only CuPy and
    NVRTC (``pip install cupy-cuda13x nvidia-cuda-nvrtc``)."""
    source = SOURCES[index]
    names = names_in(source)
    program = _nvrtc_compile(source, names)
    lowered = [NVRTC.getLoweredName(program, name) for name in names]
    assert len(set(lowered)) == len(names)
    cubin = NVRTC.getCUBIN(program)
    kernels = re.findall(
        r'extern "C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)', source
    )
    assert names or kernels
    for symbol in [*kernels, *lowered]:
        assert symbol.encode() in cubin, symbol
