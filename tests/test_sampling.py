"""Sampling on the model's device (mila_py.models.sampling): each processor against the
transformers ``LogitsProcessor`` of the same name on the same logits, the processors' order
against transformers' ``generate``, the draws against the processed distribution, seeds,
greedy decoding, non-finite logits and parameter checks."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import to_numpy

from mila_py.models.sampling import (
    SamplingParams,
    SamplingTypeError,
    TokenCounts,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    array_module,
    process_logits,
    sample,
    sample_tokens,
)

SHAPES = [(1, 1), (2, 7), (3, 50), (4, 1000), (2, 32000)]
KINDS = ["normal", "ties", "extreme", "masked"]


def _xp(device: str) -> Any:
    if device == "CPU":
        return np
    from cuda_arrays import cupy

    return cupy


def make_logits(shape: tuple[int, int], kind: str, seed: int = 0) -> np.ndarray:
    """Host float32 logits ``[B, V]``: ``normal`` (scale 3), ``ties`` (small integers, so many
    tokens share each value), ``extreme`` (magnitudes from 1e-30 to 3e38, both signs) or
    ``masked`` (normal with some entries already ``-inf``, never a whole row)."""
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return rng.integers(-3, 4, shape).astype(np.float32)
    if kind == "extreme":
        pool = np.array([0.0, 1e-30, -1e-30, 1.5, -2.5, 1e30, -1e30, 3e38, -3e38], np.float32)
        return rng.choice(pool, shape) + rng.standard_normal(shape).astype(np.float32)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    if kind == "masked":
        x[rng.random(shape) < 0.3] = -np.inf
        x[:, rng.integers(shape[1])] = 0.5  # a finite logit in every row
    return x


def hf_apply(processor: Any, logits: np.ndarray, input_ids: np.ndarray | None = None) -> np.ndarray:
    """``processor(input_ids, scores)`` of transformers on a host copy of ``logits``."""
    torch = pytest.importorskip("torch")
    ids = np.zeros((logits.shape[0], 1), np.int64) if input_ids is None else input_ids
    scores = torch.from_numpy(np.array(logits, copy=True))
    return processor(torch.from_numpy(ids), scores).numpy()


def processors_module() -> Any:
    pytest.importorskip("torch")
    return pytest.importorskip("transformers.generation.logits_process")


@pytest.fixture
def stable_torch_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.sort`` made stable for the test. transformers' ``TopPLogitsWarper`` sorts with
    the default (unstable) sort, whose order among equal logits is the implementation's (on the
    CPU it differs from index order above 16 elements); mila_py orders ties by index."""
    torch = pytest.importorskip("torch")
    unstable = torch.sort

    def stable(*args: Any, **kwargs: Any) -> Any:
        kwargs["stable"] = True
        return unstable(*args, **kwargs)

    monkeypatch.setattr(torch, "sort", stable)


def assert_same_logits(got: Any, want: np.ndarray) -> None:
    got = to_numpy(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------ each processor vs HF
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.01, 0.7, 1.0, 3.0])
def test_temperature_matches_transformers(
    device: str, shape: tuple[int, int], kind: str, temperature: float
) -> None:
    lp = processors_module()
    x = make_logits(shape, kind, seed=1)
    logits = _xp(device).asarray(x)
    got = apply_temperature(logits, temperature)
    assert_same_logits(got, hf_apply(lp.TemperatureLogitsWarper(temperature), x))
    assert_same_logits(logits, x)  # the input is unchanged


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("top_k", [1, 3, 40, 100_000])
def test_top_k_matches_transformers(
    device: str, shape: tuple[int, int], kind: str, top_k: int
) -> None:
    lp = processors_module()
    x = make_logits(shape, kind, seed=2)
    logits = _xp(device).asarray(x)
    got = apply_top_k(logits, top_k)
    assert_same_logits(got, hf_apply(lp.TopKLogitsWarper(top_k), x))
    assert_same_logits(logits, x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999, 1.0])
