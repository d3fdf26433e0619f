"""No silent wrong answers at run time: one model called from several threads, non-finite
logits in generation, and AdamW steps on non-finite gradients."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from mila_py import BuildContext, RuntimeMode
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, _finite

CFG = LlamaConfig(
    vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)
N_THREADS = 4


def make(batch: int = 2, context: int = 48, seed_weights: int = 0) -> Llama:
    """A randomly initialized INFERENCE build (the same weights for every ``seed_weights``)."""
    model = Llama("llama", CFG, device="CPU")
    model.build(BuildContext((batch, context), RuntimeMode.INFERENCE, initialize_parameters=True))
    rng = np.random.default_rng(seed_weights)
    for _, p in model.named_parameters():  # weights of a scale that makes varied tokens
        p[...] = rng.standard_normal(p.shape) * (0.3 if p.ndim >= 2 else 0.1) + (p.ndim == 1)
    return model


def prompt(seed: int, batch: int = 2, length: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(batch, length))


@pytest.fixture
def switch_often() -> Iterator[None]:
    """Threads switch every few bytecodes, so that unserialized calls would interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def run_in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run the jobs in threads that start together; their results in order (errors re-raised)."""
    barrier = threading.Barrier(len(jobs))

    def start(job: Callable[[], Any]) -> Any:
        barrier.wait()
        return job()

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(start, job) for job in jobs]
        return [f.result() for f in futures]


def calls_per_thread() -> list[list[dict[str, Any]]]:
    """Three generate calls per thread, with different prompts (lengths, batch sizes,
    ragged lists) and greedy or seeded sampling."""
    threads = []
    for t in range(N_THREADS):
        calls = []
        for c in range(3):
            seed = 10 * t + c
            kwargs: dict[str, Any] = {"max_new_tokens": 12}
            if c == 1:
                kwargs |= {"temperature": 0.8, "top_k": 10, "seed": seed}
            if c == 2:
                p: Any = [prompt(seed, 1, 3 + t)[0], prompt(seed + 1, 1, 6)[0]]
            else:
                p = prompt(seed, 1 + c % 2, 4 + t)
            calls.append({"prompt": p, **kwargs})
        threads.append(calls)
    return threads


def as_list(out: Any) -> list[np.ndarray]:
    return [np.asarray(r) for r in out]


@pytest.mark.usefixtures("switch_often")
def test_generate_from_several_threads_equals_the_calls_made_one_after_another() -> None:
    model = make()
    plan = calls_per_thread()
    sequential = [[as_list(model.generate(**call)) for call in calls] for calls in plan]
    for _ in range(2):  # twice: the second round starts from the caches the first left
        concurrent = run_in_threads(
            [lambda calls=calls: [as_list(model.generate(**c)) for c in calls] for calls in plan]
        )
        for t, (got, want) in enumerate(zip(concurrent, sequential, strict=True)):
            for c, (g, w) in enumerate(zip(got, want, strict=True)):
                for row_g, row_w in zip(g, w, strict=True):
                    np.testing.assert_array_equal(row_g, row_w, err_msg=f"thread {t}, call {c}")
    assert not model.run_lock.locked


def read_slowly(stream: Iterator[np.ndarray]) -> np.ndarray:
    """The stream's tokens ``[B, n]``, offering the other threads a turn after each."""
    tokens = []
    for token in stream:
        tokens.append(token)
        time.sleep(0)
    return np.stack(tokens, axis=1)


@pytest.mark.usefixtures("switch_often")
def test_streams_from_several_threads_each_give_their_own_tokens() -> None:
    model = make()
    prompts = [prompt(t, 2, 3 + t) for t in range(N_THREADS)]
    sequential = [model.generate(p, 10)[:, p.shape[1] :] for p in prompts]
    for _ in range(3):
        streamed = run_in_threads([lambda p=p: read_slowly(model.stream(p, 10)) for p in prompts])
        for t, (got, want) in enumerate(zip(streamed, sequential, strict=True)):
            np.testing.assert_array_equal(got, want, err_msg=f"thread {t}")
    assert not model.run_lock.locked


