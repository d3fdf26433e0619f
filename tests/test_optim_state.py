"""AdamW's state: saved as host NumPy copies, restored all or nothing, continuing bit for bit."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest

from mila_py import BuildContext, RuntimeMode
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW

B, T = 2, 6


def built(seed: int = 0) -> Llama:
    cfg = LlamaConfig(
        vocab_size=32, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=24, max_seq_len=16
    )
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((B, T), RuntimeMode.TRAINING))
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():  # the same weights for every seed-equal model
        p[...] = rng.standard_normal(p.shape).astype(p.dtype) * 0.1
    return model


def gradients(model: Llama, step: int) -> None:
    """Random, step-dependent gradients (the optimizer does not care where they come from)."""
    rng = np.random.default_rng(100 + step)
    for g in model.get_gradients():
        g[...] = rng.standard_normal(g.shape).astype(g.dtype)


def run(model: Llama, opt: AdamW, steps: range) -> None:
    for step in steps:
        gradients(model, step)
        opt.step()


def test_a_restored_optimizer_continues_bit_for_bit() -> None:
    model = built()
    opt = AdamW(model, lr=0.01, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    run(model, opt, range(3))
    opt.skipped_steps = 2  # as skip_nonfinite would have counted them
    state = opt.state_dict()
    weights = [p.copy() for p in model.get_parameters()]
    run(model, opt, range(3, 6))

    # another optimizer, of other hyper-parameters, over the weights of step 3
    twin = built(seed=1)
    for p, w in zip(twin.get_parameters(), weights, strict=True):
        p[...] = w
    twin_opt = AdamW(twin, lr=0.5, betas=(0.5, 0.5), eps=1e-3, weight_decay=0.0)
    twin_opt.load_state_dict(json_round_trip(state))
    assert (twin_opt.lr, twin_opt.betas, twin_opt.eps) == (0.01, (0.8, 0.95), 1e-7)
    assert twin_opt.weight_decay == 0.05 and twin_opt.step_count == 3
    assert twin_opt.skipped_steps == 2
    run(twin, twin_opt, range(3, 6))
    for (name, p), q in zip(model.named_parameters(), twin.get_parameters(), strict=True):
        assert p.tobytes() == q.tobytes(), name
    for a, b in zip(opt._m + opt._v, twin_opt._m + twin_opt._v, strict=True):
        assert a.tobytes() == b.tobytes()


def json_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its scalars through JSON (as a checkpoint stores them), arrays kept."""
    arrays = {key: state[key] for key in ("exp_avg", "exp_avg_sq")}
    rest = {k: v for k, v in state.items() if k not in arrays}
    return {**json.loads(json.dumps(rest)), **arrays}


def test_the_state_is_named_host_copies_that_later_steps_leave_alone() -> None:
    model = built()
    opt = AdamW(model, lr=0.01)
    run(model, opt, range(2))
    state = opt.state_dict()
    names = [name for name, _ in model.named_parameters()]
    assert list(state["exp_avg"]) == names and list(state["exp_avg_sq"]) == names
    assert state["decay"]["embed_tokens.weight"] is True
    assert state["decay"]["layer0.input_layernorm.weight"] is False
    kept = {k: v.copy() for k, v in state["exp_avg"].items()}
    for name, m in zip(names, opt._m, strict=True):
        array = state["exp_avg"][name]
        assert isinstance(array, np.ndarray) and array.dtype == m.dtype
        assert not np.shares_memory(array, m)
    run(model, opt, range(2, 3))
    for name in names:
        np.testing.assert_array_equal(state["exp_avg"][name], kept[name])
    assert state["step_count"] == 2


def _broken(state: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(state)
    first, second = list(bad["exp_avg"])[:2]
    bad["exp_avg"][first] = bad["exp_avg"][first][:-1]  # a shape
    bad["exp_avg_sq"][second] = bad["exp_avg_sq"][second].astype(np.float64)  # a dtype
    del bad["exp_avg"][second]  # a missing name
    bad["exp_avg_sq"]["no.such.weight"] = np.zeros(3, np.float32)  # an unexpected name
    bad["step_count"] = -1
    bad["decay"][first] = not bad["decay"][first]
    return bad


def test_a_bad_state_lists_every_problem_and_loads_nothing() -> None:
    model = built()
    opt = AdamW(model, lr=0.01)
    run(model, opt, range(2))
    good = opt.state_dict()
    target = AdamW(built(), lr=0.02)
    run(target.model, target, range(1))
    before = target.state_dict()
    first, second = list(good["exp_avg"])[:2]
    with pytest.raises(ValueError, match="nothing was loaded") as error:
        target.load_state_dict(_broken(good))
    message = str(error.value)
    assert message.startswith("AdamW over Llama 'llama'")
    for part in (
        f"exp_avg.{first}: shape",
        f"exp_avg_sq.{second}: dtype float64",
        f"exp_avg: missing parameter {second}",
        "exp_avg_sq: unexpected parameter no.such.weight",
        "step_count: expected an int >= 0, got -1",
        f"decay of {first}",
    ):
        assert part in message
    after = target.state_dict()
    assert after["step_count"] == 1 and target.lr == 0.02
    for key in ("exp_avg", "exp_avg_sq"):
        for name, array in before[key].items():
            assert array.tobytes() == after[key][name].tobytes()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["hyperparameters"].update(lr=-1.0), "lr must be finite and >= 0"),
        (lambda s: s["hyperparameters"].update(betas=[0.9, 1.0]), "beta2 must be in"),
        (lambda s: s["hyperparameters"].update(skip_nonfinite=1), "skip_nonfinite"),
        (lambda s: s["hyperparameters"].pop("eps"), "hyperparameters: expected the keys"),
        (lambda s: s.pop("skipped_steps"), "missing entry: skipped_steps"),
        (lambda s: s.update(momentum=0.9), "unexpected entry: momentum"),
        (lambda s: s["exp_avg"].update({"embed_tokens.weight": [0.0]}), "expected a NumPy array"),
    ],
)
def test_each_bad_entry_is_named(change: Any, message: str) -> None:
    model = built()
    opt = AdamW(model, lr=0.01)
    state = opt.state_dict()
    change(state)
    with pytest.raises(ValueError, match="nothing was loaded") as error:
        opt.load_state_dict(state)
    assert message in str(error.value)
    assert opt.lr == 0.01 and opt.step_count == 0


def test_a_state_that_is_not_a_mapping_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="AdamW over Llama 'llama': load_state_dict expects"):
        AdamW(built()).load_state_dict([1, 2])  # type: ignore[arg-type]


def test_a_step_at_rate_zero_moves_no_weight_but_advances_the_moments() -> None:
    """A schedule's warmup starts at 0: the step is taken (torch takes it too), the weights
    stay, the moments and the count advance. The rate given at construction must be > 0."""
    model = built()
    opt = AdamW(model, lr=0.01, weight_decay=0.1)
    opt.lr = 0.0
    before = [p.copy() for p in model.get_parameters()]
    gradients(model, 0)
    assert opt.step() is True
    for p, was in zip(model.get_parameters(), before, strict=True):
        np.testing.assert_array_equal(p, was)
    assert opt.step_count == 1 and all(np.abs(m).sum() > 0 for m in opt._m)
    with pytest.raises(ValueError, match="lr must be finite and > 0"):
        AdamW(model, lr=0.0)