def test_top_p_matches_transformers(
    device: str, shape: tuple[int, int], kind: str, top_p: float, stable_torch_sort: None
) -> None:
    lp = processors_module()
    x = make_logits(shape, kind, seed=3)
    logits = _xp(device).asarray(x)
    got = apply_top_p(logits, top_p)
    assert_same_logits(got, hf_apply(lp.TopPLogitsWarper(top_p), x))
    assert_same_logits(logits, x)


@pytest.mark.parametrize("shape", [(4, 1000), (2, 32000)])
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_keeps_what_unstable_transformers_keeps_up_to_ties(
    device: str, shape: tuple[int, int], top_p: float
) -> None:
    """With torch's own sort, which of several equal logits at the cut transformers keeps is
    the sort's choice: the kept values per row are the same multiset, and the count is."""
    lp = processors_module()
    x = make_logits(shape, "ties", seed=4)
    got = to_numpy(apply_top_p(_xp(device).asarray(x), top_p))
    want = hf_apply(lp.TopPLogitsWarper(top_p), x)
    for got_row, want_row in zip(got, want, strict=True):
        np.testing.assert_array_equal(
            np.sort(got_row[got_row > -np.inf]), np.sort(want_row[want_row > -np.inf])
        )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 0.9, 1.0])
def test_min_p_matches_transformers(
    device: str, shape: tuple[int, int], kind: str, min_p: float
) -> None:
    lp = processors_module()
    x = make_logits(shape, kind, seed=5)
    logits = _xp(device).asarray(x)
    got = apply_min_p(logits, min_p)
    assert_same_logits(got, hf_apply(lp.MinPLogitsWarper(min_p), x))
    assert_same_logits(logits, x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(
    device: str, shape: tuple[int, int], kind: str, penalty: float
) -> None:
    lp = processors_module()
    xp = _xp(device)
    n_b, n_v = shape
    x = make_logits(shape, kind, seed=6)
    rng = np.random.default_rng(7)
    # repeats (transformers' releases before 5.24 fail on ids past the vocabulary, so they are
    # compared below, with mila_py alone)
    ids = rng.integers(0, n_v, (n_b, 12))
    ids[:, 1] = ids[:, 0]
    want = hf_apply(lp.RepetitionPenaltyLogitsProcessor(penalty), x, ids)
    logits = xp.asarray(x)
    assert_same_logits(apply_repetition_penalty(logits, penalty, token_ids=xp.asarray(ids)), want)
    # ids past the vocabulary (and padding's -1) are ignored
    padded = np.concatenate([ids, np.full((n_b, 2), n_v + 2), np.full((n_b, 1), -1)], axis=1)
    assert_same_logits(
        apply_repetition_penalty(logits, penalty, token_ids=xp.asarray(padded)), want
    )
    # the same from per-row counts, and from a TokenCounts of the same tokens
    counts = np.zeros(shape, np.int32)
    for b, row in enumerate(ids):
        np.add.at(counts[b], row[row < n_v], 1)
    assert_same_logits(apply_repetition_penalty(logits, penalty, counts=xp.asarray(counts)), want)
    seen = TokenCounts.from_prompt(xp.asarray(ids), n_v).seen
    assert_same_logits(apply_repetition_penalty(logits, penalty, counts=seen), want)
    assert_same_logits(logits, x)


def test_repetition_penalty_ignores_padding_ids(device: str) -> None:
    """Negative ids (padding) count nothing: the result is transformers' without them."""
    lp = processors_module()
    xp = _xp(device)
    x = make_logits((2, 30), "normal", seed=8)
    ids = np.array([[3, 4, -1, -1], [5, 5, 6, 29]])
    want = hf_apply(lp.RepetitionPenaltyLogitsProcessor(1.5), x, np.array([[3, 4], [5, 6]]))
    want[1] = hf_apply(lp.RepetitionPenaltyLogitsProcessor(1.5), x[1:], ids[1:])[0]
    got = apply_repetition_penalty(xp.asarray(x), 1.5, token_ids=xp.asarray(ids))
    assert_same_logits(got, want)


def presence_frequency_reference(
    x: np.ndarray, presence: float, frequency: float, counts: np.ndarray
) -> np.ndarray:
    """OpenAI's definition in float64: ``logit - presence * [count > 0] - frequency * count``."""
    wide = x.astype(np.float64)
    return wide - presence * (counts > 0) - frequency * counts.astype(np.float64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "masked"])