def test_a_paused_stream_holds_the_model_until_it_is_closed() -> None:
    model = make()
    p = prompt(1)
    alone = model.generate(p, 6)[:, 5:]
    stream = model.stream(p, 6)
    assert not model.run_lock.locked  # a stream not started holds nothing
    first = next(stream)

    def try_lock() -> bool:
        taken = model.run_lock.acquire(blocking=False)
        if taken:
            model.run_lock.release()
        return taken

    with ThreadPoolExecutor(1) as other:
        assert not other.submit(try_lock).result()
        # another thread's generate waits for the stream, which goes on undisturbed
        waiting = other.submit(model.generate, prompt(2), 6)
        rest = list(stream)
        np.testing.assert_array_equal(np.stack([first, *rest], axis=1), alone)
        np.testing.assert_array_equal(waiting.result(), make().generate(prompt(2), 6))
        unfinished = model.stream(p, 6)
        next(unfinished)
        assert not other.submit(try_lock).result()
        unfinished.close()
        assert other.submit(try_lock).result()


def test_an_abandoned_stream_gives_the_model_back_from_any_thread() -> None:
    model = make()
    stream = model.stream(prompt(1), 6)
    next(stream)
    assert model.run_lock.locked
    box = [stream]
    del stream
    with ThreadPoolExecutor(1) as other:
        other.submit(box.clear).result()  # the last reference dropped in another thread
        gc.collect()
        assert not model.run_lock.locked
        np.testing.assert_array_equal(
            other.submit(model.generate, prompt(2), 4).result(), make().generate(prompt(2), 4)
        )


def test_a_stream_may_be_advanced_from_several_threads() -> None:
    """As a server's worker pool does: each token from whichever thread is free."""
    model = make()
    p = prompt(3)
    alone = model.generate(p, 8)[:, 5:]
    stream = model.stream(p, 8)
    first, second = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    with first, second:
        tokens = [next(stream)]
        with model.run_lock:  # this thread is inside a call: the stream's next step waits
            waiting = first.submit(next, stream)
            assert not waiting.done()
        tokens.append(waiting.result())
        tokens += [(first if i % 2 else second).submit(next, stream).result() for i in range(6)]
        np.testing.assert_array_equal(np.stack(tokens, axis=1), alone)
        assert second.submit(lambda: model.run_lock.acquire(blocking=False)).result()
        second.submit(model.run_lock.release).result()
    assert not model.run_lock.locked


def test_a_run_lock_held_by_a_thread_keeps_other_threads_out() -> None:
    model = make()
    with model.run_lock, ThreadPoolExecutor(1) as other:
        assert model.generate(prompt(1), 2).shape == (2, 7)  # re-entrant in this thread
        assert not other.submit(lambda: model.run_lock.acquire(blocking=False)).result()
    with pytest.raises(RuntimeError, match=r"Llama 'llama'.*not held by this thread"):
        model.run_lock.release()


# ---------------------------------------------------------------------- non-finite logits


def first_steps_fed(tokens_by_row: np.ndarray, n_prompt: int, token: int) -> np.ndarray:
    """For each row of ``tokens_by_row`` [B, T + n] (a greedy generation): the index of the
    new token whose logits first see ``token`` (0 when the prompt holds it), or a large value."""
    steps = np.full(tokens_by_row.shape[0], 10**9)
    for r, row in enumerate(tokens_by_row):
        where = np.flatnonzero(row[:-1] == token)  # the last token is never fed
        if where.size:
            steps[r] = max(0, int(where[0]) - n_prompt + 1)
    return steps


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_nan_logits_raise_naming_the_model_the_step_and_the_sequence(sampled: bool) -> None:
    """An embedding row set to NaN poisons a sequence from the step that feeds that token."""
    model = make()
    p = prompt(7)
    clean = model.generate(p, 10)
    bad_token = int(clean[1, 5 + 2])  # row 1's new token 2: fed at step 3
    steps = first_steps_fed(clean, 5, bad_token)
    step = int(steps.min())
    assert 0 < step < 10  # the test's premise: a step after the prompt
    rows = ", ".join(str(r) for r in np.flatnonzero(steps == step))
    model.embed_tokens.weight[bad_token] = np.nan
    kwargs = {"temperature": 1e-6, "seed": 0} if sampled else {}  # sampled, yet greedy
    with pytest.raises(
        FloatingPointError,
        match=rf"Llama 'llama': NaN or inf in the logits of new token {step} .*for sequences? "
        rf"{rows} \(batch row\)",
    ):
        model.generate(p, 10, **kwargs)
    stream = model.stream(p, 10, **kwargs)
    got = [next(stream) for _ in range(step)]  # the tokens before the bad step are right
    np.testing.assert_array_equal(np.stack(got, axis=1), clean[:, 5 : 5 + step])
    with pytest.raises(FloatingPointError, match=f"new token {step} "):
        next(stream)
    assert not model.run_lock.locked  # the stream ended and gave the model back


