"""Llama INFERENCE builds: KV cache, chunked prefill, decode, ragged batches, generation, memory.

The bodies that take ``device`` run on the CPU and on ``CUDA:0`` (a GPU, or the kernel
emulator's), against the logits of an uncached TRAINING forward on the CPU (the reference the
float64 finite differences of ``test_llama.py`` certify) or against the same device's
components' own calls; sampling, stop tokens, refusals and the cache's bookkeeping are the
CPU's, which shares their host code with every device.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest
from cuda_arrays import EMULATED, cupy, host, on
from layer_helpers import move_optional_parameters

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.models import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=40,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=48,
    max_seq_len=64,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    model = Llama("llama", CFG, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    path = tmp_path_factory.mktemp("w") / "llama.safetensors"
    model.save(path)
    return str(path)


def make(
    weights: str, mode: RuntimeMode, shape: tuple[int, int], prefill: int = 0, device: str = "CPU"
) -> Llama:
    model = Llama("llama", CFG, device=device)
    model.build(BuildContext(shape, mode, prefill_size=prefill))
    model.load(weights)
    return model


def reference_logits(weights: str, tokens: np.ndarray) -> np.ndarray:
    """All-position logits from a TRAINING build (no cache involved)."""
    model = make(weights, RuntimeMode.TRAINING, tokens.shape)
    return model.forward(tokens).copy()


def tokens(b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(b, t))


@pytest.mark.parametrize("chunk", [0, 1, 5, 7, 32])
def test_chunked_prefill_equals_one_forward(device: str, weights: str, chunk: int) -> None:
    if EMULATED and device != "CPU" and chunk in (1, 32):
        pytest.skip("the emulator runs kernels on the CPU: chunks of 0, 5 and 7 tokens there")
    x = tokens(2, 30)
    full = reference_logits(weights, x)
    model = make(weights, RuntimeMode.INFERENCE, (2, 48), prefill=chunk, device=device)
    last = model.prefill(x)
    np.testing.assert_allclose(host(last), full[:, -1], rtol=1e-5, atol=1e-5)


def test_decode_at_each_position_equals_forward(device: str, weights: str) -> None:
    x = tokens(2, 24, seed=1)
    full = reference_logits(weights, x)
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), prefill=4, device=device)
    logits = model.prefill(x[:, :5])
    np.testing.assert_allclose(host(logits), full[:, 4], rtol=1e-5, atol=1e-5)
    for position in range(5, 24):  # positions pass the llama3 original context (16)
        logits = model.decode(x[:, position], position)
        np.testing.assert_allclose(host(logits), full[:, position], rtol=1e-5, atol=1e-5)


def test_ragged_batch_decodes_each_sequence_at_its_own_position(device: str, weights: str) -> None:
    a, b = tokens(1, 12, seed=2)[0], tokens(1, 7, seed=3)[0]
    ref_a, ref_b = reference_logits(weights, a[None]), reference_logits(weights, b[None])
    model = make(weights, RuntimeMode.INFERENCE, (2, 16), prefill=4, device=device)
    padded = np.stack([a[:5], np.concatenate([b[:3], [0, 0]])])  # b is shorter: padded
    model.prefill(padded)
    lengths = np.array([5, 3])
    while lengths[0] < 12:
        nxt = np.array([a[lengths[0]], b[lengths[1]] if lengths[1] < 7 else 0])
        logits = host(model.decode(nxt, lengths))
        np.testing.assert_allclose(logits[0], ref_a[0, lengths[0]], rtol=1e-5, atol=1e-5)
        if lengths[1] < 7:
            np.testing.assert_allclose(logits[1], ref_b[0, lengths[1]], rtol=1e-5, atol=1e-5)
        lengths = lengths + 1


def test_forward_on_an_inference_build_matches_training(device: str, weights: str) -> None:
    x = tokens(1, 10, seed=4)
    model = make(weights, RuntimeMode.INFERENCE, (1, 16), device=device)
    np.testing.assert_allclose(host(model.forward(x)), reference_logits(weights, x), atol=1e-5)


def test_greedy_generate_is_argmax_of_the_full_recomputation(device: str, weights: str) -> None:
    """A prompt on the host or on the model's device: the same host tokens."""
    prompt = tokens(1, 6, seed=5)[0]
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), prefill=4, device=device)
    out = model.generate(prompt, max_new_tokens=8)
    assert isinstance(out, np.ndarray) and out.shape == (14,)
    np.testing.assert_array_equal(out[:6], prompt)
    for i in range(6, 14):  # every token is the argmax of an uncached forward over its prefix
        assert out[i] == reference_logits(weights, out[None, :i])[0, -1].argmax()
    np.testing.assert_array_equal(model.generate(on(device, prompt), 8), out)
    both = model.generate(np.stack([prompt, prompt]), max_new_tokens=8)
    assert isinstance(both, np.ndarray)
    np.testing.assert_array_equal(both, [out, out])


def test_generation_past_the_context_is_cut_with_a_warning(weights: str) -> None:
    """A build with a context of 32: a 28-token prompt leaves room for 5 new tokens (the last
    is never fed back), so asking for 20 gives 5 and says so; asking for 5 says nothing."""
    prompt = tokens(1, 28, seed=9)[0]
    model = make(weights, RuntimeMode.INFERENCE, (1, 32), prefill=8)
    with pytest.warns(UserWarning, match="max_new_tokens=20 cut to 5"):
        out = model.generate(prompt, max_new_tokens=20)
    assert out.shape == (33,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=5), out)
    with pytest.warns(UserWarning, match="cut to 5"):
        assert len(list(model.stream(prompt, max_new_tokens=6))) == 5


