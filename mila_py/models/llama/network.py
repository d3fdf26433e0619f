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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.component import share_workspace
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
from mila_py.models import generation, text
from mila_py.models.generation import DEFAULT, Default
from mila_py.models.llama.block import LlamaBlock, tokens_per_pass
from mila_py.models.llama.config import LlamaConfig
from mila_py.models.llama.decode_plan import DecodePlan
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
    ``forward`` on a TRAINING build returns a view of the model's own buffer, which the next
    call overwrites: a thread that shares the model reads (or copies) it, and runs any sequence
    of calls that must not be interleaved with another thread's (a training forward and its
    backward), inside ``with model.run_lock:``.

    Memory: parameters (and gradients) are per layer, and so is the KV cache of INFERENCE
    builds; their activations live in one workspace that every block shares (see
    :meth:`_build_blocks`), and their logits buffer holds one position per sequence. TRAINING
    builds keep every block's activations for backward, or with ``BuildContext(...,
    recompute=True)`` only each block's input, running each block's forward again before its
    backward. :meth:`required_memory` predicts a build's bytes exactly.

    Text in, text out (:meth:`complete`, :meth:`chat`, :meth:`stream_text`) needs a
    :attr:`tokenizer`; :meth:`from_pretrained` loads one where the folder has a
    ``tokenizer.json``.
    """

    #: the tokenizer of the text methods (a :class:`mila_py.interop.Tokenizer`, or any object
    #: with its ``encode``, ``apply_chat_template``, ``stream_decoder`` and ``eos_token_id``);
    #: set by :meth:`from_pretrained` from ``tokenizer.json``, else None
    tokenizer: Any = None
    #: the checkpoint's generation defaults (a :class:`mila_py.interop.GenerationDefaults`, or
    #: any object with its ``generate_kwargs()`` and ``max_new_tokens``) that :meth:`generate`,
    #: :meth:`stream` and the text methods use for the arguments a caller leaves out; set by
    #: :meth:`from_pretrained`, else None
    generation_defaults: Any = None

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
        self._plans: dict[int, DecodePlan] | None = None
        self._cached: CachedLengths | None = None  # INFERENCE builds
        #: counts the calls that write the KV cache, so a stream sees another call's
        self._cache_writes = 0
        #: the tied head's products (the embedding's weight as a Linear's), on the device
        self._head_op: Any = None
        #: each block's input in the last forward (TRAINING builds with recompute)
        self._block_inputs: list[Any] = []
        #: the block whose activations the shared workspace holds (recompute), else None
        self._recomputed: int | None = None

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
        self._build_blocks(build_context.with_shape((n_b, n_t, self.config.dim)))
        self.norm.build(act)
        # INFERENCE builds return the logits of one position per sequence (prefill, decode):
        # the head's buffers hold that one row; forward() writes a chunk's into a new array
        head_rows = chunk if build_context.is_training else 1
        if self.lm_head is not None:
            self.lm_head.build(build_context.with_shape((n_b, head_rows, self.config.dim)))
        else:
            self._add_state("logits", self._allocate((n_b, head_rows, self.config.vocab_size)))
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
        self._block_inputs = []
        self._recomputed = None

    def _build_blocks(self, block_context: BuildContext) -> None:
        """Build the decoder blocks: each with its own parameters (and KV cache), and, on
        INFERENCE and recomputing TRAINING builds, every block after the first on the first
        one's workspace (:func:`~mila_py.component.share_workspace`), since the blocks run one
        at a time.

        INFERENCE: every buffer of a block's parts is shared, its output too, so the residual
        stream is updated in place: block ``i + 1`` reads its input from the buffer that
        block ``i`` wrote its output into, and writes its own output there last (its
        ``mlp_residual``), after its ``attn_residual`` has read the input for the last time.

        TRAINING with ``recompute``: each block keeps its own output buffer (its
        ``mlp_residual``'s), the next block's input, which the backward pass needs to run
        that block's forward again; every other buffer is shared (see :meth:`_backward`).
        """
        blocks = self.layers
        shared = block_context.is_inference or block_context.recompute
        keep = ("mlp_residual",) if block_context.is_training else ()
        for block in blocks:
            if shared and block is not blocks[0]:
                with share_workspace(blocks[0], block, keep=keep):
                    block.build(block_context)
            else:
                block.build(block_context)

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
        twin.build(replace(build_context, initialize_parameters=False))
        return twin.get_memory_stats()

    # ------------------------------------------------------------------ run
    @serialized
    def forward(self, tokens: Any, position_offset: int = 0, *, seq_len: int | None = None) -> Any:
        """``tokens [B, T] -> logits [B, T, vocab]``.

        TRAINING builds: positions ``0 .. T-1``; the logits are a view of the model's own
        buffer, which the next forward overwrites (and :meth:`backward` reads). INFERENCE
        builds: one prefill chunk (``T <= chunk_size``) at ``position_offset``, its keys and
        values cached; a prompt cut in chunks by hand passes its end as ``seq_len`` so that a
        length-dependent RoPE scaling rotates every chunk as one pass would (as
        :meth:`prefill` does). The logits are then a new array, allocated for this call, that
        the caller owns: an INFERENCE build keeps logits for one position per sequence (what
        :meth:`prefill` and :meth:`decode` return), so ``[B, T, vocab]`` is no part of its
        memory (:meth:`get_memory_stats`, :meth:`required_memory`).
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
            keep = self.build_context.recompute
            self._block_inputs = []
            for block in self.layers:
                if keep:  # the embedding's output or the previous block's own output buffer
                    self._block_inputs.append(h)
                h = block._forward(h, offset, seq_len)
            self._recomputed = len(self.layers) - 1 if keep else None
            return self._head(h, fresh=self._cached is not None)

    def _head(self, h: Any, *, fresh: bool = False) -> Any:
        """Logits ``[B, T, vocab]`` of the last block's output ``h [B, T, dim]`` (or a
        contiguous copy of its last row): a view of the head's own buffer, or with ``fresh``
        (an INFERENCE forward, whose chunk has more rows than that buffer) a new array."""
        h = self.norm._forward(h)
        n_b, n_t = h.shape[0], h.shape[1]
        vocab = self.config.vocab_size
        if fresh:
            logits = self.execution_context.allocate(
                (n_b, n_t, vocab), self.precision.numpy_dtype, zero=False
            )
            if self.lm_head is not None:
                head = self.lm_head
                weight, bias = head._parameters["weight"], head._parameters.get("bias")
                head.op.forward(h, weight, bias, logits)
            else:
                weight = self.embed_tokens._parameters["weight"]
                self._head_op.forward(h, weight, None, logits)
            return logits
        if self.lm_head is not None:
            return self.lm_head._forward(h)
        self._hidden = h
        logits = leading_view(self._state["logits"], (n_b, n_t, vocab))
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
            token: ``[B]`` ints, the newest token of each sequence. Host ids (a list, a NumPy
                array) are checked on the host; ids on the model's device cost one wait for
                the device (their range is read back before the step).
            position: its position, an int or one per sequence ``[B]`` (ragged batches), at
                most the sequence's :attr:`cached_lengths` (an earlier one rewinds).

        Returns:
            next-token logits ``[B, vocab]`` (a copy, on the model's device).

        Runs the decode step of ``B`` sequences (a :class:`~.decode_plan.DecodePlan`, made on
        first use): on a GPU it is captured as a CUDA graph by its first run and replayed by
        the next ones.
        """
        self._require_inference("decode()")
        ctx = self.execution_context
        host = None if ctx.is_device_array(token) else np.asarray(token)
        token = _on_device(ctx, token)
        if not (token.ndim <= 1 or (token.ndim == 2 and token.shape[1] == 1)):
            raise ValueError(
                f"{self._describe()}: decode takes one token per sequence, [B] ([B, 1] and a "
                f"scalar for B = 1 too), got shape {tuple(token.shape)}; use prefill for "
                "several tokens"
            )
        token = token.reshape(-1, 1)
        with ctx.activate():
            self._check_tokens(token, token if host is None else host, token)
            ids = token if host is None else host.reshape(-1)
            return self._decode_ids(ids, position)[:, 0].copy()

    def _decode_ids(self, ids: Any, position: Any) -> Any:
        """:meth:`decode` of ids ``[B]`` (or ``[B, 1]``) known to be in the vocabulary: checked
        by the caller, or a sampler's (host ints, or ints on the device, which are not read
        back). Returns the logits ``[B, 1, vocab]``, a view of the step's buffer that the next
        step overwrites. Run it with the context active.

        Raises:
            ValueError: a bad position, or one that would leave a gap in the KV cache (nothing
                is written then).
        """
        n_b = int(ids.shape[0])
        positions, lowest, highest = check_decode_positions(
            position, n_b, self.context_length, self._describe(), self.execution_context.to_host
        )
        plan = self._decode_plan(n_b)
        self._start_cache_write(positions, n_b)
        plan.feed(ids)
        logits = plan.run(positions, lowest, highest)
        self._cached.mark(positions, 1, n_b)  # type: ignore[union-attr]
        return logits

    def _decode_components(self, token: Any, position: Any) -> Any:
        """:meth:`decode` through the components' own calls (``token [B, 1]`` on the device):
        the reference the decode plans are tested against."""
        with self.execution_context.activate():
            h = self.embed_tokens.forward(token)
            for block in self.layers:
                h = block._decode(h, position)
            return self._head(h)[:, 0].copy()

    def _decode_plan(self, n_b: int) -> DecodePlan:
        """The decode step of ``n_b`` sequences (see :class:`~.decode_plan.DecodePlan`), made on
        first use and kept for the build.

        Every layer's work bound once to the buffers it reads and writes: a token runs the
        bound calls in order, without the checks and view-making of the component calls, which
        cost ~60 us per layer, as much as the kernels of a small model; on a GPU the step is
        then replayed from a CUDA graph, one launch per token.
        """
        plans = self._plans
        assert plans is not None
        plan = plans.get(n_b)
        if plan is None:
            plan = plans[n_b] = DecodePlan(self, n_b)
        return plan

    def stream(
        self,
        prompt: Any,
        max_new_tokens: int = 32,
        temperature: float | Default = DEFAULT,
        top_k: int | Default | None = DEFAULT,
        top_p: float | Default | None = DEFAULT,
        seed: int | None = None,
        *,
        eos_token_id: int | Sequence[int] | Default | None = DEFAULT,
        pad_token_id: int | Default | None = DEFAULT,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
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

        Each token is chosen on the model's device (:mod:`mila_py.models.sampling`), with
        transformers' processors in its order: first the penalties, ``repetition_penalty``
        (over the prompt and the tokens generated so far; 1 is off) and OpenAI's
        ``presence_penalty`` and ``frequency_penalty`` (over the generated tokens; 0 is off);
        then greedy (the argmax) when ``temperature == 0``, else a draw from
        ``softmax(logits / T)`` restricted to the ``top_k`` most likely tokens, the smallest
        set whose probability reaches ``top_p`` (0 keeps the most likely token alone) and the
        tokens at least ``min_p`` times as likely as the most likely one (the draws of all rows
        from one generator seeded with ``seed``: the same seed gives the same tokens).

        With ``eos_token_id`` (one id or several), a sequence that emits one of them is finished:
        its later tokens are ``pad_token_id`` (default: the first EOS id), and the stream ends
        once every sequence is finished, as Hugging Face's ``generate`` does. Without it, the
        stream runs ``max_new_tokens`` steps (fewer if the context fills up).

        Defaults: ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` and ``pad_token_id``
        that the caller does not pass take the model's :attr:`generation_defaults` (the
        checkpoint's ``generation_config.json``, loaded by :meth:`from_pretrained`, as
        transformers' ``generate`` takes them): its EOS ids and pad id, and its temperature,
        top-k and top-p where it samples (``do_sample``; else greedy). A model without them
        decodes greedily with no EOS id. An argument passed explicitly always wins: ``None``
        switches top-k, top-p or EOS stopping off whatever the checkpoint says.

        Raises (at the call, before any work):
            RuntimeError: not an INFERENCE build.
            ValueError, TypeError: a bad prompt, sampling parameter or token id.

        Raises (at a later step):
            RuntimeError: another call wrote the KV cache since the previous step (a prefill,
                decode, reset or other stream on this model): the stream cannot go on.
            FloatingPointError: the model's logits for a new token hold NaN or inf (in a row
                still generating), or the penalties sent all of a row's to -inf; the message
                names the step (the index of the new token) and the sequences. Nothing is
                sampled from them, and the stream ends.

        The stream holds the model (see the class docstring) from its first token until it ends,
        is closed or is garbage-collected: meanwhile the calls of other threads on this model
        wait, so close a stream you stop reading early. It may be advanced from any thread.
        """
        temperature, top_k, top_p, eos_token_id, pad_token_id = generation.with_defaults(
            self, temperature, top_k, top_p, eos_token_id, pad_token_id
        )
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
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
        )

    @serialized
    def generate(
        self,
        prompt: Any,
        max_new_tokens: int = 32,
        temperature: float | Default = DEFAULT,
        top_k: int | Default | None = DEFAULT,
        top_p: float | Default | None = DEFAULT,
        seed: int | None = None,
        *,
        eos_token_id: int | Sequence[int] | Default | None = DEFAULT,
        pad_token_id: int | Default | None = DEFAULT,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
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
        temperature, top_k, top_p, eos_token_id, pad_token_id = generation.with_defaults(
            self, temperature, top_k, top_p, eos_token_id, pad_token_id
        )
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
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
        )

    # ------------------------------------------------------------------ text
    def complete(
        self,
        prompt: str | Sequence[str],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        **processors: Any,
    ) -> str | list[str]:
        """The text generated after ``prompt`` (without the prompt), through :attr:`tokenizer`.

        Args:
            prompt: a str, or a list of strs (one text each, in order). More prompts than the
                build's batch size run in waves of ``batch_size`` prompts, one after another.
            max_new_tokens: at most this many new tokens per prompt (fewer where the context
                ends first); None: the checkpoint's ``max_new_tokens``, else 64.
            temperature, top_p, top_k: as for :meth:`stream`; None takes the checkpoint's
                default (:attr:`generation_defaults`), else greedy.
            seed: seeds the sampling (the first wave as ``stream(seed=seed)`` does, each later
                wave with a seed derived from it).
            stop: a string or strings: the text ends just before the first that appears.
            stop_token_ids: ids that end the text (left out of it), besides the EOS ids (the
                checkpoint's, else the tokenizer's).
            **processors: further arguments of :meth:`stream` (e.g. the penalties where it
                takes them), passed on where not None.

        Returns:
            a str for a str prompt, a list of strs for a list.

        Raises:
            RuntimeError: no tokenizer (load the model with :meth:`from_pretrained` from a
                folder with ``tokenizer.json``, or set :attr:`tokenizer`), or not an
                INFERENCE build.
            ValueError, TypeError: a bad argument, or a prompt longer than the context; raised
                before any work.

        :meth:`complete_detailed` returns each text with its finish reason and token counts.
        """
        done = text.complete_detailed(
            self,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            **processors,
        )
        return done[0].text if isinstance(prompt, str) else [c.text for c in done]

    def complete_detailed(
        self, prompt: str | Sequence[str], **options: Any
    ) -> list[text.Completion]:
        """:meth:`complete` with, per prompt, a :class:`~mila_py.models.text.Completion`: the
        text, the finish reason (``"stop"`` or ``"length"``) and the token counts."""
        return text.complete_detailed(self, prompt, **options)

    def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The assistant's reply to ``messages`` (dicts with ``role`` and ``content``, oldest
        first), rendered with the tokenizer's chat template (``add_generation_prompt=True``).
        The options are :meth:`complete`'s. :meth:`chat_detailed` returns a
        :class:`~mila_py.models.text.Completion`.

        Raises:
            RuntimeError, ValueError, TypeError: as :meth:`complete`; a ValueError too where
                the tokenizer has no chat template or the template refuses the messages.
        """
        return text.chat_detailed(self, messages, **options).text

    def chat_detailed(
        self, messages: Sequence[Mapping[str, Any]], **options: Any
    ) -> text.Completion:
        """:meth:`chat` as a :class:`~mila_py.models.text.Completion`."""
        return text.chat_detailed(self, messages, **options)

    def stream_text(
        self, prompt: str | Sequence[Mapping[str, Any]], **options: Any
    ) -> text.TextStream:
        """The text of one prompt (a str) or chat conversation (a list of messages), piece by
        piece as it is generated: a :class:`~mila_py.models.text.TextStream` of strs, whose
        ``finish_reason`` and token counts are set once it ends. The options are
        :meth:`complete`'s; they are checked before it returns. A piece that could be the
        start of a stop string is held back until the next tokens decide. It holds the model
        like :meth:`stream`: close it (or use ``with``) when you stop reading early.
        """
        return text.stream_text(self, prompt, **options)

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
        for i in reversed(range(len(self.layers))):
            block = self.layers[i]
            if self._recomputed is not None and self._recomputed != i:
                # recompute: the shared workspace holds another block's activations; the same
                # forward of the same kept input writes this block's again, bit for bit
                block._forward(self._block_inputs[i], 0)
                self._recomputed = i
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

        The model's :attr:`tokenizer` is the folder's ``tokenizer.json`` (with
        ``tokenizer_config.json``: special tokens, chat template), or None where it has none;
        its :attr:`generation_defaults` are ``generation_config.json``'s (EOS ids from
        ``config.json`` where that file does not name them), which :meth:`generate`,
        :meth:`stream` and the text methods use for the arguments a caller leaves out.

        The config, the arguments, the weight files' headers and the tokenizer and generation
        files are checked, and the model built, before any tensor is read; the tensors are then read one at a time, each
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
        tokenizer, defaults = hf.read_text_files(path)  # checked before any tensor is read
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
        model.tokenizer, model.generation_defaults = tokenizer, defaults
        return model


#: from_pretrained's prefill chunk: INFERENCE builds hold activations for one chunk
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