@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (1.2, -0.4), (-2, 2)])
def test_presence_frequency_matches_the_definition(
    device: str, shape: tuple[int, int], kind: str, presence: float, frequency: float
) -> None:
    xp = _xp(device)
    x = make_logits(shape, kind, seed=9)
    counts = np.random.default_rng(10).integers(0, 4, shape).astype(np.int32)
    counts[np.random.default_rng(11).random(shape) < 0.7] = 0
    logits = xp.asarray(x)
    got = to_numpy(apply_presence_frequency(logits, presence, frequency, xp.asarray(counts)))
    want = presence_frequency_reference(x, presence, frequency, counts)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = counts == 0
    np.testing.assert_array_equal(got[untouched], x[untouched])
    assert_same_logits(logits, x)


def test_presence_frequency_counts_generated_tokens_only(device: str) -> None:
    """The prompt's tokens take the repetition penalty but not the presence/frequency ones."""
    xp = _xp(device)
    x = make_logits((1, 10), "normal", seed=12)
    counts = TokenCounts.from_prompt(xp.asarray([[1, 2, 2]]), 10)
    for token in (2, 5, 5):
        counts.update(xp.asarray([token]))
    np.testing.assert_array_equal(to_numpy(counts.generated)[0], np.bincount([2, 5, 5], None, 10))
    np.testing.assert_array_equal(np.flatnonzero(to_numpy(counts.seen)[0]), [1, 2, 5])
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    got = to_numpy(process_logits(xp.asarray(x), params, counts))[0]
    want = presence_frequency_reference(x, 0.5, 0.25, to_numpy(counts.generated))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got[1] == x[0, 1]  # a prompt token: no additive penalty


# ----------------------------------------------------------------- the chain, against generate
def hf_generate_processors(params: SamplingParams, prompt_len: int) -> Any:
    """The processors transformers' ``generate`` builds for ``params``, taken from a tiny
    Llama's ``_get_logits_processor`` (so the order is transformers' own)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    config = transformers.GenerationConfig(
        do_sample=not params.greedy,
        temperature=params.temperature if not params.greedy else None,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p or None,
        repetition_penalty=params.repetition_penalty,
    )
    try:
        return model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=prompt_len,
            encoder_input_ids=torch.zeros((1, prompt_len), dtype=torch.long),
            logits_processor=None,
            device="cpu",
            model_kwargs={},
        )
    except (AttributeError, TypeError) as error:
        pytest.skip(f"this transformers builds its processors otherwise: {error}")


CHAINS = [
    SamplingParams(temperature=0.5, top_k=30, top_p=0.8, min_p=0.1, repetition_penalty=1.3),
    SamplingParams(temperature=1.7, top_p=0.6, repetition_penalty=0.8),
    SamplingParams(temperature=0.3, min_p=0.3),
    SamplingParams(temperature=1.0, top_p=0.6, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0, top_k=5, top_p=0.5, repetition_penalty=1.5),
]


@pytest.mark.parametrize("params", CHAINS, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "masked"])
def test_process_logits_matches_the_processors_of_generate(
    device: str, params: SamplingParams, kind: str, stable_torch_sort: None
) -> None:
    xp = _xp(device)
    n_b, n_v = 3, 500
    x = make_logits((n_b, n_v), kind, seed=13)
    ids = np.random.default_rng(14).integers(0, n_v, (n_b, 40))
    want = to_numpy(hf_generate_processors(params, 40)(_torch_ids(ids), _torch(x)))
    counts = TokenCounts.from_prompt(xp.asarray(ids), n_v)
    assert_same_logits(process_logits(xp.asarray(x), params, counts), want)


def test_the_order_of_the_processors_matters_in_these_cases(stable_torch_sort: None) -> None:
    """The chain test can fail: top-p before temperature (or min-p before top-p) keeps another
    set of tokens on these logits."""
    x = make_logits((3, 500), "normal", seed=13)
    t_first = apply_top_p(apply_temperature(x, 0.5), 0.8)
    p_first = apply_temperature(apply_top_p(x, 0.8), 0.5)
    assert not np.array_equal(np.isinf(t_first), np.isinf(p_first))
    p_then_m = apply_min_p(apply_top_p(x, 0.6), 0.3)
    m_then_p = apply_top_p(apply_min_p(x, 0.3), 0.6)
    assert not np.array_equal(np.isinf(p_then_m), np.isinf(m_then_p))


def _torch(x: np.ndarray) -> Any:
    return pytest.importorskip("torch").from_numpy(np.array(x, copy=True))


def _torch_ids(ids: np.ndarray) -> Any:
    return pytest.importorskip("torch").from_numpy(np.asarray(ids, np.int64))


# ------------------------------------------------------------------------------------- drawing
def chi_square_bound(df: int, z: float = 6.0) -> float:
    """An upper quantile of chi-square with ``df`` degrees of freedom, about ``z`` standard
    normal deviations out (Wilson-Hilferty)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def processed_probs(x: np.ndarray, params: SamplingParams, counts: TokenCounts | None) -> Any:
    """Float64 probabilities of the processed logits (the distribution drawn from)."""
    processed = to_numpy(process_logits(x, params, counts)).astype(np.float64)
    e = np.exp(processed - processed.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


DRAWS = [
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.6, top_k=8, seed=1),
    SamplingParams(temperature=1.4, top_p=0.7, seed=2),
    SamplingParams(temperature=0.9, min_p=0.15, seed=3),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=4),
    SamplingParams(
        temperature=1.1, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, seed=5
    ),
]


