"""Multimodal RoPE (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V): positions ``[3, B, T]``.

Against the float64 reference (whose axis assignment is written from the models' own
``recomposition_frequencies``), against Hugging Face transformers' rotary modules where torch and
transformers are installed, on both CPU paths and every storage precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rope_helpers import (
    BACKEND_PARAMS,
    FP32,
    PRECISIONS,
    TRAINING,
    assert_close,
    make_rope,
    random_qk,
    reference,
    rope_config,
)
from rope_reference import mrope_frequency_positions

from mila_py import Precision
from mila_py.components import RopeConfig
from mila_py.interop.hf_rope import rope_config_from_hf

#: (head_dim, rotary_dim, section, interleaved, layout): Qwen2-VL-like, Qwen3-VL-like,
#: GLM-4V-like (interleaved pairs, half the head rotated), and sections with an empty axis
CASES = {
    "qwen2vl": (16, 0, (2, 3, 3), False, "half"),
    "qwen3vl": (16, 0, (4, 2, 2), True, "half"),
    "glm4v": (16, 8, (2, 1, 1), False, "interleaved"),
    "no-height": (12, 0, (4, 0, 2), False, "half"),
    "interleaved-odd": (18, 0, (5, 2, 2), True, "half"),
}


def mrope_config(case: str, heads: tuple[int, int] = (3, 1), **kwargs: Any) -> RopeConfig:
    head_dim, rotary_dim, section, interleaved, layout = CASES[case]
    return rope_config(
        heads,
        head_dim,
        rotary_dim=rotary_dim,
        layout=layout,
        mrope_section=section,
        mrope_interleaved=interleaved,
        **kwargs,
    )


def axis_positions(rng: np.random.Generator, n_b: int, n_t: int, high: int = 1500) -> np.ndarray:
    """``[3, B, T]`` with every axis different (the temporal one increasing, as in a video)."""
    temporal = np.sort(rng.integers(0, high, size=(n_b, n_t)), axis=1)
    return np.stack(
        [temporal, rng.integers(0, high, (n_b, n_t)), rng.integers(0, high, (n_b, n_t))]
    )


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


# ---------------------------------------------------------------------------------- config


def test_axes_of_each_frequency_follow_the_models() -> None:
    contiguous = RopeConfig(
        channels=16, n_heads=1, n_kv_heads=1, max_seq_len=8, mrope_section=(2, 3, 3)
    )
    assert contiguous.mrope_axes() == (0, 0, 1, 1, 1, 2, 2, 2)
    inter = RopeConfig(
        channels=24, n_heads=1, n_kv_heads=1, max_seq_len=8, mrope_section=(6, 3, 3),
        mrope_interleaved=True,
    )  # fmt: skip
    assert inter.mrope_axes() == (0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 0)
    for case in CASES:
        cfg = mrope_config(case)
        axes = np.array(cfg.mrope_axes())
        # the reference's assignment: positions equal to the axis index give the axis back
        chosen = mrope_frequency_positions(
            np.arange(3).reshape(3, 1, 1), cfg.mrope_section, cfg.mrope_interleaved, 1, 1
        )
        np.testing.assert_array_equal(chosen[0, 0], axes)
        assert [int((axes == a).sum()) for a in range(3)] == list(cfg.mrope_section)


def test_hf_scaling_keys_move_to_the_fields() -> None:
    base = {"channels": 32, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 64}
    legacy = RopeConfig(**base, scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    assert legacy.mrope_section == (2, 3, 3) and not legacy.mrope_interleaved
    assert legacy.rope_type == "default" and "mrope_section" not in legacy.scaling
    qwen3 = RopeConfig(
        **base,
        scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    )
    assert qwen3.mrope_section == (4, 2, 2) and qwen3.mrope_interleaved
    assert qwen3 == RopeConfig(**base, mrope_section=(4, 2, 2), mrope_interleaved=True,
                               scaling={"rope_type": "default"})  # fmt: skip
    with_yarn = RopeConfig(
        **base,
        scaling={"rope_type": "yarn", "factor": 2.0, "mrope_section": [2, 3, 3]},
    )
    assert with_yarn.rope_type == "yarn" and with_yarn.mrope_section == (2, 3, 3)
    with pytest.raises(ValueError, match="give it once"):
        RopeConfig(**base, mrope_section=(4, 2, 2), scaling={"mrope_section": [2, 3, 3]})


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"mrope_section": (2, 3)}, ValueError, "three ints"),
        ({"mrope_section": (2, 3, 3, 0)}, ValueError, "three ints"),
        ({"mrope_section": (4, 5, -1)}, ValueError, "three ints"),
        ({"mrope_section": (2.0, 3, 3)}, ValueError, "three ints"),
        ({"mrope_section": (2, 3, 4)}, ValueError, "sum to the 8 rotated"),
        ({"mrope_section": (1, 1, 2), "rotary_dim": 6}, ValueError, "sum to the 3 rotated"),
        ({"mrope_section": 8}, TypeError, "three ints"),
        ({"mrope_section": "233"}, TypeError, "three ints"),
        ({"mrope_interleaved": True}, ValueError, "needs an mrope_section"),
        ({"mrope_section": (2, 3, 3), "mrope_interleaved": 1}, TypeError, "bool"),
        ({"mrope_section": (0, 4, 4), "mrope_interleaved": True}, ValueError, "does not fit"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        RopeConfig(channels=32, n_heads=2, n_kv_heads=1, max_seq_len=64, **kwargs)


def test_numpy_values_are_taken() -> None:
    base = {"channels": 32, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 64}
    cfg = RopeConfig(
        **base, mrope_section=np.array([4, 2, 2]), mrope_interleaved=np.True_,
        scaling={"mrope_section": [4, 2, 2]},
    )  # fmt: skip
    assert cfg.mrope_section == (4, 2, 2) and cfg.mrope_interleaved is True


def _vlm(model_type: str, **rope: Any) -> dict[str, Any]:
    """A VLM config.json with its text model in ``text_config``, as transformers 5 writes it."""
    text = {
        "model_type": f"{model_type}_text", "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope},
    }  # fmt: skip
    return {"model_type": model_type, "text_config": text, "vision_config": {"depth": 2}}


@pytest.mark.parametrize(
    ("model_type", "rope", "interleaved", "layout"),
    [
        ("qwen2_vl", {"type": "mrope", "mrope_section": [4, 6, 6]}, False, "half"),
        ("qwen2_5_vl", {"mrope_section": [4, 6, 6], "mrope_interleaved": True}, False, "half"),
        ("qwen3_vl", {"mrope_section": [6, 5, 5]}, True, "half"),
        ("qwen3_vl_moe", {"mrope_section": [6, 5, 5], "mrope_interleaved": True}, True, "half"),
        ("qwen3_omni_moe", {"mrope_section": [6, 5, 5], "interleaved": True}, True, "half"),
        ("glm4v", {"mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}, False,
         "interleaved"),
        ("glm4v_moe", {"mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}, False, "half"),
    ],
)  # fmt: skip
def test_from_hf_reads_vision_language_configs(model_type, rope, interleaved, layout) -> None:
    cfg = rope_config_from_hf(_vlm(model_type, **rope))
    section = tuple(rope["mrope_section"])
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.layout) == (section, interleaved, layout)
    assert cfg.n_heads == 4 and cfg.head_dim == 32 and cfg.rope_type == "default"
    # an explicit layout wins
    assert rope_config_from_hf(_vlm(model_type, **rope), layout="half").layout == "half"


@pytest.mark.parametrize(
    ("model_type", "section", "interleaved"),
    [("qwen2_vl", (16, 24, 24), False), ("qwen3_vl", (24, 20, 20), True),
     ("glm4v", (8, 12, 12), False)],
)  # fmt: skip
def test_from_hf_takes_the_models_default_section(model_type, section, interleaved) -> None:
    # every default fits a head of 128 (GLM-4V rotates half of it)
    rotary = {"partial_rotary_factor": 0.5} if model_type == "glm4v" else {}
    config = _vlm(model_type, **rotary)
    config["text_config"].update(head_dim=128, hidden_size=4 * 128)
    cfg = rope_config_from_hf(config)
    assert (cfg.mrope_section, cfg.mrope_interleaved) == (section, interleaved)
    # a head the default does not fit: refused, as the model's code would fail
    with pytest.raises(ValueError, match="must sum to the 8 rotated"):
        rope_config_from_hf(_vlm(model_type, partial_rotary_factor=0.5))


@pytest.mark.parametrize(
    ("model_type", "pattern"),
    [("ernie4_5_vl_moe", "reordered frequencies"), ("hunyuan_vl", "xD-RoPE")],
)
def test_from_hf_refuses_what_it_cannot_express(model_type: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        rope_config_from_hf(_vlm(model_type, mrope_section=[22, 22, 20]))


def test_a_type_with_other_frequency_counts_is_refused_at_build() -> None:
    # "proportional" pairs span the whole head: 8 frequencies, while the section covers 3 (6 of 16)
    cfg = RopeConfig(
        channels=16, n_heads=1, n_kv_heads=1, max_seq_len=8, rotary_dim=6,
        scaling={"rope_type": "proportional"}, mrope_section=(1, 1, 1),
    )  # fmt: skip
    with pytest.raises(ValueError, match="gives 8"):
        make_rope(cfg, 1, 4)


# ---------------------------------------------------------------------------------- values


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_rotate_matches_reference(backend: str, case: str, precision: Precision, rng) -> None:
    cfg = mrope_config(case, heads=(4, 2))
    rope = make_rope(cfg, 2, 9, mode=TRAINING, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, 2, 9, precision)
    positions = axis_positions(rng, 2, 9)
    ref_q, ref_k = reference(cfg, q, k, positions)
    rope.rotate(q, k, positions)
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)
    # backward with the same positions is the inverse rotation
    back_q, back_k = reference(cfg, q, k, positions, inverse=True)
    dq_in, dk_in = rope.backward(q, k, positions)
    assert_close(dq_in, back_q, precision)
    assert_close(dk_in, back_k, precision)


def test_axes_matter_and_broadcast(backend: str, rng) -> None:
    cfg = mrope_config("qwen2vl")
    rope = make_rope(cfg, 2, 5, backend=backend)
    q, k = random_qk(rng, cfg, 2, 5)
    temporal = np.arange(5)[None, :]
    grid = np.stack([temporal, temporal + 3, 2 * temporal])[:, None, :, :].reshape(3, 1, 5)
    q1, k1 = q.copy(), k.copy()
    rope.rotate(q1, k1, grid)  # [3, 1, T]: every sequence the same
    ref_q, ref_k = reference(cfg, q, k, np.broadcast_to(grid, (3, 2, 5)))
    assert_close(q1, ref_q, FP32)
    assert_close(k1, ref_k, FP32)
    # changing only the height axis changes only the height frequencies
    q2, k2 = q.copy(), k.copy()
    rope.rotate(q2, k2, grid + np.array([0, 1, 0]).reshape(3, 1, 1))
    head = (q2 - q1).reshape(2, 5, 3, 16)
    moved = np.flatnonzero(np.abs(head).max(axis=(0, 1, 2)) > 0)
    height = [i for i, a in enumerate(cfg.mrope_axes()) if a == 1]
    assert sorted(set(moved % 8)) == height  # both halves of each height pair


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("case", ["qwen2vl", "qwen3vl", "glm4v"])
def test_text_positions_are_plain_rope(backend: str, case: str, precision: Precision, rng) -> None:
    """Positions equal on every axis, or given without the axis, rotate as a plain RoPE does."""
    cfg = mrope_config(case)
    plain = RopeConfig(
        channels=cfg.channels, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        max_seq_len=cfg.max_seq_len, rotary_dim=cfg.rotary_dim, layout=cfg.layout,
    )  # fmt: skip
    rope = make_rope(cfg, 2, 6, precision=precision, backend=backend)
    other = make_rope(plain, 2, 6, precision=precision, backend=backend, name="plain")
    q, k = random_qk(rng, cfg, 2, 6, precision)
    positions = rng.integers(0, 2000, size=(2, 6))
    results = []
    for rotate, pos in (
        (rope.rotate, np.stack([positions] * 3)),
        (rope.rotate, positions),
        (other.rotate, positions),
    ):
        qc, kc = q.copy(), k.copy()
        rotate(qc, kc, pos)
        results.append((qc, kc))
    for qc, kc in results[1:]:
        np.testing.assert_array_equal(qc, results[0][0])
        np.testing.assert_array_equal(kc, results[0][1])
    # forward / prefill / decode of an M-RoPE config are the plain rotation
    qc, kc = q.copy(), k.copy()
    rope.prefill(qc, kc, 40)
    qd, kd = q.copy(), k.copy()
    other.prefill(qd, kd, 40)
    np.testing.assert_array_equal(qc, qd)
    np.testing.assert_array_equal(kc, kd)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_decode_takes_a_position_per_axis_and_sequence(backend: str, precision, rng) -> None:
    cfg = mrope_config("qwen3vl")
    rope = make_rope(cfg, 3, 4, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, 3, 1, precision)
    positions = rng.integers(0, 2000, size=(3, 3))  # [axis, sequence]
    ref_q, ref_k = reference(cfg, q, k, positions[:, :, None])
    rope.decode(q, k, positions)
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5],
            "original_max_position_embeddings": 256,
        },
    ],
    ids=lambda s: s["rope_type"],
)
@pytest.mark.parametrize("high", [200, 1500], ids=["short", "long"])
def test_scaling_types_with_axes(backend: str, scaling, high: int, rng) -> None:
    """Length-dependent types take ``seq_len`` from the largest position on any axis."""
    cfg = mrope_config("qwen2vl", scaling=scaling)
    rope = make_rope(cfg, 2, 7, backend=backend)
    q, k = random_qk(rng, cfg, 2, 7)
    positions = axis_positions(rng, 2, 7, high)
    ref_q, ref_k = reference(cfg, q, k, positions)
    rope.rotate(q, k, positions)
    assert_close(q, ref_q, FP32)
    assert_close(k, ref_k, FP32)


def test_large_calls_run_in_parallel_blocks(backend: str, rng) -> None:
    cfg = mrope_config("qwen3vl", heads=(16, 16), max_seq_len=4096)
    n_t = 4096  # Q + K above the op's parallel threshold
    rope = make_rope(cfg, 1, n_t, backend=backend)
    q, k = random_qk(rng, cfg, 1, n_t)
    positions = axis_positions(rng, 1, n_t, 4096)
    ref_q, ref_k = reference(cfg, q, k, positions)
    rope.rotate(q, k, positions)
    assert_close(q, ref_q, FP32)
    assert_close(k, ref_k, FP32)


@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from(["qwen2vl", "qwen3vl", "glm4v"]),
    seed=st.integers(0, 2**32 - 1),
    query=st.lists(st.integers(0, 999), min_size=3, max_size=3),
    key=st.lists(st.integers(0, 999), min_size=3, max_size=3),
    shift=st.lists(st.integers(0, 999), min_size=3, max_size=3),
)
def test_property_scores_depend_only_on_relative_positions_per_axis(
    case: str, seed: int, query: list[int], key: list[int], shift: list[int]
) -> None:
    """``<R_p q, R_r k>`` per head is unchanged when every axis of ``p`` and ``r`` moves by the
    same amount (its own amount per axis)."""
    cfg = mrope_config(case, heads=(2, 1))
    rope = make_rope(cfg, 1, 2)
    rng = np.random.default_rng(seed)
    q, k = random_qk(rng, cfg, 1, 1)
    d = cfg.head_dim

    def scores(pos_q: np.ndarray, pos_k: np.ndarray) -> np.ndarray:
        x = np.concatenate([q, q], axis=1)  # token 0 rotated at pos_q ...
        y = np.concatenate([k, k], axis=1)  # ... token 1 at pos_k
        rope.rotate(x, y, np.stack([pos_q, pos_k], axis=-1).reshape(3, 1, 2))
        return np.asarray(x[0, 0], np.float64).reshape(2, d) @ np.asarray(y[0, 1], np.float64)

    p, r, s = np.array(query), np.array(key), np.array(shift)
    np.testing.assert_allclose(scores(p + s, r + s), scores(p, r), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("case", "make_positions", "error", "pattern"),
    [
        (None, lambda: np.zeros((3, 2, 4), np.int64), ValueError, "need a RopeConfig with mrope"),
        (
            "qwen2vl",
            lambda: np.zeros((2, 2, 4), np.int64),
            ValueError,
            r"or \(M-RoPE\) \[3, 2, 4\]",
        ),
        ("qwen2vl", lambda: np.zeros((3, 3, 4), np.int64), ValueError, "does not broadcast"),
        ("qwen2vl", lambda: np.full((3, 2, 4), 2048), ValueError, "beyond the table"),
        ("qwen2vl", lambda: np.full((3, 2, 4), -1), ValueError, ">= 0"),
        ("qwen2vl", lambda: np.zeros((3, 2, 4), np.float32), TypeError, "integers"),
    ],
)
def test_bad_positions_raise_and_change_nothing(
    backend: str, case: str | None, make_positions, error, pattern: str, rng
) -> None:
    cfg = rope_config((3, 1), 16) if case is None else mrope_config(case)
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend)
    q, k = random_qk(rng, cfg, 2, 4)
    q0, k0 = q.copy(), k.copy()
    for call in (rope.rotate, rope.backward):
        with pytest.raises(error, match=pattern):
            call(q, k, make_positions())
        np.testing.assert_array_equal(q, q0)
        np.testing.assert_array_equal(k, k0)


def test_repr_names_the_sections() -> None:
    assert "mrope=[2, 3, 3]" in repr(make_rope(mrope_config("qwen2vl"), 1, 2))


# ---------------------------------------------------------------------------------- HF parity

HF_MODELS = {
    # model_type: (module, config class, rotary class, apply function, head_dim, section, extra)
    "qwen2_vl": ("qwen2_vl", "Qwen2VLTextConfig", "Qwen2VLRotaryEmbedding", 32, [4, 6, 6], {}),
    "qwen3_vl": (
        "qwen3_vl", "Qwen3VLTextConfig", "Qwen3VLTextRotaryEmbedding", 32, [6, 5, 5],
        {"mrope_interleaved": True},
    ),
    # the model's code interleaves whether or not the flag is there
    "qwen3_vl-no-flag": (
        "qwen3_vl", "Qwen3VLTextConfig", "Qwen3VLTextRotaryEmbedding", 32, [6, 5, 5], {},
    ),
    "qwen2_5_vl": (
        "qwen2_5_vl", "Qwen2_5_VLTextConfig", "Qwen2_5_VLRotaryEmbedding", 32, [4, 6, 6], {},
    ),
    "glm4v": (
        "glm4v", "Glm4vTextConfig", "Glm4vTextRotaryEmbedding", 32, [2, 3, 3],
        {"partial_rotary_factor": 0.5},
    ),
}  # fmt: skip


@pytest.mark.parametrize("model", list(HF_MODELS))
def test_matches_hugging_face(model: str, backend: str, rng) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib

    name, config_cls, rotary_cls, head_dim, section, extra = HF_MODELS[model]
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    configuration = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
    hq, hk = 4, 2
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    rope_parameters.update({k: v for k, v in extra.items() if k != "partial_rotary_factor"})
    if "partial_rotary_factor" in extra:
        rope_parameters["partial_rotary_factor"] = extra["partial_rotary_factor"]
    hf_config = getattr(configuration, config_cls)(
        hidden_size=hq * head_dim, num_attention_heads=hq, num_key_value_heads=hk,
        head_dim=head_dim, max_position_embeddings=512, rope_parameters=rope_parameters,
    )  # fmt: skip
    rotary = getattr(modeling, rotary_cls)(hf_config)
    cfg = rope_config_from_hf(hf_config.to_dict())  # layout and axes from the model_type
    assert cfg.mrope_section == tuple(section)
    assert cfg.layout == ("interleaved" if model == "glm4v" else "half")
    assert cfg.mrope_interleaved == model.startswith("qwen3")
    n_b, n_t = 2, 6
    positions = axis_positions(rng, n_b, n_t, 500)
    q, k = random_qk(rng, cfg, n_b, n_t)
    x = torch.zeros(1, dtype=torch.float64)
    cos, sin = rotary(x, torch.tensor(positions))
    qt = torch.tensor(q, dtype=torch.float64).view(n_b, n_t, hq, head_dim).transpose(1, 2)
    kt = torch.tensor(k, dtype=torch.float64).view(n_b, n_t, hk, head_dim).transpose(1, 2)
    hq_out, hk_out = modeling.apply_rotary_pos_emb(qt, kt, cos.double(), sin.double())
    rope = make_rope(cfg, n_b, n_t, backend=backend)
    rope.rotate(q, k, positions)
    # HF forms its angles in float32: at positions ~500 they are off by ~1e-5
    expected_q = hq_out.transpose(1, 2).reshape(n_b, n_t, -1).numpy()
    expected_k = hk_out.transpose(1, 2).reshape(n_b, n_t, -1).numpy()
    np.testing.assert_allclose(q, expected_q, atol=1e-4)
    np.testing.assert_allclose(k, expected_k, atol=1e-4)
