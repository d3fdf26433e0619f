"""mila_py.init: the base seed, per-name generators and init names across a tree."""

from __future__ import annotations

import numpy as np
import pytest

from mila_py import BuildContext, CompositeComponent, RuntimeMode
from mila_py.components import Linear, LinearConfig, SwiGLU, SwiGLUConfig
from mila_py.init import (
    assign_init_names,
    init_name,
    initial_seed,
    manual_seed,
    rng_for,
    set_init_name,
)


@pytest.fixture(autouse=True)
def _restore_seed():
    yield
    manual_seed(0)


def test_generators_depend_on_seed_and_name_only() -> None:
    assert initial_seed() == 0
    a = rng_for("proj").standard_normal(4)
    np.testing.assert_array_equal(rng_for("proj").standard_normal(4), a)
    assert not np.array_equal(rng_for("proj2").standard_normal(4), a)
    manual_seed(3)
    assert initial_seed() == 3
    assert not np.array_equal(rng_for("proj").standard_normal(4), a)


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_manual_seed_rejects_bad_seeds(seed, error) -> None:
    with pytest.raises(error, match="seed"):
        manual_seed(seed)
    assert initial_seed() == 0


def test_rng_for_needs_a_str() -> None:
    with pytest.raises(TypeError, match="name"):
        rng_for(3)  # type: ignore[arg-type]


def test_assign_init_names_gives_every_descendant_its_path() -> None:
    root = CompositeComponent("root", device="CPU")
    blocks = [SwiGLU(f"layer{i}", SwiGLUConfig(4, 6)) for i in range(2)]
    for block in blocks:
        root.add_component(block)
    head = Linear("head", LinearConfig(4, 3))
    root.add_component(head)
    assign_init_names(root)
    assert init_name(head) == "head"
    assert init_name(blocks[1]) == "layer1"
    assert init_name(blocks[1].gate_proj) == "layer1.gate_proj"
    root.build(BuildContext((1, 2, 4), RuntimeMode.TRAINING))
    params = dict(root.named_parameters())
    # same local name, different paths: different weights
    assert not np.array_equal(params["layer0.gate_proj.weight"], params["layer1.gate_proj.weight"])


def test_set_init_name_overrides_the_name() -> None:
    lin = Linear("proj", LinearConfig(4, 3))
    assert init_name(lin) == "proj"
    set_init_name(lin, "layer7.proj")
    assert init_name(lin) == "layer7.proj"
    with pytest.raises(TypeError):
        set_init_name(lin, None)  # type: ignore[arg-type]