def test_sampling_is_seeded_and_top_k_one_is_greedy(weights: str) -> None:
    prompt = tokens(2, 4, seed=6)
    model = make(weights, RuntimeMode.INFERENCE, (2, 32))
    a = model.generate(prompt, 6, temperature=1.0, top_p=0.9, seed=7)
    b = model.generate(prompt, 6, temperature=1.0, top_p=0.9, seed=7)
    np.testing.assert_array_equal(a, b)
    greedy = model.generate(prompt, 6)
    np.testing.assert_array_equal(model.generate(prompt, 6, temperature=0.8, top_k=1), greedy)
    streamed = list(model.stream(prompt, 6))
    np.testing.assert_array_equal(np.stack(streamed, axis=1), greedy[:, 4:])


def expected_with_eos(greedy: np.ndarray, n_prompt: int, stop: set[int], pad: int) -> np.ndarray:
    """``greedy`` (no stopping) cut as an EOS rule would: a row's tokens after its first EOS are
    ``pad``, and the output ends at the step where the last row finished."""
    out = greedy.copy()
    ends = []
    for row in out:
        hits = [i for i in range(n_prompt, row.size) if row[i] in stop]
        if hits:
            row[hits[0] + 1 :] = pad
        ends.append(hits[0] + 1 if hits else row.size)
    return out[:, : max(ends)]


@pytest.mark.parametrize("pad", [None, 0])
def test_generation_stops_at_eos(weights: str, pad: int | None) -> None:
    prompt = tokens(2, 4, seed=8)
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), prefill=3)
    greedy = model.generate(prompt, 12)
    # EOS ids that row 0 emits early and row 1 later (or never): both stopping paths run
    first = int(greedy[0, 4 + 2])
    later = [int(t) for t in greedy[1, 4 + 5 :] if t != first and t not in greedy[0, 4:7]]
    stop = [first, *later[:1]]
    got = model.generate(prompt, 12, eos_token_id=stop, pad_token_id=pad)
    want = expected_with_eos(greedy, 4, set(stop), stop[0] if pad is None else pad)
    assert got.shape[1] < greedy.shape[1] or not later
    np.testing.assert_array_equal(got, want)
    # one id, and a row that never finishes: the stream runs every step
    never = (set(range(CFG.vocab_size)) - set(greedy[0, 4:].tolist())).pop()
    single = model.generate(prompt[:1], 12, eos_token_id=never)
    np.testing.assert_array_equal(single, greedy[:1])
    # NumPy ids: a scalar, a 0-d array, an array of several
    once = model.generate(prompt, 12, eos_token_id=first)
    np.testing.assert_array_equal(once, expected_with_eos(greedy, 4, {first}, first))
    for eos in (np.int32(first), np.array(first), np.array([first])):
        np.testing.assert_array_equal(model.generate(prompt, 12, eos_token_id=eos), once)
    streamed = list(model.stream(prompt, 12, eos_token_id=first, pad_token_id=pad))
    np.testing.assert_array_equal(
        np.stack(streamed, axis=1),
        expected_with_eos(greedy, 4, {first}, first if pad is None else pad)[:, 4:],
    )


@pytest.mark.parametrize("chunk", [0, 3])
def test_ragged_prompts_generate_what_each_prompt_generates_alone(
    device: str, weights: str, chunk: int
) -> None:
    """A list of prompts of different lengths (one of them an array on the model's device)
    gives a list, each row what its prompt gives alone, through generate and stream, greedy,
    cut at an EOS and sampled with a seed."""
    emulated = EMULATED and device != "CPU"
    if emulated and chunk == 0:
        pytest.skip("the emulator runs kernels on the CPU: chunked prefill only there")
    new = 3 if emulated else 9  # new tokens (the emulator launches each kernel on the CPU)
    prompts = [tokens(1, t, seed=20 + t)[0] for t in (7, 3, 5)]
    model = make(weights, RuntimeMode.INFERENCE, (3, 32), prefill=chunk, device=device)
    alone = make(weights, RuntimeMode.INFERENCE, (1, 32), prefill=chunk, device=device)
    got = model.generate([on(device, prompts[0]), *prompts[1:]], new)
    assert isinstance(got, list) and [g.size for g in got] == [7 + new, 3 + new, 5 + new]
    for p, g in zip(prompts, got, strict=True):
        np.testing.assert_array_equal(g, alone.generate(p, new))
    # the same through stream, sampled with a seed, and with an EOS that one row emits
    streamed = np.stack(list(model.stream(prompts, new)), axis=1)
    np.testing.assert_array_equal(streamed, np.stack([g[-new:] for g in got]))
    eos = int(got[1][3 + 2])  # row 1's third new token
    cut = model.generate(prompts, new, eos_token_id=eos, pad_token_id=0)
    assert len({c.size - p.size for c, p in zip(cut, prompts, strict=True)}) == 1
    for p, c in zip(prompts, cut, strict=True):  # each row as alone, then padded
        a = alone.generate(p, new, eos_token_id=eos, pad_token_id=0)
        np.testing.assert_array_equal(c[: a.size], a)
        assert (c[a.size :] == 0).all()
    sampled = model.generate(prompts, min(new, 5), temperature=1.0, seed=3)
    again = model.generate(prompts, min(new, 5), temperature=1.0, seed=3)
    np.testing.assert_array_equal(np.concatenate(sampled), np.concatenate(again))


