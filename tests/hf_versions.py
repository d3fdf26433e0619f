"""Which transformers release the HF comparisons hold for: cases whose behaviour an older release
reads otherwise skip there (with the versions in the reason); a newer release runs them all, so
any drift after an upgrade fails and shows."""

from __future__ import annotations

import re

import pytest

#: the transformers release the HF comparisons were verified against, and that
#: ``mila_py/interop/hf_rope_defaults.py`` was generated from
HF_VERIFIED = (5, 23)


def transformers_version() -> tuple[int, int]:
    """The installed transformers' ``(major, minor)``."""
    import transformers

    major, minor = (
        re.match(r"\d*", part).group() or "0" for part in transformers.__version__.split(".")[:2]
    )  # type: ignore[union-attr]
    return int(major), int(minor)


def skip_before_verified_transformers(what: str) -> None:
    """Skip a comparison whose transformers behaviour changed before :data:`HF_VERIFIED` (an
    older release reads or rotates it otherwise); newer releases run it, so drift shows."""
    if transformers_version() < HF_VERIFIED:
        import transformers

        pytest.skip(
            f"{what}: transformers {transformers.__version__} predates "
            f"{HF_VERIFIED[0]}.{HF_VERIFIED[1]}, the release this case is verified against"
        )


def skip_unless_transformers_has(model_type: str) -> None:
    """Skip a comparison with a family the installed transformers does not have."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} family")
