"""Learning-rate schedules: the rates of transformers' schedules at every step, and a state
that resumes them."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from mila_py import BuildContext, RuntimeMode
from mila_py.components import Linear, LinearConfig
from mila_py.optim import AdamW, ConstantSchedule, CosineSchedule, LinearSchedule

BASE = 3e-3


def optimizer(lr: float = BASE) -> AdamW:
    lin = Linear("lin", LinearConfig(3, 2), device="CPU")
    lin.build(BuildContext((1, 3), RuntimeMode.TRAINING))
    return AdamW(lin, lr=lr)


# (ours, transformers' factory name, its extra arguments, steps compared)
CASES: dict[str, tuple[Any, str, dict[str, Any], int]] = {
    "constant": (
        lambda o: ConstantSchedule(o),
        "get_constant_schedule_with_warmup",
        {"num_warmup_steps": 0},
        40,
    ),
    "constant-warmup": (
        lambda o: ConstantSchedule(o, 7),
        "get_constant_schedule_with_warmup",
        {"num_warmup_steps": 7},
        40,
    ),
    "linear": (
        lambda o: LinearSchedule(o, 7, 50),
        "get_linear_schedule_with_warmup",
        {"num_warmup_steps": 7, "num_training_steps": 50},
        60,  # transformers' linear stays at 0 after the end, as ours does
    ),
    "linear-no-warmup": (
        lambda o: LinearSchedule(o, 0, 13),
        "get_linear_schedule_with_warmup",
        {"num_warmup_steps": 0, "num_training_steps": 13},
        20,
    ),
    "cosine": (
        lambda o: CosineSchedule(o, 7, 50),
        "get_cosine_schedule_with_warmup",
        {"num_warmup_steps": 7, "num_training_steps": 50},
        50,  # after the end transformers' cosine rises again; ours stays (tested below)
    ),
    "cosine-min-lr": (
        lambda o: CosineSchedule(o, 5, 31, min_lr=BASE / 7),
        "get_cosine_with_min_lr_schedule_with_warmup",
        {"num_warmup_steps": 5, "num_training_steps": 31, "min_lr": BASE / 7},
        31,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_rates_equal_transformers_at_every_step(case: str) -> None:
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import transformers.optimization as hf

    make, factory, kwargs, steps = CASES[case]
    if not hasattr(hf, factory):
        pytest.skip(f"the installed transformers has no {factory}")
    carrier = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    theirs = getattr(hf, factory)(carrier, **kwargs)
    opt = optimizer()
    ours = make(opt)
    for step in range(steps + 1):
        expected = carrier.param_groups[0]["lr"]
        assert ours.lr == expected, f"step {step}: {ours.lr} != {expected}"
        assert opt.lr == expected, f"step {step}: the optimizer's rate"
        carrier.step()
        theirs.step()
        ours.step()


def test_the_rates_have_the_shape_asked_for() -> None:
    """Independent of transformers: warmup from 0, peak, the floor at the end and after."""
    opt = optimizer()
    cosine = CosineSchedule(opt, 4, 20, min_lr=BASE / 10)
    rates = []
    for _ in range(30):
        rates.append(cosine.lr)
        cosine.step()
    assert rates[:5] == [0.0, BASE / 4, BASE / 2, BASE * 3 / 4, BASE]
    assert all(a >= b for a, b in itertools.pairwise(rates[4:21]))
    assert rates[20:] == [pytest.approx(BASE / 10, rel=1e-12)] * 10  # stays at the floor
    linear = LinearSchedule(optimizer(), 0, 10, min_lr=BASE / 4)
    for _ in range(15):
        linear.step()
    assert linear.lr == pytest.approx(BASE / 4, rel=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_a_loaded_schedule_continues_where_the_saved_one_was(case: str) -> None:
    make = CASES[case][0]
    saved_opt = optimizer()
    saved = make(saved_opt)
    for _ in range(9):
        saved.step()
    state = json.loads(json.dumps(saved.state_dict()))
    opt = optimizer(lr=1.0)  # another base rate: the saved one wins
    resumed = make(opt)
    resumed.load_state_dict(state)
    assert resumed.step_count == 9 and opt.lr == saved_opt.lr == resumed.lr
    for _ in range(20):
        saved.step()
        resumed.step()
        assert resumed.lr == saved.lr and opt.lr == saved_opt.lr


def test_a_schedule_refuses_the_state_of_another_and_changes_nothing() -> None:
    cosine = CosineSchedule(optimizer(), 2, 10)
    cosine.step()
    linear_state = LinearSchedule(optimizer(), 2, 10).state_dict()
    with pytest.raises(
        ValueError, match="CosineSchedule: cannot load the state of a 'LinearSchedule'"
    ):
        cosine.load_state_dict(linear_state)
    state = cosine.state_dict()
    state["warmup_steps"] = 11
    with pytest.raises(ValueError, match=r"warmup_steps \(11\) must be <= total_steps \(10\)"):
        cosine.load_state_dict(state)
    state = cosine.state_dict()
    state["step_count"] = -2
    with pytest.raises(ValueError, match="step_count must be an int >= 0"):
        cosine.load_state_dict(state)
    with pytest.raises(ValueError, match="expected the entries"):
        cosine.load_state_dict({"type": "CosineSchedule"})
    with pytest.raises(TypeError, match="expects a mapping"):
        cosine.load_state_dict(None)  # type: ignore[arg-type]
    assert cosine.step_count == 1 and cosine.warmup_steps == 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda o: ConstantSchedule(o, -1), "warmup_steps must be an int >= 0"),
        (lambda o: ConstantSchedule(o, 2.0), "warmup_steps must be an int >= 0"),
        (lambda o: LinearSchedule(o, 5, 0), "total_steps must be an int >= 1"),
        (lambda o: LinearSchedule(o, 5, 4), r"warmup_steps \(5\) must be <= total_steps \(4\)"),
        (lambda o: CosineSchedule(o, 0, 4, min_lr=1.0), "min_lr must be a number in"),
        (lambda o: CosineSchedule(o, 0, 4, min_lr=-1e-5), "min_lr must be a number in"),
    ],
)
def test_bad_arguments_are_refused(make: Any, message: str) -> None:
    opt = optimizer()
    with pytest.raises(ValueError, match=message):
        make(opt)
    assert opt.lr == BASE  # untouched


def test_a_schedule_needs_a_base_rate_above_zero() -> None:
    opt = optimizer()
    ConstantSchedule(opt, 5)  # sets the rate of step 0: 0
    with pytest.raises(ValueError, match="base rate and must be a finite number > 0"):
        ConstantSchedule(opt, 5)