def test_a_list_of_prompts_gives_a_list_whatever_their_lengths(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), prefill=3)
    x = tokens(2, 5, seed=30)
    as_array = model.generate(x, 6)
    for prompts in ([x[0], x[1]], [list(x[0]), list(x[1])], (x[0], x[1])):
        got = model.generate(prompts, 6)
        assert isinstance(got, list) and len(got) == 2
        np.testing.assert_array_equal(np.stack(got), as_array)
    one = model.generate([x[0]], 6)
    assert isinstance(one, list) and len(one) == 1
    np.testing.assert_array_equal(one[0], model.generate(x[0], 6))


def test_ragged_prompts_must_be_token_sequences(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (2, 32))
    bad = [
        [tokens(1, 4)[0], tokens(2, 3)],  # a 2-D item
        [tokens(1, 4)[0], np.array([], dtype=np.int64)],  # an empty one
        [np.array([1.7, 2.2]), np.array([3.9])],  # floats are not tokens
    ]
    for prompts in bad:
        with pytest.raises(ValueError, match="1-D integer"):
            model.generate(prompts, 4)
        with pytest.raises(ValueError, match="1-D integer"):
            model.stream(prompts, 4)  # at the call, not at the first step
    with pytest.raises(ValueError, match="top_p"):
        model.stream(tokens(1, 4), 4, temperature=1.0, top_p=2.0)
    for prompt, match in (
        (tokens(1, 4).astype(np.float32), "integer"),
        (np.zeros((1, 0), dtype=np.int64), "integer"),
        (tokens(3, 4), "do not fit"),  # B = 3 > 2
        (tokens(1, 33), "do not fit"),  # T = 33 > 32
        (np.array([[1, CFG.vocab_size]]), "token ids"),
        ([np.array([1, 2]), np.array([-1])], "token ids"),
    ):
        with pytest.raises(ValueError, match=match):
            model.stream(prompt, 4)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.stream(tokens(1, 4), 4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"eos_token_id": CFG.vocab_size}, ValueError),
        ({"eos_token_id": -1}, ValueError),
        ({"eos_token_id": []}, ValueError),
        ({"eos_token_id": 1.0}, TypeError),
        ({"eos_token_id": True}, TypeError),
        ({"eos_token_id": 1, "pad_token_id": CFG.vocab_size}, ValueError),
        ({"eos_token_id": np.array(CFG.vocab_size)}, ValueError),
        ({"eos_token_id": np.array(1.0)}, TypeError),
    ],
)
def test_bad_stop_tokens_are_refused(weights: str, kwargs: dict, error: type) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 32))
    with pytest.raises(error, match="token_id"):
        model.generate(tokens(1, 4), 4, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"temperature": 1j}, TypeError, "temperature"),
        ({"temperature": np.array([0.5, 0.7])}, TypeError, "temperature"),
        ({"temperature": 1.0, "top_k": 2.5}, TypeError, "top_k"),
        ({"temperature": 1.0, "top_k": 0}, ValueError, "top_k"),
        ({"temperature": 1.0, "top_p": float("nan")}, ValueError, "top_p"),
        ({"temperature": 1.0, "top_p": "0.5"}, TypeError, "top_p"),
        ({"temperature": 1.0, "top_p": True}, TypeError, "top_p"),
        ({"temperature": 1.0, "top_p": -0.1}, ValueError, "top_p"),
        ({"temperature": 1.0, "seed": -3}, ValueError, "seed"),
        ({"temperature": 1.0, "seed": 1.5}, TypeError, "seed"),
        ({"temperature": 1.0, "min_p": 1.5}, ValueError, "Llama 'llama': min_p"),
        ({"temperature": 1.0, "min_p": "0.1"}, TypeError, "min_p"),
        ({"repetition_penalty": 0.0}, ValueError, "Llama 'llama': repetition_penalty"),
        ({"repetition_penalty": float("inf")}, ValueError, "repetition_penalty"),
        ({"presence_penalty": 2.5}, ValueError, "Llama 'llama': presence_penalty"),
        ({"frequency_penalty": -3.0}, ValueError, "frequency_penalty"),
        ({"frequency_penalty": None}, TypeError, "frequency_penalty"),
    ],
    ids=str,
)
def test_bad_sampling_is_refused_before_any_work(
    weights: str, kwargs: dict, error: type, pattern: str
) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 32))
    model.prefill(tokens(1, 6))
    caches = [block.self_attn._state["k_cache"].copy() for block in model.layers]
    with pytest.raises(error, match=pattern):
        model.generate(tokens(1, 4, seed=3), 4, **kwargs)
    for block, cache in zip(model.layers, caches, strict=True):
        np.testing.assert_array_equal(block.self_attn._state["k_cache"], cache)


def penalized_greedy(
    model: Llama, prompt: np.ndarray, new: int, repetition: float, presence: float, frequency: float
) -> np.ndarray:
    """Greedy tokens under the penalties, written from their definitions on the host: a logit
    of a token in the prompt or generated so far divided by ``repetition`` when positive, else
    multiplied (transformers); then ``presence`` subtracted once and ``frequency`` once per
    time from the logit of every token generated so far (OpenAI)."""
    logits = model.prefill(prompt)
    out = []
    for step in range(new):
        chosen = []
        for b, row in enumerate(logits.astype(np.float32)):
            done = [t[b] for t in out]
            seen = set(prompt[b].tolist()) | set(done)
            x = row.copy()
            for token in seen:
                x[token] = x[token] * repetition if x[token] < 0 else x[token] / repetition
            for token in set(done):
                x[token] -= np.float32(presence) + np.float32(frequency) * done.count(token)
            chosen.append(int(np.argmax(x)))
        out.append(np.array(chosen))
        logits = model.decode(out[-1], prompt.shape[1] + step)
    return np.stack(out, axis=1)


