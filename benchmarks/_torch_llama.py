"""The benchmarks' PyTorch baseline: the same Llama as ``mila_py.models.Llama``, written in
PyTorch eager, and one training step of it (forward + cross-entropy + backward + AdamW).

Shared by ``train_step.py`` (CPU) and ``train_step_cuda.py`` (GPU). Attention is
``F.scaled_dot_product_attention`` (causal) on the K/V heads repeated for GQA; RoPE is the
half-split rotation over precomputed cos/sin rows, as in Hugging Face's Llama (rows cast to
the activations' dtype, as its rotary embedding does).

Mixed precision is torch's own recipe: FP32 parameters (the master weights), the forward under
``torch.autocast`` in BF16 or FP16, ``torch.optim.AdamW`` (torch's default implementation) on
the FP32 parameters, and for FP16 a ``torch.amp.GradScaler``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mila_py.models import LlamaConfig


def torch_train_step(
    cfg: LlamaConfig,
    tokens: np.ndarray,
    targets: np.ndarray,
    device: str = "cpu",
    precision: str = "fp32",
    weights: Mapping[str, np.ndarray] | None = None,
) -> Callable[[], float]:
    """A closure running one training step of ``cfg`` on ``tokens``/``targets`` [B, T] and
    returning its loss (a Python float).

    Args:
        precision: ``"fp32"``; ``"bf16"`` or ``"fp16"``: FP32 parameters with the forward under
            ``torch.autocast`` in that dtype (FP16 with a ``torch.amp.GradScaler``; the
            closure's ``loss_scale()`` reads its scale, 1.0 without one).
        weights: the initial weights, ``mila_py.models.Llama``'s parameter names to arrays
            (as its ``named_parameters()``; any float dtype, copied as FP32), so both
            libraries start from the same point; None: torch's own random initialization.

    On a CUDA device TF32 is switched off, so the fp32 GEMMs are fp32 like mila_py's.
    """
    import torch
    import torch.nn.functional as F

    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:
        raise ValueError(
            f"torch_train_step: precision must be one of {sorted(dtypes)}, got {precision!r}"
        )
    autocast_dtype = dtypes[precision]

    torch.manual_seed(0)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    d, hq, hk = cfg.dim, cfg.n_heads, cfg.n_kv_heads
    hd = d // hq
    n_t = tokens.shape[1]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1 = torch.nn.RMSNorm(d, eps=cfg.norm_eps)
            self.n2 = torch.nn.RMSNorm(d, eps=cfg.norm_eps)
            self.qkv = torch.nn.Linear(d, (hq + 2 * hk) * hd, bias=False)
            self.o = torch.nn.Linear(hq * hd, d, bias=False)
            self.gate = torch.nn.Linear(d, cfg.hidden_dim, bias=False)
            self.up = torch.nn.Linear(d, cfg.hidden_dim, bias=False)
            self.down = torch.nn.Linear(cfg.hidden_dim, d, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([hq * hd, hk * hd, hk * hd], dim=-1)
            q = q.view(b, t, hq, hd).transpose(1, 2)
            k = k.view(b, t, hk, hd).transpose(1, 2)
            v = v.view(b, t, hk, hd).transpose(1, 2)

            c, s = cos.to(q.dtype), sin.to(q.dtype)  # no-ops in fp32

            def rot(x: torch.Tensor) -> torch.Tensor:
                x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
                return x * c + torch.cat((-x2, x1), dim=-1) * s

            q, k = rot(q), rot(k)
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.o(a.transpose(1, 2).reshape(b, t, hq * hd))
            m = self.n2(h)
            return h + self.down(F.silu(self.gate(m)) * self.up(m))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(cfg.vocab_size, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(cfg.n_layers))
            self.norm = torch.nn.RMSNorm(d, eps=cfg.norm_eps)
            self.head = torch.nn.Linear(d, cfg.vocab_size, bias=False)
            inv = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(n_t).float(), inv)
            emb = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", emb.cos())
            self.register_buffer("sin", emb.sin())

        def forward(self, tok: torch.Tensor) -> torch.Tensor:
            x = self.emb(tok)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            return self.head(self.norm(x))

    model = Model()
    if weights is not None:
        model.load_state_dict(
            {
                _torch_name(name): torch.from_numpy(np.asarray(w, np.float32))
                for name, w in weights.items()
            }
            | {"cos": model.cos, "sin": model.sin}
        )
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tok = torch.from_numpy(tokens).to(device)
    tgt = torch.from_numpy(targets).to(device)

    device_type = torch.device(device).type
    scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None

    def step() -> float:
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(tok)
            # autocast runs cross_entropy in fp32
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt.reshape(-1))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)  # skipped on inf/NaN gradients
            scaler.update()
        opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    step.loss_scale = (lambda: 1.0) if scaler is None else scaler.get_scale  # type: ignore[attr-defined]
    return step


#: mila_py's parameter names (the part after ``layer{i}.``) to the names of the model above
_NAMES = {
    "input_layernorm.weight": "n1.weight",
    "self_attn.qkv_proj.weight": "qkv.weight",  # Q, K, V rows in that order on both sides
    "self_attn.o_proj.weight": "o.weight",
    "post_attention_layernorm.weight": "n2.weight",
    "mlp.gate_proj.weight": "gate.weight",
    "mlp.up_proj.weight": "up.weight",
    "mlp.down_proj.weight": "down.weight",
    "embed_tokens.weight": "emb.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
}


def _torch_name(name: str) -> str:
    """The name in the model above of mila_py's parameter ``name`` (``layer3.mlp.up_proj.weight``
    -> ``blocks.3.up.weight``)."""
    head, _, rest = name.partition(".")
    if head.startswith("layer") and head[5:].isdigit():
        return f"blocks.{head[5:]}.{_NAMES[rest]}"
    return _NAMES[name]
