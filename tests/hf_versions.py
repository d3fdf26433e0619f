"""Which transformers release the HF comparisons hold for: the one pinned by ``pyproject.toml``'s
``hf`` extra. Cases whose behaviour an older release reads otherwise skip before
:data:`CASES_HOLD_SINCE` (with the versions in the reason); a newer release runs them all, so any
drift after an upgrade fails and shows.
The class-default table is the exception: it is generated from the pinned release, so another
release's differences from it are reported as a skip that lists them (a newer release adds
families the table cannot know yet), not as a failure."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pinned_release(package: str) -> str:
    """The release of ``package`` that ``pyproject.toml``'s ``hf`` extra pins with ``==``."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    for requirement in project["optional-dependencies"]["hf"]:
        name, _, release = requirement.partition("==")
        if name.strip() == package:
            return release.strip()
    raise AssertionError(f"pyproject.toml: the hf extra pins no {package}==<release>")


#: the transformers release the HF comparisons were verified against, and that
#: ``mila_py/interop/hf_rope_defaults.py`` was generated from
HF_PINNED = pinned_release("transformers")
HF_VERIFIED = (int(HF_PINNED.split(".")[0]), int(HF_PINNED.split(".")[1]))
#: the oldest release that reads the version-gated cases as the pinned one does (they pass with
#: it and with :data:`HF_VERIFIED`; older releases read or rotate them otherwise)
CASES_HOLD_SINCE = (5, 23)


def transformers_version() -> tuple[int, int]:
    """The installed transformers' ``(major, minor)``."""
    import transformers

    major, minor = (
        re.match(r"\d*", part).group() or "0" for part in transformers.__version__.split(".")[:2]
    )  # type: ignore[union-attr]
    return int(major), int(minor)


def skip_before_verified_transformers(what: str, since: tuple[int, int] = CASES_HOLD_SINCE) -> None:
    """Skip a comparison whose transformers behaviour changed before ``since`` (default
    :data:`CASES_HOLD_SINCE`: an older release reads, rotates or renders it otherwise); newer
    releases run it, so drift shows."""
    if transformers_version() < since:
        import transformers

        pytest.skip(
            f"{what}: transformers {transformers.__version__} predates "
            f"{since[0]}.{since[1]}, the release this case holds from "
            f"(verified against {HF_PINNED})"
        )


def skip_drift_from_pinned_transformers(what: str, differences: list[str]) -> None:
    """Skip, listing ``differences``, where the installed transformers is not
    :data:`HF_PINNED`: the table ``what`` names is generated from the pinned release, so another
    release's differences are that release's drift, not a wrong reading. With the pinned release
    this returns, and the caller asserts that there are no differences."""
    import transformers

    if differences and transformers.__version__ != HF_PINNED:
        pytest.skip(
            f"{what}: transformers {transformers.__version__} is not {HF_PINNED}, the release "
            f"the table is generated from; the families that differ ({len(differences)}):\n"
            + "\n".join(differences)
        )


def skip_unless_transformers_has(model_type: str) -> None:
    """Skip a comparison with a family the installed transformers does not have."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} family")