@pytest.mark.parametrize("params", DRAWS, ids=str)
def test_sample_draws_from_the_processed_distribution(device: str, params: SamplingParams) -> None:
    """Two rows, each repeated 20000 times in one batch: each row's token counts fit its
    processed probabilities (chi-square well inside its tail), and a filtered token is never
    drawn. Deterministic given the seed."""
    xp = _xp(device)
    n_v, repeats = 40, 20_000
    base = make_logits((2, n_v), "masked", seed=15)
    base[1] = make_logits((1, n_v), "ties", seed=16)[0]
    x = np.repeat(base, repeats, axis=0)
    counts = None
    if params.uses_counts:
        prompt = np.repeat(np.array([[0, 1, 2, 3], [4, 4, 5, 6]]), repeats, axis=0)
        counts = TokenCounts.from_prompt(xp.asarray(prompt), n_v)
        for token in ([1, 4], [7, 4], [7, 9]):
            counts.update(xp.asarray(np.repeat(token, repeats)))
    host_counts = None
    if counts is not None:
        host_counts = TokenCounts(2, n_v)
        host_counts.seen[...] = to_numpy(counts.seen)[::repeats]
        host_counts.generated[...] = to_numpy(counts.generated)[::repeats]
    probs = processed_probs(base, params, host_counts)  # [2, V]
    tokens = to_numpy(sample(xp.asarray(x), params, counts, params.make_rng()))
    assert tokens.shape == (2 * repeats,) and tokens.dtype == np.int64
    for row in range(2):
        drawn = np.bincount(tokens[row * repeats : (row + 1) * repeats], minlength=n_v)
        support = probs[row] > 0
        assert drawn[~support].sum() == 0, "a filtered token was drawn"
        expected = probs[row][support] * repeats
        chi2 = float(((drawn[support] - expected) ** 2 / expected).sum())
        df = int(support.sum()) - 1
        if df == 0:
            assert drawn[support].item() == repeats
        else:
            assert chi2 < chi_square_bound(df), (row, chi2, df)


def test_sample_against_a_wrong_distribution_fails_the_bound() -> None:
    """The chi-square check above can fail: the same draws scored against the distribution at
    another temperature are far outside the bound."""
    n_v, repeats = 40, 20_000
    x = np.repeat(make_logits((1, n_v), "masked", seed=15), repeats, axis=0)
    params = SamplingParams(temperature=1.0, seed=0)
    tokens = sample(x, params, None, params.make_rng())
    drawn = np.bincount(tokens, minlength=n_v)
    wrong = processed_probs(x[:1], dataclasses.replace(params, temperature=1.2), None)[0]
    support = wrong > 0
    expected = wrong[support] * repeats
    chi2 = float(((drawn[support] - expected) ** 2 / expected).sum())
    assert chi2 > chi_square_bound(int(support.sum()) - 1)


