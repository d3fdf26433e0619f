"""The Llama network: a decoder built from mila_py components (its blocks: :mod:`.block`, its
config: :mod:`.config`, its generation loops: :mod:`mila_py.models.generation`).

Tree (names follow the component tree, dotted in ``named_parameters`` and safetensors files)::

    Llama
      embed_tokens              TokenEmbedding   [vocab, dim]
      layer0 .. layer{N-1}      LlamaBlock
        input_layernorm         RmsNorm
        self_attn               GroupedQueryAttention (qkv_proj, [q_norm, k_norm,] rope, o_proj)
        post_attention_layernorm RmsNorm
        mlp                     SwiGLU (gate_proj, up_proj, down_proj)
      norm                      RmsNorm
      lm_head                   Linear [vocab, dim]   (absent with tie_embeddings)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components._layer import (
    check_grad,
    is_int,
    leading_view,
)
from mila_py.components.attention import (
    CachedLengths,
    check_decode_positions,
    check_seq_len,
)
from mila_py.components.linear import Linear, LinearConfig
from mila_py.components.rms_norm import RmsNorm, RmsNormConfig
from mila_py.components.token_embedding import TokenEmbedding, TokenEmbeddingConfig
from mila_py.composite import Network
from mila_py.devices import DeviceId, DeviceLike, DeviceType
from mila_py.devices.sizing import SizingContext
from mila_py.models import generation
from mila_py.models.llama.block import LlamaBlock, tokens_per_pass
from mila_py.models.llama.config import LlamaConfig
from mila_py.ops.operation import DecodePositions
from mila_py.ops.registry import create_op
from mila_py.precision import Precision
from mila_py.run_lock import serialized

__all__ = ["Llama"]


class Llama(Network):
    """A Llama-style decoder network that owns its execution context.

    ``build(BuildContext((B, T), mode))`` takes the token shape. ``forward(tokens [B, T] int)``
    returns logits ``[B, T, vocab]``; ``backward(dlogits)`` fills every parameter gradient
    (aligned with ``get_parameters()``).

    ``precision`` (FP32, BF16, FP16; FP64 on the CPU; :attr:`precision` reads it) is the storage
    of the parameters, activations, logits and KV cache. 16-bit networks compute in FP32 where
    it matters (matrix-product accumulation, norm statistics, softmax, the loss) and round each
    result once when it is stored; their TRAINING builds keep FP32 gradients, and ``backward``
    takes ``dlogits`` in the network's precision or in FP32.

    Calls on one model from several threads run one at a time: ``forward``, ``backward``,
    ``prefill``, ``decode``, ``reset`` and ``generate`` each hold the model's
    :attr:`run_lock` for their duration (re-entrant: one thread may interleave its own calls).
    A :meth:`stream` holds it from its first token until it ends, is closed or is
    garbage-collected, so a stream that is started and not consumed blocks the calls of other
    threads on this model until it is closed (``stream.close()``, or ``contextlib.closing``).
    ``forward`` returns a view of the model's own buffer, which the next call overwrites: a
    thread that shares the model reads (or copies) it, and runs any sequence of calls that must
    not be interleaved with another thread's (a training forward and its backward), inside
    ``with model.run_lock:``.
    """

    def __init__(
        self,
        name: str,
        config: LlamaConfig,
        *,
        device: DeviceLike = "CPU",
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"{name}: config must be a LlamaConfig, got {config!r}")
        self.config = config
        self.embed_tokens = TokenEmbedding(
            "embed_tokens", TokenEmbeddingConfig(config.vocab_size, config.dim), precision=precision
        )
        self.add_component(self.embed_tokens)
        self.layers = [
            LlamaBlock(f"layer{i}", config, precision=precision) for i in range(config.n_layers)
        ]
        for block in self.layers:
            self.add_component(block)
        self.norm = RmsNorm("norm", RmsNormConfig(config.dim, config.norm_eps), precision=precision)
        self.add_component(self.norm)
        self.lm_head: Linear | None = None
        if not config.tie_embeddings:
            self.lm_head = Linear(
                "lm_head", LinearConfig(config.dim, config.vocab_size), precision=precision
            )
            self.add_component(self.lm_head)
        self._fix_children()
        self._hidden: Any = None
        #: decode plans per batch size on INFERENCE builds (None on TRAINING builds)
        self._plans: dict[int, tuple[DecodePositions, list[Any], Any]] | None = None
        self._cached: CachedLengths | None = None  # INFERENCE builds
        #: counts the calls that write the KV cache, so a stream sees another call's
        self._cache_writes = 0
        #: the tied head's products (the embedding's weight as a Linear's), on the device
        self._head_op: Any = None

    def _on_execution_context_set(self) -> None:
        super()._on_execution_context_set()
        if self.lm_head is None:
            head = LinearConfig(self.config.dim, self.config.vocab_size)
            self._head_op = create_op("LinearOp", self.execution_context, head, self.precision)

    def _on_building(self, build_context: BuildContext) -> None:
        shape = build_context.input_shape
        if len(shape) != 2:
            raise ValueError(f"{self._describe()}: build shape must be tokens [B, T], got {shape}")
        n_b, n_t = shape
        if n_t > self.config.max_seq_len:
            raise ValueError(
                f"{self._describe()}: T = {n_t} exceeds max_seq_len = {self.config.max_seq_len}"
            )
        chunk = tokens_per_pass(build_context)
        act = build_context.with_shape((n_b, chunk, self.config.dim))
        self.embed_tokens.build(build_context.with_shape((n_b, chunk)))
        for block in self.layers:
            block.build(build_context.with_shape((n_b, n_t, self.config.dim)))
        self.norm.build(act)
        if self.lm_head is not None:
            self.lm_head.build(act)
        else:
            self._add_state("logits", self._allocate((n_b, chunk, self.config.vocab_size)))
            if build_context.is_training:
                self._add_state("dnorm", self._allocate((n_b, n_t, self.config.dim)))
        self._hidden = None
        # decode plans per batch size (INFERENCE builds), see _decode_plan, and on the CPU the
        # attention scores of one sequence, which every layer's decode step uses in turn
        self._plans = {} if build_context.is_inference else None
        # one record of the cached positions for every layer (they cache the same positions)
        self._cached = CachedLengths(n_b) if build_context.is_inference else None
        for block in self.layers:
            block.self_attn._cached = self._cached
        if self._plans is not None and self.device_id.device_type is DeviceType.CPU:
            scores = (self.config.n_heads * n_t,)  # float32 for 16-bit storage
            self._add_state("decode_scores", self._allocate(scores, self.precision.compute_dtype))

    # ------------------------------------------------------------------ sizes
    @property
    def chunk_size(self) -> int:
        """Tokens per forward pass: T for TRAINING builds, the prefill chunk for INFERENCE."""
        return tokens_per_pass(self.build_context)

    @property
    def context_length(self) -> int:
        """Positions the build serves: T of the build shape (the KV cache size on INFERENCE)."""
        return self.build_context.input_shape[1]

    def required_memory(self, build_context: BuildContext) -> Any:
        """The :class:`MemoryStats` a build with ``build_context`` will have, without building
        this model and without allocating its buffers: a twin is built through a
        :class:`~mila_py.devices.sizing.SizingContext` (buffers of the build's shapes that hold
        one element each) and measured, so a build too large for the device is predicted too.
        Only the shared RoPE table is made for real (``max_seq_len`` rows, as the build would
        share it)."""
        if not isinstance(build_context, BuildContext):
            raise TypeError(
                f"{self._describe()}: required_memory needs a BuildContext, got {build_context!r}"
            )
        twin = Llama(self.name, self.config, device=self.device_id, precision=self.precision)
        for component in twin._walk():  # unbuilt: its tree takes the sizing context instead
            component._context = None
        twin.set_execution_context(SizingContext(self.execution_context))
        twin.build(
            BuildContext(
                build_context.input_shape,
                build_context.runtime_mode,
                initialize_parameters=False,
                prefill_size=build_context.prefill_size,
            )
        )
        return twin.get_memory_stats()

    # ------------------------------------------------------------------ run
    @serialized
    def forward(self, tokens: Any, position_offset: int = 0, *, seq_len: int | None = None) -> Any:
        """``tokens [B, T] -> logits [B, T, vocab]`` (a view of an owned buffer).

        TRAINING builds: positions ``0 .. T-1``. INFERENCE builds: one prefill chunk
        (``T <= chunk_size``) at ``position_offset``, its keys and values cached; a prompt cut
        in chunks by hand passes its end as ``seq_len`` so that a length-dependent RoPE
        scaling rotates every chunk as one pass would (as :meth:`prefill` does).
        """
        if not self.is_built:
            raise RuntimeError(f"{self._describe()}: forward() needs a built network")
        offset = _as_position(position_offset, self._describe())
        if offset and self.build_context.is_training:  # refused before any buffer is written
            raise ValueError(f"{self._describe()}: TRAINING builds run from position 0")
        n_t = tokens.shape[1] if getattr(tokens, "ndim", 0) == 2 else 0
        if getattr(tokens, "ndim", 0) == 2 and n_t == 0:
            raise ValueError(
                f"{self._describe()}: forward takes tokens [B, T] with T >= 1, got shape "
                f"{tuple(tokens.shape)}"
            )
        if offset + n_t > self.context_length:
            raise ValueError(
                f"{self._describe()}: positions {offset}..{offset + n_t - 1} do not fit the "
                f"context of {self.context_length} tokens"
            )
        if seq_len is not None:
            check_seq_len(self, seq_len, offset + n_t, self.context_length)
        with self.execution_context.activate():
            shape = self._check_tokens(tokens, tokens, tokens)
            if self._cached is not None:  # INFERENCE: a prefill chunk that writes the cache
                self._start_cache_write(offset, shape[0])
            h = self.embed_tokens._lookup(tokens, shape)
            for block in self.layers:
                h = block._forward(h, offset, seq_len)
            return self._head(h)

    def _head(self, h: Any) -> Any:
        h = self.norm._forward(h)  # h: a block's output (or a contiguous copy of its last row)
        if self.lm_head is not None:
            return self.lm_head._forward(h)
        self._hidden = h
        n_b, n_t = h.shape[0], h.shape[1]
        logits = leading_view(self._state["logits"], (n_b, n_t, self.config.vocab_size))
        self._head_op.forward(h, self.embed_tokens._parameters["weight"], None, logits)
        return logits

    def _require_inference(self, what: str) -> None:
        if not self.is_built or not self.build_context.is_inference:
            raise RuntimeError(
                f"{self._describe()}: {what} needs an INFERENCE build: "
                "build(BuildContext((B, context), RuntimeMode.INFERENCE, prefill_size=...))"
            )

    def _check_tokens(self, lead: Any, given: Any, tokens: Any) -> tuple[int, ...]:
        """Check ``lead`` (device ints, the shape of one lookup) and the ids of ``tokens`` (on
        the device) where the caller had them: ``given``, when it is a NumPy array, so host ids
        cost no wait for the GPU. Returns ``lead``'s shape."""
        shape = self.embed_tokens._check_ints(lead, "tokens")
        self.embed_tokens.check_ids(given if isinstance(given, np.ndarray) else tokens)
        return shape

    def _start_cache_write(self, first: Any, n_b: int) -> None:
        """Refuse a write of the KV cache at positions ``first`` (an int, or one per sequence)
        that would leave a gap (see :class:`CachedLengths`); else count it, so a paused stream
        knows its cache changed. Called after every other check of the call."""
        self._cached.check(first, n_b, self._describe())  # type: ignore[union-attr]
        self._cache_writes += 1

    @serialized
    def prefill(self, tokens: Any, position_offset: int = 0) -> Any:
        """Run tokens through the model in chunks of ``chunk_size``, filling the KV cache.

        The cache is addressed by position: a call at ``position_offset`` writes positions
        ``position_offset .. position_offset + T - 1`` and attends to everything cached before
        them. ``position_offset=0`` starts a new prompt; a later offset continues a conversation
        (append a turn after ``decode``) or rewinds it (what lay past the offset is overwritten
        and never read again).

        Args:
            tokens: ``[B, T]`` ints (``position_offset + T <= context_length``).
            position_offset: position of ``tokens[:, 0]``, at most :attr:`cached_lengths` of
                every sequence (a later one would attend to positions never written).

        Returns:
            logits of the last position, ``[B, vocab]`` (a copy, on the model's device).
        """
        self._require_inference("prefill()")
        given = tokens
        tokens = _on_device(self.execution_context, tokens)
        offset = _as_position(position_offset, self._describe())
        if tokens.ndim != 2 or not 0 < tokens.shape[1] <= self.context_length - offset:
            raise ValueError(
                f"{self._describe()}: prefill takes tokens [B, T] with 0 < T <= "
                f"{self.context_length - offset} (context {self.context_length}, offset "
                f"{offset}), got shape {tuple(tokens.shape)}"
            )
        n_t, chunk = tokens.shape[1], self.chunk_size
        h = None
        with self.execution_context.activate():
            # every chunk's ids before the first chunk writes the cache
            self._check_tokens(tokens[:, :chunk], given, tokens)
            self._start_cache_write(offset, tokens.shape[0])
            for start in range(0, n_t, chunk):
                piece = tokens[:, start : start + chunk]
                h = self.embed_tokens._lookup(piece, tuple(piece.shape))
                for block in self.layers:  # every chunk rotates as one pass would
                    h = block._forward(h, offset + start, offset + n_t)
            last = self.execution_context.xp.ascontiguousarray(h[:, -1:])  # type: ignore[index]
            return self._head(last)[:, 0].copy()

    @serialized
    def reset(self) -> None:
        """Forget every cached key and value (zero the KV caches of all layers).

        Not needed between prompts, since the cache is addressed by position and a prefill
        at offset 0 overwrites what it reads; use it to scrub a finished conversation.
        """
        self._require_inference("reset()")
        self._cache_writes += 1
        for block in self.layers:
            block.self_attn.reset_cache()

    @property
    def cached_lengths(self) -> tuple[int, ...]:
        """How many positions (``0 .. n - 1``) each sequence of the build holds in the KV cache
        (INFERENCE builds). A prefill or decode must start at a position ``<= n`` of its
        sequence, and leaves it holding exactly the positions up to its last token."""
        self._require_inference("cached_lengths")
        return tuple(self._cached.lengths)  # type: ignore[union-attr]

    @serialized
    def decode(self, token: Any, position: Any) -> Any:
        """One token per sequence through the cached context.

        Args:
            token: ``[B]`` ints, the newest token of each sequence.
            position: its position, an int or one per sequence ``[B]`` (ragged batches), at
                most the sequence's :attr:`cached_lengths` (an earlier one rewinds).

        Returns:
            next-token logits ``[B, vocab]`` (a copy, on the model's device).

        Runs a decode plan (see :meth:`_decode_plan`), made per batch size on first use.
        """
        self._require_inference("decode()")
        ctx = self.execution_context
        given = token
        token = _on_device(ctx, token)
        if not (token.ndim <= 1 or (token.ndim == 2 and token.shape[1] == 1)):
            raise ValueError(
                f"{self._describe()}: decode takes one token per sequence, [B] ([B, 1] and a "
                f"scalar for B = 1 too), got shape {tuple(token.shape)}; use prefill for "
                "several tokens"
            )
        token = token.reshape(-1, 1)
        n_b = token.shape[0]
        positions, lowest, highest = check_decode_positions(
            position, n_b, self.context_length, self._describe(), ctx.to_host
        )
        with ctx.activate():
            shape = self._check_tokens(token, given, token)
            self._start_cache_write(positions, n_b)
            self.embed_tokens._lookup(token, shape)  # into the plan's input buffer
            cell, steps, logits = self._decode_plan(n_b)
            cell.set(positions, lowest, highest)
            for step in steps:
                step()
            self._cached.mark(positions, 1, n_b)  # type: ignore[union-attr]
            return logits[:, 0].copy()

    def _decode_components(self, token: Any, position: Any) -> Any:
        """:meth:`decode` through the components' own calls (``token [B, 1]`` on the device):
        the reference the decode plans are tested against."""
        with self.execution_context.activate():
            h = self.embed_tokens.forward(token)
            for block in self.layers:
                h = block._decode(h, position)
            return self._head(h)[:, 0].copy()

    def _decode_plan(self, n_b: int) -> tuple[DecodePositions, list[Any], Any]:
        """``(positions, steps, logits view)`` of one decode step for ``n_b`` sequences.

        Every layer's work bound once to the buffers it reads and writes (the embedding's
        output in, the head's logits out): a token runs the steps in order, without the checks
        and view-making of the component calls, which cost ~60 us per layer, as much as the
        kernels of a small model. Decode sets the positions first. Plans hold
        views and bound calls only: every buffer they use is a state buffer of the build.
        """
        plans = self._plans
        assert plans is not None
        plan = plans.get(n_b)
        if plan is None:
            cell = DecodePositions(n_b, self.execution_context)
            h = self.embed_tokens._view("output", (n_b, 1, self.config.dim))
            scores = self._state.get("decode_scores")  # CPU builds
            steps: list[Any] = []
            for block in self.layers:
                block_steps, h = block._bind_decode(h, cell, scores)
                steps += block_steps
            norm_steps, h = self.norm._bind_forward(h)
            steps += norm_steps
            if self.lm_head is not None:
                head_steps, logits = self.lm_head._bind_forward(h)
                steps += head_steps
            else:
                logits = leading_view(self._state["logits"], (n_b, 1, self.config.vocab_size))
                weight = self.embed_tokens._parameters["weight"]  # [vocab, dim]
                steps.append(self._head_op.bind_forward(h, weight, None, logits))
            plan = plans[n_b] = (cell, steps, logits)
        return plan

    def stream(
        self,
        prompt: Any,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> Iterator[np.ndarray]:
        """An iterator of ``[B]`` new tokens, one step at a time (prefill once, then decode).

        ``prompt`` is ``[B, T]`` or ``[T]`` ints, or a list of B 1-D prompts (of any lengths):
        those are prefilled together, right-padded to the longest, and each then decodes from
        its own length (the padding's cache rows are overwritten before any query can see them).
        Greedy decoding gives every row the tokens it gets alone (except under a
        length-dependent RoPE scaling, ``dynamic`` or LongRoPE, whose frequencies follow the
        padded prompt's length, as in a batched transformers ``generate``); every row gets the same number
        of new tokens, at most ``context_length - T + 1`` for the longest prompt's ``T`` (a
        larger ``max_new_tokens`` is cut to that with a ``UserWarning``).

        Greedy when ``temperature == 0``; otherwise samples from ``softmax(logits / T)``
        restricted to the ``top_k`` most likely tokens and the smallest set whose probability
        reaches ``top_p`` (one generator, seeded with ``seed``, for all rows).

        With ``eos_token_id`` (one id or several), a sequence that emits one of them is finished:
        its later tokens are ``pad_token_id`` (default: the first EOS id), and the stream ends
        once every sequence is finished, as Hugging Face's ``generate`` does. Without it, the
        stream runs ``max_new_tokens`` steps (fewer if the context fills up).

        Raises (at the call, before any work):
            RuntimeError: not an INFERENCE build.
            ValueError, TypeError: a bad prompt, sampling parameter or token id.

        Raises (at a later step):
            RuntimeError: another call wrote the KV cache since the previous step (a prefill,
                decode, reset or other stream on this model): the stream cannot go on.
            FloatingPointError: the model's logits for a new token hold NaN or inf (in a row
                still generating); the message names the step (the index of the new token)
                and the sequences. Nothing is sampled from them, and the stream ends.

        The stream holds the model (see the class docstring) from its first token until it ends,
        is closed or is garbage-collected: meanwhile the calls of other threads on this model
        wait, so close a stream you stop reading early. It may be advanced from any thread.
        """
        return generation.stream(
            self,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )

    @serialized
    def generate(
        self,
        prompt: Any,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> np.ndarray | list[np.ndarray]:
        """The prompt followed by up to ``max_new_tokens`` generated tokens, on the host:
        ``[B, T + n]`` for a ``[B, T]`` prompt, ``[T + n]`` for a ``[T]`` one, and for a list of
        prompts a list of 1-D arrays, each its prompt and the same number ``n`` of new tokens.
        See :meth:`stream` for the sampling and stopping rules and the errors.

        Raises:
            FloatingPointError: the model's logits for a new token hold NaN or inf; the message
                names the step (the index of the new token) and the sequences. The KV cache
                holds what the generation wrote up to then.
        """
        return generation.generate(
            self,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )

    @serialized
    def backward(self, dlogits: Any) -> None:
        """Backpropagate ``dlogits [B, T, vocab]``; accumulates every parameter gradient."""
        if not self.is_built or not self.build_context.is_training:
            raise RuntimeError(f"{self._describe()}: backward() needs a TRAINING build")
        with self.execution_context.activate():
            self._backward(dlogits)

    def _backward(self, dlogits: Any) -> None:
        if self.lm_head is not None:
            dh = self.lm_head.backward(dlogits)
        else:
            if self._hidden is None:
                raise RuntimeError(f"{self._describe()}: backward() before forward()")
            h = self._hidden
            weight = self.embed_tokens._parameters["weight"]
            grad = self.embed_tokens._gradients["weight"]
            vocab = self.config.vocab_size
            n_b, n_t = h.shape[0], h.shape[1]
            # checked as the untied head's Linear checks it, before any gradient is touched
            check_grad(self, dlogits, "dlogits", (n_b, n_t, vocab), weight.dtype)
            dh = leading_view(self._state["dnorm"], (n_b, n_t, self.config.dim))  # contiguous
            self._head_op.backward(h, weight, dlogits, grad, None, dh)
        dh = self.norm.backward(dh)
        for block in reversed(self.layers):
            dh = block.backward(dh)
            for hook in self.block_backward_hooks:
                hook(block)
        self.embed_tokens.backward(dh)

    @classmethod
    def from_pretrained(
        cls,
        path: Any,
        *,
        device: DeviceLike = "CPU",
        runtime_mode: Any = None,
        batch_size: int = 1,
        prefill_size: int | None = None,
        seq_len: int | None = None,
        precision: Precision | None = None,
        check_memory: bool = True,
    ) -> Llama:
        """Build a Llama from a Hugging Face checkpoint directory and load its weights.

        Args:
            path: a folder with ``config.json`` and ``model.safetensors`` (or a sharded
                ``model.safetensors.index.json``); see :mod:`mila_py.interop.hf`.
            device: where the network runs.
            runtime_mode: a ``RuntimeMode``; None means ``RuntimeMode.INFERENCE``.
            batch_size: B of the build shape.
            prefill_size: prefill chunk size of INFERENCE builds (None: 512 tokens, or the
                whole context when it is shorter; 0: the whole context).
            seq_len: T of the build shape (the context capacity of INFERENCE builds, whose
                KV cache grows with it); default ``min(max_position_embeddings, 4096)``, so
                that a long-context checkpoint does not build a cache for its whole window
                unasked (pass a larger ``seq_len``, up to ``max_position_embeddings``, for a
                longer context).
            precision: parameter, activation and KV-cache precision (FP32, BF16, FP16, or
                FP64 on the CPU); default the checkpoint's own (``dtype`` / ``torch_dtype``
                of ``config.json``, else its tensors' dtype, see
                :func:`~mila_py.interop.hf.checkpoint_precision`; FP64 becomes FP32 on a
                device without FP64): a BF16 checkpoint gives a BF16 model, its weights
                copied as they are. Weights are cast to any other precision asked for.
            check_memory: refuse a build the device cannot hold (see :meth:`build`);
                ``False`` builds without checking.

        The config, the arguments and the weight files' headers are checked, and the model
        built, before any tensor is read; the tensors are then read one at a time, each
        copied into its parameter (:func:`mila_py.interop.hf.load_hf_files`), so the load needs
        about one tensor's memory beyond the model's.

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            ValueError: a config mila_py cannot express, bad arguments, files that do not
                parse, or tensors that do not match the config (every problem listed at once).
            MemoryError: the build does not fit the device's available memory.
        """
        from mila_py.build_context import RuntimeMode
        from mila_py.interop import hf

        mode = RuntimeMode.INFERENCE if runtime_mode is None else runtime_mode
        if precision is not None and not isinstance(precision, Precision):
            raise TypeError(
                f"Llama.from_pretrained: precision must be a Precision or None, got {precision!r}"
            )
        raw = hf.read_hf_config(path)
        longest: Any = raw.get("max_position_embeddings")
        if seq_len is not None:
            context = int(seq_len) if is_int(seq_len) and seq_len > 0 else None
        else:  # the default bound (a malformed max_position_embeddings is reported below)
            context = min(int(longest), _DEFAULT_CONTEXT) if is_int(longest) else None
        config = hf.llama_config_from_hf(raw, context=context)
        files = hf.hf_weight_files(path)
        n_t = min(config.max_seq_len, _DEFAULT_CONTEXT) if seq_len is None else seq_len
        if precision is None:
            precision = hf.checkpoint_precision(raw, files)
            if not precision.is_supported_on(DeviceId.parse(device)):
                precision = Precision.FP32
        if prefill_size is None:
            prefill_size = min(n_t, _DEFAULT_PREFILL) if is_int(n_t) else 0
        model = cls("llama", config, device=device, precision=precision)
        model.build(
            BuildContext(
                (batch_size, n_t), mode, initialize_parameters=False, prefill_size=prefill_size
            ),
            check_memory=check_memory,
        )
        hf.load_hf_files(model, files)
        return model


#: from_pretrained's prefill chunk: INFERENCE builds hold activations and logits for one chunk
_DEFAULT_PREFILL = 512
#: from_pretrained's default context, at most: its KV cache grows with it
_DEFAULT_CONTEXT = 4096


def _on_device(ctx: Any, array: Any) -> Any:
    """``array`` itself if it lives on ``ctx``'s device, else a copy there (lists, host arrays)."""
    return array if ctx.is_device_array(array) else ctx.to_device(np.asarray(array))


def _as_position(value: Any, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{who}: position_offset must be an int >= 0, got {value!r}")
    return int(value)
