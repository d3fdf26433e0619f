"""Text in, text out: from_pretrained's tokenizer and generation defaults, complete / chat /
stream_text with stop strings and token counts, and prompts in waves of the batch size.

The references are independent of mila_py.models.text: the token ids of ``Llama.generate``
(without EOS stopping), cut by hand at the first stop id, decoded with the tokenizer's
``decode`` and cut at the first stop string with ``str.find``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from text_helpers import EOS, make_model_folder

from mila_py.interop import GenerationDefaults
from mila_py.models import Llama, LlamaConfig
from mila_py.models.text import StopStrings


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("text") / "tiny")


@pytest.fixture(scope="module")
def model(folder: Path) -> Llama:
    return Llama.from_pretrained(folder)


def reference(
    model: Llama, ids: list[int], new: int, stop_ids: tuple[int, ...] = (), **sampling: Any
) -> tuple[str, list[int]]:
    """The text ``complete`` should give for prompt ids ``ids``: up to ``new`` tokens, cut
    before the first of ``stop_ids`` (and the EOS), decoded without special tokens; and the
    generated ids, stop id included."""
    out = model.generate(ids, max_new_tokens=new, eos_token_id=None, **sampling)
    generated = [int(t) for t in out[len(ids) :]]
    stops = {*stop_ids, model.tokenizer.token_to_id(EOS)}
    end = next((i for i, t in enumerate(generated) if t in stops), None)
    kept = generated if end is None else generated[:end]
    kept_all = generated if end is None else generated[: end + 1]
    return model.tokenizer.decode(kept, skip_special_tokens=True), kept_all


# ----------------------------------------------------------------------- from_pretrained
def test_from_pretrained_loads_the_tokenizer_and_the_generation_defaults(
    folder: Path, model: Llama, tmp_path: Path
) -> None:
    eos = model.tokenizer.token_to_id(EOS)
    assert model.tokenizer.encode("Hello") == model.tokenizer.encode("Hello")
    assert model.tokenizer.chat_template is not None
    assert model.generation_defaults.eos_token_ids == (eos,)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    plain = Llama.from_pretrained(bare)
    assert plain.tokenizer is None
    assert plain.generation_defaults.eos_token_ids == ()  # config.json names no EOS here


def test_a_broken_tokenizer_file_is_refused_before_any_weight_is_read(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mila_py.interop import hf

    def never(*args: Any) -> None:
        raise AssertionError("weights read")

    monkeypatch.setattr(hf, "load_hf_files", never)
    for name, text in (("tokenizer.json", "{"), ("generation_config.json", '{"top_p": 2}')):
        broken = tmp_path / name
        broken.mkdir()
        for other in ("config.json", "model.safetensors", "tokenizer.json"):
            (broken / other).write_bytes((folder / other).read_bytes())
        (broken / name).write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=name):
            Llama.from_pretrained(broken)


def test_generate_and_stream_take_the_generation_defaults_unless_given(model: Llama) -> None:
    ids = model.tokenizer.encode("The quick brown")
    free = model.generate(ids, max_new_tokens=12, eos_token_id=None)
    stop = int(free[len(ids) + 3])  # a token greedy decoding emits
    first = next(i for i, t in enumerate(free[len(ids) :]) if t == stop)
    saved = model.generation_defaults
    try:
        model.generation_defaults = GenerationDefaults(eos_token_ids=(stop,), pad_token_id=5)
        stopped = model.generate(ids, max_new_tokens=12)
        assert stopped.tolist() == free[: len(ids) + first + 1].tolist()
        streamed = [int(t[0]) for t in model.stream(ids, max_new_tokens=12)]
        assert streamed == stopped[len(ids) :].tolist()
        assert model.generate(ids, max_new_tokens=12, eos_token_id=None).tolist() == free.tolist()
        # a checkpoint that samples: its temperature and top-k, unless the caller passes them
        model.generation_defaults = GenerationDefaults(do_sample=True, temperature=0.7, top_k=3)
        sampled = model.generate(ids, max_new_tokens=12, seed=4)
        same = model.generate(ids, max_new_tokens=12, seed=4, temperature=0.7, top_k=3)
        assert sampled.tolist() == same.tolist()
        assert model.generate(ids, max_new_tokens=12, temperature=0).tolist() == free.tolist()
    finally:
        model.generation_defaults = saved
    # without defaults: greedy, no EOS
    model.generation_defaults = None
    try:
        assert model.generate(ids, max_new_tokens=12).tolist() == free.tolist()
    finally:
        model.generation_defaults = saved


# ----------------------------------------------------------------------- complete / chat
def test_complete_returns_the_new_text_and_how_it_ended(model: Llama) -> None:
    prompt = "Hello world"
    ids = model.tokenizer.encode(prompt)
    want, generated = reference(model, ids, 30)
    assert model.complete(prompt, max_new_tokens=30) == want
    (done,) = model.complete_detailed(prompt, max_new_tokens=30)
    assert done.text == want and done.prompt_tokens == len(ids)
    assert done.completion_tokens == len(generated)
    assert done.finish_reason == ("length" if len(generated) == 30 else "stop")
    assert done.total_tokens == len(ids) + len(generated)


def test_a_stop_token_ends_the_text_without_its_own_text(model: Llama) -> None:
    ids = model.tokenizer.encode("The quick brown")
    _, generated = reference(model, ids, 30)
    at = 6
    stop = generated[at]
    want, kept = reference(model, ids, 30, stop_ids=(stop,))
    (done,) = model.complete_detailed("The quick brown", max_new_tokens=30, stop_token_ids=[stop])
    assert done.text == want and done.finish_reason == "stop"
    assert done.completion_tokens == len(kept) == generated.index(stop) + 1


def test_a_stop_string_cuts_the_text_before_it(model: Llama) -> None:
    prompt = "Numbers 12345"
    full = model.complete(prompt, max_new_tokens=40)
    assert isinstance(full, str) and len(full) > 12
    stop = full[8:11]
    want = full[: full.find(stop)]
    (done,) = model.complete_detailed(prompt, max_new_tokens=40, stop=[stop, "never seen"])
    assert done.text == want and done.finish_reason == "stop"
    assert model.complete(prompt, max_new_tokens=40, stop=stop) == want
    assert done.completion_tokens < 40


def test_chat_renders_the_template_and_returns_the_reply(model: Llama) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert model.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    want, generated = reference(model, ids, 25)
    assert model.chat(messages, max_new_tokens=25) == want
    done = model.chat_detailed(messages, max_new_tokens=25)
    assert done.prompt_tokens == len(ids) and done.completion_tokens == len(generated)


def test_sampling_follows_the_seed(model: Llama) -> None:
    ids = model.tokenizer.encode("It's a lovely day")
    want, _ = reference(model, ids, 20, temperature=1.0, seed=11)
    got = model.complete("It's a lovely day", max_new_tokens=20, temperature=1.0, seed=11)
    assert got == want
    greedy, _ = reference(model, ids, 20)
    assert got != greedy  # (the seed is one whose draw differs from greedy)


def test_more_prompts_than_the_batch_run_in_waves_in_order(folder: Path, model: Llama) -> None:
    prompts = ["Hello world", "The quick brown fox", "你好", "emoji 😀", "Numbers 3.14159"]
    alone = [model.complete(p, max_new_tokens=15) for p in prompts]
    assert len(set(alone)) == len(prompts)
    pair = Llama.from_pretrained(folder, batch_size=2)
    assert pair.complete(prompts, max_new_tokens=15) == alone
    details = pair.complete_detailed(prompts, max_new_tokens=15)
    assert [d.prompt_tokens for d in details] == [len(model.tokenizer.encode(p)) for p in prompts]
    # sampled waves: the first draws as a call with its prompts alone, a later one differently
    sampled = pair.complete(prompts[:2] * 2, max_new_tokens=15, temperature=1.0, seed=2)
    assert sampled[:2] == pair.complete(prompts[:2], max_new_tokens=15, temperature=1.0, seed=2)
    assert len(sampled) == 4 and sampled[2:] != sampled[:2]


# ----------------------------------------------------------------------- stream_text
def test_stream_text_pieces_join_to_the_completion(model: Llama) -> None:
    with model.stream_text("emoji 😀 🎉", max_new_tokens=30) as stream:
        assert stream.finish_reason is None
        pieces = list(stream)
    assert all(pieces) and "".join(pieces) == model.complete("emoji 😀 🎉", max_new_tokens=30)
    assert stream.finish_reason in ("stop", "length")
    assert stream.completion == model.complete_detailed("emoji 😀 🎉", max_new_tokens=30)[0]
    messages = [{"role": "user", "content": "Hi"}]
    assert "".join(model.stream_text(messages, max_new_tokens=20)) == model.chat(
        messages, max_new_tokens=20
    )


def test_stream_text_finds_a_stop_string_across_pieces(model: Llama) -> None:
    prompt = "Hello world, this"
    pieces = list(model.stream_text(prompt, max_new_tokens=40))
    full = "".join(pieces)
    # a stop string made of the end of one piece and the start of the next, first seen there
    k = next(
        i
        for i in range(1, len(pieces))
        if full.find(pieces[i - 1][-1] + pieces[i][0]) == len("".join(pieces[:i])) - 1
    )
    stop = pieces[k - 1][-1] + pieces[k][0]
    stream = model.stream_text(prompt, max_new_tokens=40, stop=stop)
    got = list(stream)
    assert "".join(got) == full[: full.find(stop)] and stream.finish_reason == "stop"
    assert len(got) <= k  # the piece that ends in the stop string's start was held back


def test_closing_a_stream_early_frees_the_model(model: Llama) -> None:
    stream = model.stream_text("Hello world", max_new_tokens=40)
    next(stream)
    assert model.run_lock.locked
    stream.close()
    assert not model.run_lock.locked and stream.finish_reason is None
    ran: list[str] = []
    worker = threading.Thread(target=lambda: ran.append(model.complete("Hi", max_new_tokens=3)))
    worker.start()
    worker.join(timeout=60)
    assert ran and isinstance(ran[0], str)


def test_stop_strings_hold_back_only_what_may_start_one() -> None:
    stops = StopStrings(["</s>", "END"])
    assert [stops.push(p) for p in ["ab", "c<", "/", "x", "E", "N"]] == [
        "ab",
        "c",
        "",
        "</x",
        "",
        "",
    ]
    assert stops.flush() == "EN" and not stops.stopped
    stops = StopStrings(["</s>"])
    assert [stops.push(p) for p in ["a<", "/s", ">b", "c"]] == ["a", "", "", ""]
    assert stops.stopped and stops.flush() == ""
    assert StopStrings().push("any<") == "any<"
    # the earliest of two stop strings wins
    assert StopStrings(["cd", "b"]).push("abcd") == "a"


# ----------------------------------------------------------------------- errors
def test_a_model_without_a_tokenizer_says_how_to_get_one() -> None:
    from mila_py import BuildContext, RuntimeMode

    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      hidden_dim=32, max_seq_len=16)  # fmt: skip
    bare = Llama("llama", cfg)
    bare.build(BuildContext((1, 16), RuntimeMode.INFERENCE, initialize_parameters=True))
    with pytest.raises(RuntimeError, match=r"tokenizer\.json.*Tokenizer\.from_pretrained"):
        bare.complete("hi")
    with pytest.raises(RuntimeError, match="tokenizer"):
        bare.stream_text([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(
    model: Llama, kwargs: dict[str, Any], message: str
) -> None:
    writes = model._cache_writes
    with pytest.raises(ValueError, match=message):
        model.complete("Hello", **kwargs)
    with pytest.raises(ValueError, match=message):
        model.stream_text("Hello", **kwargs)
    assert model._cache_writes == writes and not model.run_lock.locked


def test_a_prompt_longer_than_the_context_is_refused(model: Llama) -> None:
    long = "Hello world " * model.context_length
    with pytest.raises(ValueError, match=r"tokens; the model's context holds 1 to"):
        model.complete(["Hi", long])
    assert model.complete("Hi", max_new_tokens=2) is not None


def test_processor_arguments_are_passed_on_only_when_set(
    model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, Any]] = []
    real = model.stream

    def stream(prompt: Any, **kwargs: Any) -> Any:
        seen.append(dict(kwargs))
        kwargs.pop("presence_penalty", None)
        return real(prompt, **kwargs)

    monkeypatch.setattr(model, "stream", stream)
    model.complete("Hello", max_new_tokens=2, presence_penalty=None)
    model.complete("Hello", max_new_tokens=2, presence_penalty=0.5)
    assert "presence_penalty" not in seen[0] and seen[1]["presence_penalty"] == 0.5
    assert "temperature" not in seen[0]  # left to the model's defaults


def test_a_long_generation_is_cut_to_the_context_without_a_warning(model: Llama) -> None:
    ids = model.tokenizer.encode("Hello")
    with_room = model.context_length - len(ids) + 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        done = model.complete_detailed("Hello", max_new_tokens=10_000)[0]
    assert done.completion_tokens <= with_room
    if done.finish_reason == "length":
        assert done.completion_tokens == with_room