def test_the_same_seed_gives_the_same_tokens(device: str) -> None:
    xp = _xp(device)
    x = xp.asarray(make_logits((8, 1000), "normal", seed=17))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123)

    def run(p: SamplingParams) -> list[np.ndarray]:
        rng = p.make_rng()
        return [to_numpy(sample(x, p, None, rng)) for _ in range(5)]

    first, again = run(params), run(params)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    other = run(dataclasses.replace(params, seed=124))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    # the steps of one generation differ from each other (one generator, advanced per step)
    assert any(not np.array_equal(first[0], step) for step in first[1:])
    # a nondeterministic seed runs, and gives tokens of the right kind
    fresh = run(dataclasses.replace(params, seed=None))[0]
    assert fresh.shape == (8,) and ((fresh >= 0) & (fresh < 1000)).all()


def test_uniforms_drawn_up_front_give_the_tokens_of_step_by_step_sampling(device: str) -> None:
    """A CUDA-graph step reads its uniforms from a device buffer: ``rng.random((steps, B))``
    drawn once gives each step what ``sample`` draws at that step."""
    xp = _xp(device)
    n_b, n_v, steps = 3, 300, 6
    params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.2, seed=9)
    logits = [xp.asarray(make_logits((n_b, n_v), "normal", seed=s)) for s in range(steps)]
    prompt = xp.asarray(np.arange(n_b * 4).reshape(n_b, 4))
    eager, graph = TokenCounts.from_prompt(prompt, n_v), TokenCounts.from_prompt(prompt, n_v)
    rng = params.make_rng()
    uniforms = xp.asarray(params.make_rng().random((steps, n_b)))
    for step in range(steps):
        a = sample(logits[step], params, eager, rng)
        b = sample_tokens(logits[step], params, uniforms[step], graph)
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
        eager.update(a)
        graph.update(b)
    np.testing.assert_array_equal(to_numpy(eager.generated), to_numpy(graph.generated))


def test_greedy_is_the_argmax_after_the_penalties(device: str) -> None:
    xp = _xp(device)
    n_v = 50
    x = make_logits((4, n_v), "normal", seed=18)
    top = x.argmax(axis=-1)
    x[np.arange(4), top] += 2.0  # a clear winner, in the prompt: the penalties must dethrone it
    prompt = np.stack([top, top, top]).T
    params = SamplingParams(
        temperature=0, top_k=1, repetition_penalty=4.0, presence_penalty=1.0, frequency_penalty=1.0
    )
    counts = TokenCounts.from_prompt(xp.asarray(prompt), n_v)
    counts.update(xp.asarray(top))
    tokens = to_numpy(sample(xp.asarray(x), params, counts))
    # float64 reference: repetition penalty over prompt + generated, then the additive ones
    wide = x.astype(np.float64)
    seen = np.zeros_like(wide, dtype=bool)
    seen[np.arange(4), top] = True
    wide = np.where(seen, np.where(wide < 0, wide * 4.0, wide / 4.0), wide)
    wide = presence_frequency_reference(wide, 1.0, 1.0, to_numpy(counts.generated))
    np.testing.assert_array_equal(tokens, wide.argmax(axis=-1))
    assert (tokens != top).all()  # the penalties changed every row's answer
    # transformers' greedy decoding: its processors, then argmax
    lp = processors_module()
    ids = np.concatenate([prompt, top[:, None]], axis=1)
    hf = hf_apply(lp.RepetitionPenaltyLogitsProcessor(4.0), x, ids)
    no_additive = dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0)
    np.testing.assert_array_equal(
        to_numpy(sample(xp.asarray(x), no_additive, counts)), hf.argmax(-1)
    )


