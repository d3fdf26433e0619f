"""Fetch the pure-Python RoPE peers of ``rope_cuda.py`` for a GPU machine that cannot download.

For a GPU machine that has PyTorch, Triton and einops but neither Liger-Kernel nor
flash-attention, and reaches no registry. Both peers' RoPE kernels are Triton code:

- Liger-Kernel: its wheel is pure Python; unpacked whole.
- flash-attention: the wheel needs its compiled CUDA extension, which the rotary kernel does not
  use. From the source distribution, only ``flash_attn/ops/triton/rotary.py`` and
  ``flash_attn/layers/rotary.py`` (with its license) are kept, under empty package
  ``__init__.py`` files, so ``from flash_attn.layers.rotary import apply_rotary_emb`` imports
  without the extension.

Run here, where PyPI is reachable: ``python benchmarks/gpu_peers.py`` writes ``.gpu_peers/site``
(git-ignored). Then carry ``.gpu_peers`` to the GPU machine: ``benchmarks/gpu_check.sh`` puts
``.gpu_peers/site`` on ``PYTHONPATH`` when it exists.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLASH_FILES = ("flash_attn/ops/triton/rotary.py", "flash_attn/layers/rotary.py", "LICENSE")


def sdist_url(package: str, version: str) -> str:
    """The source distribution's address, from PyPI's JSON API (relative links resolved)."""
    api = f"https://pypi.org/pypi/{package}/json"
    with urllib.request.urlopen(api, timeout=60) as reply:
        project = json.load(reply)
    files = project.get("releases", {}).get(version)
    if files is None and project["info"]["version"] == version:
        files = project["urls"]
    for entry in files or []:
        if entry["packagetype"] == "sdist":
            return urllib.parse.urljoin(api, entry["url"])
    raise SystemExit(f"{package} {version}: no source distribution on PyPI")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--liger", default="0.8.5", help="Liger-Kernel version")
    parser.add_argument("--flash-attn", default="2.8.3.post2", help="flash-attention version")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu_peers")
    args = parser.parse_args()
    site = args.out / "site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
             f"liger-kernel=={args.liger}"],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("liger_kernel-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith("liger_kernel/")]
            archive.extractall(site, members)
        archive_path = Path(tmp) / "flash_attn.tar.gz"
        urllib.request.urlretrieve(sdist_url("flash-attn", args.flash_attn), archive_path)
        prefix = f"flash_attn-{args.flash_attn}/"
        with tarfile.open(archive_path) as archive:
            for name in FLASH_FILES:
                source = archive.extractfile(prefix + name)
                assert source is not None, name
                target = site / ("flash_attn/LICENSE" if name == "LICENSE" else name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read())
    for package in ("flash_attn", "flash_attn/layers", "flash_attn/ops", "flash_attn/ops/triton"):
        (site / package / "__init__.py").touch()
    print(f"Liger-Kernel {args.liger} and flash-attention {args.flash_attn}'s rotary in {site}")


if __name__ == "__main__":
    main()