def test_penalties_follow_their_definitions(weights: str) -> None:
    """Greedy generation with the repetition, presence and frequency penalties on picks what
    the penalties' definitions pick (each step from the previous steps' tokens), which is
    not what plain greedy picks."""
    model = make(weights, RuntimeMode.INFERENCE, (2, 32))
    prompt = tokens(2, 5, seed=11)
    args = (1.8, 0.7, 0.9)
    got = model.generate(
        prompt, 10, repetition_penalty=args[0], presence_penalty=args[1], frequency_penalty=args[2]
    )
    want = penalized_greedy(model, prompt, 10, *args)
    np.testing.assert_array_equal(got[:, 5:], want)
    assert not np.array_equal(got, model.generate(prompt, 10))
    only_repetition = model.generate(prompt, 10, repetition_penalty=1.8)
    np.testing.assert_array_equal(
        only_repetition[:, 5:], penalized_greedy(model, prompt, 10, 1.8, 0, 0)
    )


#: sharpens the near-uniform logits of the tests' random weights
TEMPERATURE = 0.1


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [({"top_k": 4}, "top_k"), ({"min_p": 0.3}, "min_p"), ({"top_p": 0.6}, "top_p")],
    ids=["top_k", "min_p", "top_p"],
)
def test_sampled_tokens_follow_the_filtered_distribution(
    weights: str, kwargs: dict, kept: str
) -> None:
    """The first new token of 64 copies of one prompt, drawn with 8 seeds at a temperature of
    0.1: every draw is a token the filter keeps, and their frequencies are those of the
    filtered softmax of the logits over the temperature (within 4.5
    standard deviations each: the seeds fix the draws, so this either always passes or
    never)."""
    n_b, n_seeds = 64, 8
    model = make(weights, RuntimeMode.INFERENCE, (n_b, 8))
    prompt = np.repeat(tokens(1, 4, seed=12), n_b, axis=0)
    logits = model.prefill(prompt[:1])[0].astype(np.float64) / TEMPERATURE
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(p.size, bool)
    if kept == "top_k":
        keep[order[: kwargs["top_k"]]] = True
    elif kept == "min_p":
        keep = p >= kwargs["min_p"] * p.max()
    else:  # the smallest set of the most likely tokens whose probability reaches top_p
        reach = np.cumsum(p[order])
        keep[order[: int(np.searchsorted(reach, kwargs["top_p"])) + 1]] = True
    assert 1 < keep.sum() < p.size  # a filter that keeps some tokens and drops others
    want = np.where(keep, p, 0) / p[keep].sum()
    draws = np.concatenate(
        [
            model.generate(prompt, 1, temperature=TEMPERATURE, seed=seed, **kwargs)[:, -1]
            for seed in range(n_seeds)
        ]
    )
    assert keep[draws].all()
    n = draws.size
    seen = np.bincount(draws, minlength=p.size) / n
    bound = 4.5 * np.sqrt(want * (1 - want) / n) + 1 / n
    assert (np.abs(seen - want) <= bound).all(), (seen[keep], want[keep])


def test_temperature_takes_numpy_numbers(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 32))
    prompt = tokens(1, 4, seed=3)
    want = model.generate(prompt, 4, temperature=0.7, seed=1)
    for temperature in (np.float32(0.7), np.array(0.7)):
        got = model.generate(prompt, 4, temperature=temperature, seed=1)
        np.testing.assert_array_equal(got, want)


def test_extreme_sampling_settings_are_greedy(weights: str) -> None:
    """A temperature so small that logits / T overflows, and top_p = 0 (the most likely token
    only, as Hugging Face keeps it), both give the greedy tokens."""
    model = make(weights, RuntimeMode.INFERENCE, (1, 32))
    prompt = tokens(1, 5, seed=4)
    greedy = model.generate(prompt, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow on the way
        np.testing.assert_array_equal(model.generate(prompt, 6, temperature=1e-310), greedy)
    np.testing.assert_array_equal(model.generate(prompt, 6, temperature=2.0, top_p=0.0), greedy)


def test_a_stream_refuses_to_go_on_after_another_call_used_the_cache(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 32))
    alone = model.generate(tokens(1, 4), 4)[0, 4:]
    a = model.stream(tokens(1, 4), 4)
    assert next(a)[0] == alone[0]
    b = model.stream(tokens(1, 3, seed=5), 4)
    next(b)  # b's prefill rewrote the cache a's next token would read
    with pytest.raises(RuntimeError, match="another call wrote the KV cache"):
        next(a)
    assert len(list(b)) == 3  # b goes on
    # calls refused before writing anything leave a paused stream alone
    d = model.stream(tokens(1, 4), 4)
    assert next(d)[0] == alone[0]
    bad = tokens(1, 3)
    bad[0, 1] = CFG.vocab_size
    for refused in (
        lambda: model.prefill(bad),
        lambda: model.prefill(tokens(1, 2), position_offset=20),  # past the cached positions
        lambda: model.forward(bad),
        lambda: model.decode(np.array([1]), 30),
    ):
        with pytest.raises(ValueError):
            refused()
    np.testing.assert_array_equal(np.concatenate([[alone[0]], np.concatenate(list(d))]), alone)
    for interrupt in (lambda: model.decode(np.array([1]), 2), model.reset):
        c = model.stream(tokens(1, 4), 4)
        next(c)
        interrupt()
        with pytest.raises(RuntimeError, match="start a new stream"):
            next(c)
    np.testing.assert_array_equal(model.generate(tokens(1, 4), 4)[0, 4:], alone)