def test_greedy_takes_the_first_of_equal_logits(device: str) -> None:
    xp = _xp(device)
    x = np.array([[0.0, 2.0, 1.0, 2.0], [-np.inf, 5.0, 5.0, 5.0]], np.float32)
    tokens = sample(xp.asarray(x), SamplingParams(temperature=0))
    np.testing.assert_array_equal(to_numpy(tokens), [1, 1])


def test_a_tiny_temperature_draws_among_the_largest_logits_only(device: str) -> None:
    """300 / 1e-38 overflows float32 to +inf (1 / 1e-38 does not): the draw is then among the
    tokens at +inf (the limit of the softmax), never NaN, never another token."""
    xp = _xp(device)
    x = np.repeat(np.array([[1.0, 300.0, -2.0, 300.0, 0.3]], np.float32), 2000, axis=0)
    params = SamplingParams(temperature=1e-38, seed=0)
    tokens = to_numpy(sample(xp.asarray(x), params, None, params.make_rng()))
    assert set(np.unique(tokens).tolist()) == {1, 3}
    assert 800 < (tokens == 1).sum() < 1200


def test_a_uniform_rounded_up_to_one_draws_the_last_possible_token(device: str) -> None:
    """Uniforms are in [0, 1), but one drawn in float32 may round to 1.0: the draw is then the
    last token left by the filters, never a filtered one past it."""
    xp = _xp(device)
    x = np.array([[0.0, 2.0, 1.0, -5.0, -6.0]], np.float32)
    params = SamplingParams(temperature=1.0, top_k=3)
    for u, want in ((np.float32(1 - 2**-30), 2), (0.0, 0)):
        tokens = sample_tokens(xp.asarray(x), params, xp.asarray([u]))
        assert to_numpy(tokens).tolist() == [want]


def test_sample_accepts_half_precision_logits(device: str) -> None:
    xp = _xp(device)
    x = make_logits((3, 100), "normal", seed=19)
    params = SamplingParams(temperature=0.7, top_k=10, seed=4)
    a = sample(xp.asarray(x.astype(np.float16)), params, None, params.make_rng())
    b = sample(xp.asarray(x.astype(np.float16).astype(np.float32)), params, None, params.make_rng())
    np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


# ----------------------------------------------------------------------------- non-finite rows
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_a_non_finite_row_raises_naming_it(device: str, temperature: float, bad: str) -> None:
    xp = _xp(device)
    x = make_logits((4, 20), "masked", seed=20)  # -inf entries alone are fine
    x[1, 3] = x[3, 0] = {"nan": np.nan, "+inf": np.inf, "all -inf": -np.inf}[bad]
    if bad == "all -inf":
        x[[1, 3]] = -np.inf
    params = SamplingParams(temperature=temperature, seed=0)
    rng = params.make_rng()
    before = rng.bit_generator.state
    logits = xp.asarray(x)
    with pytest.raises(FloatingPointError, match=r"batch rows 1, 3\b") as caught:
        sample(logits, params, None, rng)
    assert "NaN or +inf" in str(caught.value)
    assert rng.bit_generator.state == before  # nothing drawn
    np.testing.assert_array_equal(to_numpy(logits), x)
    # the device-side step marks them -1 instead, and samples the others
    tokens = to_numpy(sample_tokens(logits, params, xp.asarray(rng.random(4))))
    assert tokens[1] == tokens[3] == -1 and (tokens[[0, 2]] >= 0).all()
    # the same rows without the bad values sample
    x[[1, 3]] = x[0]
    assert to_numpy(sample(xp.asarray(x), params, None, rng)).shape == (4,)


def test_penalties_that_leave_no_finite_logit_raise_naming_the_row(device: str) -> None:
    xp = _xp(device)
    x = np.array([[-3e38, -np.inf], [1.0, 2.0]], np.float32)
    counts = TokenCounts.from_prompt(xp.asarray([[0], [1]]), 2)
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, seed=0)
    with pytest.raises(FloatingPointError, match=r"penalties sent every logit of batch row 0 "):
        sample(xp.asarray(x), params, counts, params.make_rng())