@pytest.mark.parametrize("value", [np.inf, -np.inf])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_infinite_logits_raise_too(value: float, sampled: bool) -> None:
    model = make()
    assert model.lm_head is not None
    model.lm_head.weight[3] = 0.0
    model.lm_head.weight[3, 0] = value  # logit 3 is +-inf in every row
    kwargs = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 1} if sampled else {}
    with pytest.raises(FloatingPointError, match=r"new token 0 .*sequences 0, 1 \(batch row\)"):
        model.generate(prompt(1), 4, **kwargs)


def test_a_finished_sequence_s_logits_are_not_sampled_so_they_do_not_count() -> None:
    """Row 0 stops at its first token (the EOS); it is fed as padding from then on, with a NaN
    embedding: row 0's logits are NaN, but nothing is sampled from them."""
    model = make()
    p = prompt(11)
    clean = model.generate(p, 8)
    eos = int(clean[0, 5])
    # the test's premise: only row 0 is ever fed the poisoned token, and only once finished
    assert eos not in p[0] and eos not in clean[1]
    want = model.generate(p, 8, eos_token_id=eos)
    model.embed_tokens.weight[eos] = np.nan
    got = model.generate(p, 8, eos_token_id=eos)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1], clean[1])


# ---------------------------------------------------------------------- AdamW skip_nonfinite


def trained_twins() -> tuple[Llama, Llama]:
    """Two TRAINING builds with the same weights and the same gradients."""
    model, twin = (Llama("llama", CFG, device="CPU") for _ in range(2))
    for m in (model, twin):
        m.build(BuildContext((2, 6), RuntimeMode.TRAINING))
    model.forward(prompt(4, 2, 6))
    dlogits = np.random.default_rng(3).standard_normal((2, 6, CFG.vocab_size))
    model.backward(dlogits.astype(np.float32))
    for a, b in zip(twin.get_parameters(), model.get_parameters(), strict=True):
        a[...] = b
    for a, b in zip(twin.get_gradients(), model.get_gradients(), strict=True):
        a[...] = b
    return model, twin


def snapshot(opt: AdamW) -> list[np.ndarray]:
    return [p.copy() for p in opt.model.get_parameters()] + [a.copy() for a in opt._m + opt._v]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fused", [False, True], ids=["array-code", "fused"])
def test_a_step_on_non_finite_gradients_is_skipped_and_changes_nothing(
    bad: float, fused: bool
) -> None:
    model, twin = trained_twins()
    opt = AdamW(model, lr=0.01, skip_nonfinite=True)
    reference = AdamW(twin, lr=0.01)  # never sees the bad gradients
    if not fused:
        opt._fused = reference._fused = None
    elif opt._fused is None:
        pytest.skip("Numba is not installed or MILA_PY_CPU_BACKEND=numpy")
    assert opt.step() is True  # a first step, so that the moments are not zero
    reference.step()
    grad = opt.model.get_gradients()[-1]
    kept = grad.flat[1]
    grad.flat[1] = bad  # one element of one gradient
    before = snapshot(opt)
    assert opt.step() is False
    for a, b in zip(snapshot(opt), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (opt.step_count, opt.skipped_steps) == (1, 1)
    grad.flat[1] = kept
    assert opt.step() is True  # the second step, with its bias correction
    reference.step()
    assert (opt.step_count, opt.skipped_steps) == (2, 1)
    for a, b in zip(snapshot(opt), snapshot(reference), strict=True):
        np.testing.assert_array_equal(a, b)


def test_without_skip_nonfinite_a_non_finite_step_applies() -> None:
    model, _ = trained_twins()
    opt = AdamW(model, lr=0.01)
    model.get_gradients()[0].flat[0] = np.nan
    assert opt.step() is True
    assert opt.step_count == 1 and opt.skipped_steps == 0
    assert np.isnan(model.get_parameters()[0].flat[0])


def test_skip_nonfinite_must_be_a_bool() -> None:
    model, _ = trained_twins()
    with pytest.raises(TypeError, match="AdamW: skip_nonfinite must be a bool, got 1"):
        AdamW(model, skip_nonfinite=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "finite"),
    [([1.0, -2.5, 3e38], True), ([1.0, np.inf], False), ([-np.inf, 0.0], False), ([np.nan], False)],
)
def test_bfloat16_bits_carried_as_uint16_are_checked_as_bfloat16(
    values: list[float], finite: bool
) -> None:
    bits = np.array(values, dtype=ml_dtypes.bfloat16).view(np.uint16)
    assert bool(_finite(np, bits)) is finite
    assert bool(_finite(np, bits.view(ml_dtypes.bfloat16))) is finite