def test_an_empty_batch_is_a_no_op(device: str, weights: str) -> None:
    """prefill and decode of B == 0 sequences, decode at an int or per-sequence positions:
    no rows, and no launch of an empty grid (a CUDA launch error), through the model's plan
    and the attention."""
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), device=device)
    assert model.prefill(np.zeros((0, 3), np.int64)).shape == (0, CFG.vocab_size)
    none = np.zeros(0, np.int64)
    for position in (0, none):
        assert model.decode(none, position).shape == (0, CFG.vocab_size)
    x = np.zeros((0, 1, CFG.dim), np.float32)
    attention = model.layers[0].self_attn
    assert attention.decode(on(device, x), none).shape[0] == 0
    assert model.cached_lengths == (0, 0)


def test_bad_prompts_and_batches_name_the_model(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (2, 32))
    with pytest.raises(ValueError, match="Llama 'llama': prompt must be"):
        model.generate([[1, 2], 3], 2)
    model.prefill(tokens(2, 4))
    with pytest.raises(ValueError, match="exceeds the build shape"):  # the build's B, not zip's
        model.decode(np.ones(3, np.int64), np.array([4, 4, 4]))
    assert model.cached_lengths == (4, 4)


def test_a_bad_id_in_a_later_chunk_leaves_the_cache_alone(weights: str) -> None:
    """prefill checks every chunk's ids before the first chunk writes the cache, so a
    conversation survives a bad continuation."""
    model = make(weights, RuntimeMode.INFERENCE, (1, 32), prefill=4)
    conversation = tokens(1, 12)
    model.prefill(conversation)
    want = model.decode(np.array([7]), 12)
    branch = tokens(1, 10, seed=4)
    branch[0, 9] = CFG.vocab_size  # in the third chunk
    with pytest.raises(ValueError, match="out of range"):
        model.prefill(branch, position_offset=2)
    np.testing.assert_array_equal(model.decode(np.array([7]), 12), want)


def test_memory_prediction_and_inference_is_smaller(weights: str) -> None:
    model = Llama("llama", CFG, device="CPU")
    infer_ctx = BuildContext((1, 64), RuntimeMode.INFERENCE, prefill_size=8)
    train_ctx = BuildContext((1, 64), RuntimeMode.TRAINING)
    predicted = model.required_memory(infer_ctx)
    assert not model.is_built  # the prediction built nothing on this model
    model.build(infer_ctx)
    assert predicted == model.get_memory_stats()
    training = Llama("llama", CFG, device="CPU").required_memory(train_ctx)
    assert predicted.gradient_bytes == 0
    assert predicted.total_bytes < training.total_bytes / 2
    # the KV cache: 2 layers x (K + V) x [1, 64, Hk * d] float32
    kv = 2 * 2 * 64 * CFG.n_kv_heads * (CFG.dim // CFG.n_heads) * 4
    assert predicted.state_bytes >= kv


def test_memory_of_a_build_larger_than_the_machine_is_predicted() -> None:
    """required_memory allocates nothing of the build: a 128k-token TRAINING build whose
    attention probabilities need 256 GiB is a table, not a MemoryError."""
    import tracemalloc

    big = LlamaConfig(
        vocab_size=128256, dim=256, n_layers=1, n_heads=4, n_kv_heads=1, hidden_dim=512,
        max_seq_len=131072,
    )  # fmt: skip
    model = Llama("llama", big, device="CPU")
    tracemalloc.start()
    try:
        stats = model.required_memory(BuildContext((1, 131072), RuntimeMode.TRAINING))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    probs = big.n_heads * 131072 * 131072 * 4  # [B, Hk, g, T, T] float32
    assert stats.state_bytes > probs >= 256 * 2**30
    assert stats.parameter_bytes == 4 * model_parameters(big)
    assert peak < 256 * 2**20  # the RoPE table (32 MiB) and small things only
    assert not model.is_built


def model_parameters(cfg: LlamaConfig) -> int:
    d, hd = cfg.dim, cfg.dim // cfg.n_heads
    attn = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d
    block = attn + 3 * d * cfg.hidden_dim + 2 * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.n_layers * block + d + head


def test_positions_outside_the_context_are_refused(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 8))
    with pytest.raises(ValueError):
        model.prefill(tokens(1, 9))
    model.prefill(tokens(1, 3))
    with pytest.raises(ValueError, match="decode positions"):
        model.decode(np.array([1]), 8)
    training = make(weights, RuntimeMode.TRAINING, (1, 8))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        training.decode(np.array([1]), 3)


def test_attention_decode_takes_one_token_per_sequence(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 8))
    model.prefill(tokens(1, 3))
    attn = model.layers[0].self_attn
    cache = attn._state["k_cache"].copy()
    x = np.ones((1, 2, CFG.dim), np.float32)
    with pytest.raises(ValueError, match=r"decode takes x \[B, 1, dim\]"):
        attn.decode(x, 3)
    np.testing.assert_array_equal(attn._state["k_cache"], cache)  # nothing written


