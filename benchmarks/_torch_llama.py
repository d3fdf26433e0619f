"""The benchmarks' PyTorch baseline: the same Llama as ``mila_py.models.Llama``, written in
PyTorch eager, and one training step of it (forward + cross-entropy + backward + AdamW).

Shared by ``train_step.py`` (CPU) and ``train_step_cuda.py`` (GPU). Attention is
``F.scaled_dot_product_attention`` (causal) on the K/V heads repeated for GQA; RoPE is the
half-split rotation over precomputed cos/sin rows, as in Hugging Face's Llama.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mila_py.models import LlamaConfig


def torch_train_step(
    cfg: LlamaConfig, tokens: np.ndarray, targets: np.ndarray, device: str = "cpu"
) -> Callable[[], float]:
    """A closure running one fp32 training step of ``cfg`` on ``tokens``/``targets`` [B, T].

    On a CUDA device TF32 is switched off, so the GEMMs are fp32 like mila_py's.
    """
    import torch
    import torch.nn.functional as F

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

            def rot(x: torch.Tensor) -> torch.Tensor:
                x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
                return x * cos + torch.cat((-x2, x1), dim=-1) * sin

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

    model = Model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tok = torch.from_numpy(tokens).to(device)
    tgt = torch.from_numpy(targets).to(device)

    def step() -> float:
        logits = model(tok)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    return step