# ---------------------------------------------------------------------------------- TokenCounts
def test_token_counts_from_prompt_and_update(device: str) -> None:
    xp = _xp(device)
    n_v = 12
    rows = [[1, 2, 2, 11], [3], [15, -1, 4]]  # 15 and -1 are outside the vocabulary
    listed = TokenCounts.from_prompt(rows, n_v, xp=xp)
    padded = np.array([[1, 2, 2, 11], [3, 7, 7, 7], [15, -1, 4, 9]])
    cut = TokenCounts.from_prompt(xp.asarray(padded), n_v, lengths=xp.asarray([4, 1, 3]))
    want_seen = np.zeros((3, n_v), bool)
    want_seen[0, [1, 2, 11]] = want_seen[1, 3] = want_seen[2, 4] = True
    for counts in (listed, cut):
        # on the device's arrays (the emulated CUDA:0's are NumPy arrays)
        assert counts.shape == (3, n_v) and array_module(counts.seen) is array_module(xp.asarray(1))
        np.testing.assert_array_equal(to_numpy(counts.seen), want_seen)
        assert not to_numpy(counts.generated).any()
    steps = [([5, 3, 0], None), ([5, -1, 0], None), ([5, 3, 12], [True, False, True])]
    want_generated = np.zeros((3, n_v), np.int32)
    for tokens, active in steps:
        listed.update(xp.asarray(tokens), None if active is None else xp.asarray(active))
        for b, t in enumerate(tokens):
            if 0 <= t < n_v and (active is None or active[b]):
                want_generated[b, t] += 1
                want_seen[b, t] = True
    np.testing.assert_array_equal(to_numpy(listed.generated), want_generated)
    np.testing.assert_array_equal(to_numpy(listed.seen), want_seen)
    assert listed.generated.dtype == np.int32 and listed.nbytes == 3 * n_v * 5
    listed.reset()
    assert not to_numpy(listed.seen).any() and not to_numpy(listed.generated).any()


def test_token_counts_update_writes_in_place(device: str) -> None:
    """A captured decode step writes the same buffers every step."""
    xp = _xp(device)
    counts = TokenCounts(2, 8, xp=xp)
    seen, generated = counts.seen, counts.generated
    counts.update(xp.asarray([1, 2]))
    assert counts.seen is seen and counts.generated is generated
    assert int(to_numpy(generated).sum()) == 2


def test_token_counts_reject_wrong_shapes() -> None:
    counts = TokenCounts(2, 8)
    with pytest.raises(ValueError, match=r"tokens must be a numpy int array \[B=2\]"):
        counts.update(np.array([1, 2, 3]))
    with pytest.raises(
        ValueError, match=r"tokens must be a numpy int array \[B=2\], got ndarray float"
    ):
        counts.update(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="active must be"):
        counts.update(np.array([1, 2]), np.array([True]))
    with pytest.raises(ValueError, match="vocab_size"):
        TokenCounts(2, 0)
    with pytest.raises(ValueError, match=r"lengths must be \[B=2\]"):
        TokenCounts.from_prompt(np.zeros((2, 3), np.int64), 8, lengths=np.array([1]))
    with pytest.raises(ValueError, match=r"prompt must be a \[B, T\] int array"):
        TokenCounts.from_prompt(np.zeros((2, 3), np.float32), 8)
    assert not counts.generated.any()


# ------------------------------------------------------------------------------ parameter checks
@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), "finite"),
        ("temperature", "hot", "real number"),
        ("top_k", -1, ">= 0"),
        ("top_k", 2.5, "int"),
        ("top_k", True, "int"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", float("nan"), "(0, 1]"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("min_p", float("nan"), "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("repetition_penalty", float("nan"), "> 0"),
        ("repetition_penalty", float("inf"), "finite"),
        ("presence_penalty", float("nan"), "[-2.0, 2.0]"),
        ("presence_penalty", 2.5, "[-2.0, 2.0]"),
        ("frequency_penalty", float("nan"), "[-2.0, 2.0]"),
        ("frequency_penalty", -3, "[-2.0, 2.0]"),
        ("frequency_penalty", None, "real number"),
        ("seed", -1, ">= 0"),
        ("seed", 1.0, "int"),
        ("max_new_tokens", -1, ">= 0"),
        ("max_new_tokens", None, "int"),
        ("stop_token_ids", (1, -2), ">= 0"),
        ("stop_token_ids", (1, "2"), "ints"),
        ("stop_token_ids", 5, "tuple"),
        ("stop", ("",), "non-empty"),
        ("stop", (b"x",), "strings"),
    ],
)
def test_invalid_parameters_name_the_field_value_and_range(
    field: str, value: Any, allowed: str
) -> None:
    with pytest.raises(ValueError) as caught:  # SamplingTypeError is a ValueError too
        SamplingParams(**{field: value})
    message = str(caught.value)
    assert message.startswith(f"SamplingParams: {field} must be")
    assert allowed in message and repr(value) in message
    if isinstance(caught.value, TypeError):
        assert isinstance(caught.value, SamplingTypeError)