def test_prefill_at_an_offset_continues_and_rewinds_the_conversation(
    device: str, weights: str
) -> None:
    """A second turn prefilled after a decoded token, a rewind prefilled over the stale tail,
    then ragged decode in which one sequence rewinds further: each the logits of an uncached
    forward over what the sequence holds."""
    x = tokens(2, 26, seed=6)
    full = reference_logits(weights, x)
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), prefill=4, device=device)
    model.prefill(x[:, :9])
    model.decode(x[:, 9], 9)
    # a second turn appended after the decoded token
    last = model.prefill(x[:, 10:26], position_offset=10)
    np.testing.assert_allclose(host(last), full[:, 25], rtol=1e-5, atol=1e-5)
    # rewind to position 12 with other tokens: the stale tail is never read
    other = x.copy()
    other[:, 12:20] = tokens(2, 8, seed=7)
    ref = reference_logits(weights, other[:, :20])
    last = model.prefill(other[:, 12:20], position_offset=12)
    np.testing.assert_allclose(host(last), ref[:, -1], rtol=1e-5, atol=1e-5)
    # ragged decode: sequence 0 goes on at 20, sequence 1 rewinds to 17
    new = tokens(2, 4, seed=8)
    rows = [np.concatenate([other[0, :20], new[0]]), np.concatenate([other[1, :17], new[1]])]
    refs = [reference_logits(weights, row[None])[0] for row in rows]
    positions = np.array([20, 17])
    for step in range(4):
        logits = host(model.decode(new[:, step], positions))
        for b in range(2):
            want = refs[b][positions[b]]
            np.testing.assert_allclose(logits[b], want, rtol=1e-5, atol=1e-5)
        positions = positions + 1
    assert model.cached_lengths == (24, 21)
    with pytest.raises(ValueError, match="offset"):
        model.prefill(x[:, :8], position_offset=25)  # 25 + 8 > 32
    with pytest.raises(ValueError, match="position_offset"):
        model.prefill(x[:, :2], position_offset=-1)


def test_reset_zeroes_every_cache(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (1, 16), prefill=4)
    before = model.prefill(tokens(1, 6, seed=8))
    caches = [b.self_attn._state[k] for b in model.layers for k in ("k_cache", "v_cache")]
    assert all(np.abs(c).sum() > 0 for c in caches)
    model.reset()
    assert all(not c.any() for c in caches)
    np.testing.assert_array_equal(model.prefill(tokens(1, 6, seed=8)), before)
    training = make(weights, RuntimeMode.TRAINING, (1, 8))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        training.reset()


def test_the_cache_refuses_positions_it_does_not_hold(weights: str) -> None:
    """A prefill or decode may only continue what each sequence has cached: a position past
    it would attend to cache rows never written. Refused before anything is written; a
    rewind (an earlier position) drops what lay past it."""
    x = tokens(2, 12, seed=9)
    full = reference_logits(weights, x)
    model = make(weights, RuntimeMode.INFERENCE, (2, 32), prefill=4)
    assert model.cached_lengths == (0, 0)
    model.prefill(x[:, :6])
    assert model.cached_lengths == (6, 6)
    caches = [b.self_attn._state[k] for b in model.layers for k in ("k_cache", "v_cache")]
    before = [c.copy() for c in caches]
    with pytest.raises(ValueError, match=r"sequence 0 has positions 0\.\.5 .* position 7"):
        model.decode(x[:, 6], 7)
    with pytest.raises(ValueError, match=r"sequence 1 has positions 0\.\.5"):
        model.decode(x[:, 6], np.array([6, 9]))
    with pytest.raises(ValueError, match="never written"):
        model.prefill(x[:, 6:9], position_offset=7)
    with pytest.raises(ValueError, match="never written"):
        model.layers[1].self_attn.decode(np.ones((2, 1, CFG.dim), np.float32), 8)
    for cache, old in zip(caches, before, strict=True):
        np.testing.assert_array_equal(cache, old)
    assert model.cached_lengths == (6, 6)
    np.testing.assert_allclose(model.decode(x[:, 6], 6), full[:, 6], rtol=1e-5, atol=1e-5)
    # sequence 1 rewinds to position 3: what it held past that is gone
    model.decode(x[:, 3], np.array([7, 3]))
    assert model.cached_lengths == (8, 4)
    assert model.layers[0].self_attn.cached_lengths == (8, 4)  # one record for all layers
    with pytest.raises(ValueError, match=r"sequence 1 has positions 0\.\.3"):
        model.decode(x[:, 7], 7)
    # a shorter batch leaves the other sequences as they are
    model.prefill(x[:1, :2])
    assert model.cached_lengths == (2, 4)
    model.reset()
    assert model.cached_lengths == (0, 0)
    with pytest.raises(ValueError, match="sequence 0 has no positions"):
        model.decode(x[:, 0], 1)
    np.testing.assert_allclose(model.decode(x[:, 0], 0), full[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="INFERENCE"):
        _ = make(weights, RuntimeMode.TRAINING, (1, 8)).cached_lengths


def test_standalone_attention_refuses_positions_its_cache_does_not_hold() -> None:
    from mila_py.components import AttentionConfig, GroupedQueryAttention

    cfg = AttentionConfig(dim=16, n_heads=2, n_kv_heads=1, max_seq_len=16)
    attn = GroupedQueryAttention("attn", cfg, device="CPU")
    attn.build(BuildContext((1, 8, 16), RuntimeMode.INFERENCE, prefill_size=4))
    x = np.random.default_rng(0).standard_normal((1, 4, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="no positions"):
        attn.forward(x, 1)
    assert not attn._state["k_cache"].any()
    attn.forward(x, 0)
    attn.forward(x[:, :2], 4)
    assert attn.cached_lengths == (6,)
    with pytest.raises(ValueError, match=r"0\.\.5"):
        attn.decode(x[:, :1], 7)
    attn.decode(x[:, :1], 6)
    assert attn.cached_lengths == (7,)
    attn.reset_cache()
    assert attn.cached_lengths == (0,)


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 12}


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP64])
@pytest.mark.parametrize("backend", ["auto", "numpy"])
@pytest.mark.parametrize("scaling", ["llama3", "dynamic"])
def test_cpu_decode_plan_equals_the_component_path_on_either_backend(
    weights: str, backend: str, scaling: str, precision: Precision, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU decode plan against the components' own calls, on the same prompt
    and tokens, with one position for all and, later, ragged positions. "dynamic" recomputes
    RoPE rows past its original context (no table covers them); halfway, one layer's RoPE
    backend switches under the plan."""
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", backend)  # read when the ops are created
    import dataclasses

    cfg = CFG if scaling == "llama3" else dataclasses.replace(CFG, rope_scaling=DYNAMIC)
    models = []
    for _ in range(2):
        model = Llama("llama", cfg, device="CPU", precision=precision)
        model.build(BuildContext((2, 32), RuntimeMode.INFERENCE, prefill_size=4))
        model.load(weights, check_config=False)  # the weights were saved with llama3 scaling
        models.append(model)
    planned, components = models
    x = tokens(2, 24, seed=7)
    for model in models:
        model.prefill(x[:, :5])
    for position in range(5, 24):  # past both scalings' original context
        if position == 14:
            planned.layers[0].self_attn.rope.op.backend = "numpy"
            components.layers[0].self_attn.rope.op.backend = "numpy"
        # one position for all until 16, then sequence 1 falls back by 3 (ragged)
        where = position if position < 16 else np.array([position, position - 3])
        got = planned.decode(x[:, position], where)
        want = components._decode_components(x[:, position, None], where)
        assert got.dtype == precision.numpy_dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert planned._plans is not None and list(planned._plans) == [2]


#: every optional part of the Llama config: attention and MLP biases, Q/K head norms (Qwen3)
EXTRAS: dict[str, Any] = {"qkv_bias": True, "out_bias": True, "mlp_bias": True, "qk_norm": True}


@pytest.mark.parametrize(("tie", "extras"), [(False, False), (True, False), (False, True)])
def test_decode_plan_equals_the_component_path(
    device: str, tmp_path: Any, tie: bool, extras: bool
) -> None:
    """The decode plan (bound products and launches; on a GPU ``attention_decode`` and
    ``kv_cache_write``, the step's positions read from its device buffer, the step replayed
    from its graph) against the same device's components' own calls: one position for all,
    ragged positions (also given as an array on the device), B=1 in a B=2 build; logits and
    KV caches."""
    on_cpu = device == "CPU"
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, **(EXTRAS if extras else {}))
    rng = np.random.default_rng(20260601)
    trained = Llama("llama", cfg, device="CPU")
    trained.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    move_optional_parameters(trained, rng, bias=0.5, norm=0.5)
    trained.save(tmp_path / "w.safetensors")
    planned, components = (Llama("llama", cfg, device=device) for _ in range(2))
    for model in (planned, components):
        model.build(BuildContext((2, 48), RuntimeMode.INFERENCE, prefill_size=6))
        model.load(tmp_path / "w.safetensors")
    x = rng.integers(0, cfg.vocab_size, size=(2, 36))
    for model in (planned, components):
        model.prefill(x[:, :7])
    for position in range(7, 36):
        # ragged from 15 (sequence 0 four behind); at 20 sequence 0 goes on alone (B=1) and
        # sequence 1 then continues a step behind
        n_b, where = 2, position
        if position == 20:
            n_b, where = 1, position - 4
        elif position > 14:
            where = np.array([position - 4, position - (position > 20)])
            if position % 2:
                where = on(device, where)
        got = planned.decode(x[:n_b, position], where)
        want = components._decode_components(on(device, x[:n_b, position, None]), where)
        np.testing.assert_allclose(host(got), host(want), rtol=1e-5, atol=1e-5)
    assert sorted(planned._plans) == [1, 2] and components._plans == {}
    # each batch size's step tried one capture on a GPU (none on the CPU, which runs eagerly);
    # it replays a graph where every call can be captured, and stays eager where a library
    # refuses (CuPy 14's cuBLAS calls do)
    for n_b, plan in planned._plans.items():
        assert plan.step.captures == (0 if on_cpu else 1)
        assert (plan.step.graph is None) == plan.step.eager
        assert plan.step.eager or not on_cpu
        if not on_cpu:
            assert plan.positions.device.shape == (n_b,)
    for a, b in zip(planned.layers, components.layers, strict=True):
        for cache in ("k_cache", "v_cache"):
            got, want = host(a.self_attn._state[cache]), host(b.self_attn._state[cache])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the CPU attention kernel's scratch
    assert ("decode_scores" in planned._state) is on_cpu
    if on_cpu:
        return
    last = planned._plans[2].positions.device  # the last step's positions, on the device
    assert isinstance(last, cupy.ndarray) and last.dtype == np.int32
    np.testing.assert_array_equal(host(last), [35 - 4, 35 - 1])
    if EMULATED:  # the emulated contexts record their launches
        launched = set(planned.execution_context.launches)
        decode_kernels = {"attention_decode<float>", "kv_cache_write<float>"}
        assert decode_kernels <= launched
        assert not decode_kernels & set(components.execution_context.launches)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_with_attention_biases_equals_forward(device: str, tmp_path, qk_norm: bool) -> None:  # type: ignore[no-untyped-def]
    """Biased QKV and output projections (Qwen2, Llama's attention_bias), and Q/K head norms
    (Qwen3): the decode plan (which binds biased layers through their ops' general forward and
    the norms on strided views of Q and K) and the components' own calls both give the logits
    of an uncached TRAINING forward."""
    import dataclasses

    cfg = dataclasses.replace(CFG, qkv_bias=True, out_bias=True, mlp_bias=True, qk_norm=qk_norm)
    rng = np.random.default_rng(11)
    x = tokens(2, 12, seed=12)
    reference = Llama("llama", cfg, device="CPU")
    reference.build(BuildContext(x.shape, RuntimeMode.TRAINING))
    move_optional_parameters(reference, rng)
    reference.save(tmp_path / "w.safetensors")
    full = reference.forward(x)
    models = [Llama("llama", cfg, device=device) for _ in range(2)]
    for model in models:
        model.build(BuildContext((2, 32), RuntimeMode.INFERENCE, prefill_size=4))
        model.load(tmp_path / "w.safetensors")
        last = host(model.prefill(x[:, :5]))
        np.testing.assert_allclose(last, full[:, 4], rtol=1e-5, atol=1e-5)
    planned, components = models
    for position in range(5, 12):
        got = host(planned.decode(x[:, position], position))
        want = components._decode_components(on(device, x[:, position, None]), position)
        # the GPU plan's decode kernels sum in other orders than the components' calls
        tol = 1e-6 if device == "CPU" else 1e-5
        np.testing.assert_allclose(got, host(want), rtol=tol, atol=tol)
        np.testing.assert_allclose(got, full[:, position], rtol=1e-5, atol=1e-5)


def test_decode_plan_serves_each_batch_size_and_refuses_bad_input(weights: str) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (2, 16), prefill=4)
    x = tokens(2, 8, seed=8)
    model.prefill(x[:, :6])
    one = model.decode(x[:1, 6], 6)  # B = 1 inside a B = 2 build: its own plan
    np.testing.assert_allclose(one[0], reference_logits(weights, x[:1, :7])[0, 6], atol=1e-5)
    caches = [b.self_attn._state["k_cache"].copy() for b in model.layers]
    with pytest.raises(ValueError, match="decode positions"):
        model.decode(x[:, 6], 16)
    with pytest.raises(ValueError, match="out of range"):
        model.decode(np.array([1, CFG.vocab_size]), 6)
    with pytest.raises(ValueError, match="decode positions"):
        model.decode(x[:, 6], -1)
    for bad in (True, 5.7, np.array([5.0, 6.0]), np.array([], dtype=np.int64), [1, 2, 3]):
        with pytest.raises(TypeError, match="decode positions must be an int or 2 ints"):
            model.decode(x[:, 6], bad)
    for bad_tokens in (x[:1, 5:7], x[:, 6, None, None], x[None, :, 6]):  # not one per sequence
        with pytest.raises(ValueError, match="one token per sequence"):
            model.decode(bad_tokens, 6)
    for block, cache in zip(model.layers, caches, strict=True):
        np.testing.assert_array_equal(block.self_attn._state["k_cache"], cache)
    both = model.decode(x[:, 6], 6)
    np.testing.assert_allclose(both, reference_logits(weights, x[:, :7])[:, 6], atol=1e-5)
    np.testing.assert_array_equal(model.decode(x[:, 6:7], 6), both)  # [B, 1] is [B]
    np.testing.assert_array_equal(model.decode(int(x[0, 6]), 6), one)  # a scalar is [1]


def _length_dependent(kind: str) -> dict[str, Any]:
    half = CFG.dim // CFG.n_heads // 2
    if kind == "dynamic":
        return {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 12}
    return {"rope_type": "longrope", "original_max_position_embeddings": 12, "factor": 4.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 2.0 * i for i in range(half)]}  # fmt: skip


@pytest.mark.parametrize("chunk", [4, 7])
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_chunked_prefill_under_length_dependent_rope_equals_one_pass(
    tmp_path: Any, kind: str, chunk: int
) -> None:
    """A length-dependent scaling picks its frequencies for the whole prompt's length: the
    early chunks of a prompt that crosses the original context (12) rotate as one pass does,
    not with the short factors (or none) their own end would pick."""
    cfg = dataclasses.replace(CFG, rope_scaling=_length_dependent(kind))
    trained = Llama("llama", cfg, device="CPU")
    trained.build(BuildContext((2, 30), RuntimeMode.TRAINING))
    path = tmp_path / "w.safetensors"
    trained.save(path)
    x = tokens(2, 30, seed=3)
    full = trained.forward(x).copy()
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((2, 48), RuntimeMode.INFERENCE, prefill_size=chunk))
    model.load(path)
    np.testing.assert_allclose(model.prefill(x), full[:, -1], rtol=1e-5, atol=1e-5)


def test_chunks_given_by_hand_with_the_prompt_end_match_prefill(tmp_path: Any) -> None:
    """Llama.forward on INFERENCE builds is one prefill chunk: given ``seq_len`` (the
    prompt's end) the chunks rotate as prefill does under a length-dependent scaling; a bad
    seq_len is refused before the cache is written."""
    cfg = dataclasses.replace(CFG, rope_scaling=_length_dependent("longrope"))
    trained = Llama("llama", cfg, device="CPU")
    trained.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    path = tmp_path / "w.safetensors"
    trained.save(path)
    x = tokens(2, 30, seed=5)
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((2, 48), RuntimeMode.INFERENCE))
    model.load(path)
    want = model.prefill(x)
    for start in range(0, 30, 10):
        logits = model.forward(x[:, start : start + 10], start, seq_len=30)
    np.testing.assert_allclose(logits[:, -1], want, rtol=1e-6, atol=1e-6)
    lengths = model.cached_lengths
    for bad in (5, 49, 30.0):
        with pytest.raises((ValueError, TypeError), match="seq_len"):
            model.forward(x[:, :10], 30, seq_len=bad)
        with pytest.raises((ValueError, TypeError), match="seq_len"):
            model.layers[0].forward(np.zeros((2, 10, CFG.dim), np.float32), 30, seq_len=bad)
    assert model.cached_lengths == lengths
    with pytest.raises(ValueError, match="INFERENCE prefill chunks"):
        trained.forward(x[:1, :8], seq_len=8)