def test_parameters_are_normalized_and_defaults_are_off() -> None:
    params = SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int64(4),
        top_p=1,
        seed=np.int32(3),
        stop_token_ids=[np.int64(2), 7],
        stop="###",
    )
    assert params.temperature == 0.5 and type(params.temperature) is float
    assert params.top_k == 4 and type(params.top_k) is int
    assert params.top_p == 1.0 and type(params.top_p) is float and type(params.seed) is int
    assert params.stop_token_ids == (2, 7) and all(type(t) is int for t in params.stop_token_ids)
    assert params.stop == ("###",)
    hash(params)  # frozen and hashable
    default = SamplingParams()
    assert not default.uses_counts and not default.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(frequency_penalty=0.1).uses_counts
    # off values process nothing: the logits come back as they were
    x = make_logits((2, 30), "masked", seed=21)
    assert_same_logits(process_logits(x, SamplingParams(top_k=0, top_p=1.0, min_p=0.0)), x)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda x: apply_temperature(x, 0.0),
            r"apply_temperature: temperature must be finite and > 0, got 0\.0",
        ),
        (lambda x: apply_top_k(x, 0), r"apply_top_k: top_k must be an int >= 1, got 0"),
        (lambda x: apply_top_p(x, 0), r"apply_top_p: top_p must be in \(0, 1\]"),
        (lambda x: apply_min_p(x, 2), r"apply_min_p: min_p must be in \[0, 1\]"),
        (lambda x: apply_repetition_penalty(x, 0, counts=x), r"repetition_penalty must be finite"),
        (lambda x: apply_repetition_penalty(x, 1.2), "exactly one of token_ids"),
        (lambda x: apply_repetition_penalty(x, 1.2, counts=x[:1]), "counts must be a numpy array"),
        (lambda x: apply_presence_frequency(x, 3, 0, x), r"presence_penalty must be in \[-2"),
        (lambda x: apply_presence_frequency(x, 0, 0, x), "counts must be integers"),
        (lambda x: apply_top_k(x[0], 2), r"logits must be a floating \[B, V\] array"),
        (lambda x: apply_top_k(x.astype(np.int32), 2), r"logits must be a floating"),
    ],
)
def test_processors_check_their_arguments(call: Callable[[np.ndarray], Any], message: str) -> None:
    x = make_logits((2, 30), "normal", seed=22)
    with pytest.raises(ValueError, match=message):
        call(x)


def test_sample_needs_counts_for_penalties_and_a_generator_for_draws() -> None:
    x = make_logits((2, 30), "normal", seed=23)
    with pytest.raises(ValueError, match=r"need the tokens seen so far: pass counts="):
        sample(x, SamplingParams(temperature=0, repetition_penalty=1.2))
    with pytest.raises(ValueError, match=r"counts are numpy \[3, 30\], the logits numpy \[2, 30\]"):
        sample(x, SamplingParams(temperature=0, presence_penalty=1), TokenCounts(3, 30))
    with pytest.raises(TypeError, match=r"pass rng=params.make_rng\(\)"):
        sample(x, SamplingParams(temperature=0.5))
    with pytest.raises(ValueError, match=r"needs uniforms"):
        sample_tokens(x, SamplingParams(temperature=0.5), np.zeros(3))
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        sample(x, {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a numpy\.ndarray or cupy\.ndarray"):
        sample([[0.0, 1.0]], SamplingParams(temperature=0))
