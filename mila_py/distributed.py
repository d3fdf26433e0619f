"""Data parallelism: one model replica per process, gradients averaged across the processes.

Every process (an MPI *rank*) builds the same model, starts from rank 0's parameters
(:func:`broadcast_parameters`), runs forward and backward on its own share of the global batch,
and averages the gradients with every other rank (:class:`GradientAllReduce`) before the
optimizer step, so that every rank applies the same update and the replicas stay equal. With
equal shares per rank, the average of the ranks' mean-loss gradients is the gradient of the
mean loss over the global batch: ``N`` ranks with ``B`` sequences each train as one process
with ``N * B``.

The processes are started by an MPI launcher (``mpirun -n 2 python train.py``) and talk over
MPI through mpi4py (``pip install mpi4py mpich``), imported only when :func:`init_world` is
called. Without mpi4py, or with a single rank, :func:`init_world` returns a single-process
:class:`World`, on which every call here does nothing, so one script runs with and without MPI.

On CPUs the gradients travel through MPI itself (``Iallreduce`` on NumPy buffers). On GPUs
(one per rank, chosen by the rank's index on its node: :meth:`World.device`) they travel
through NCCL, called through CuPy (``cupy.cuda.nccl``); MPI only hands NCCL's unique id from
rank 0 to the others.

On one GPU, ``GradientAllReduce(model, World(), backend="nccl")`` runs the GPU path over a
communicator of one rank (NCCL's sum over one rank returns the gradients as they are): a way to
test and time it without a second GPU.

Only rank 0 writes checkpoints and logs: guard those with :func:`is_main`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any, cast

import numpy as np

from mila_py.component import Component
from mila_py.devices import CudaExecutionContext, DeviceType
from mila_py.devices.cuda import cuda_device_count
from mila_py.memory import MemoryCategory, MemoryLocation, MemoryStats

__all__ = [
    "BACKENDS",
    "GradientAllReduce",
    "World",
    "broadcast_parameters",
    "import_mpi",
    "init_world",
    "is_main",
]

_INSTALL_HINT = (
    'install them with `pip install mpi4py mpich` (or `pip install -e ".[dist]"` in the '
    "mila_py checkout), or use the MPI library of your cluster with `pip install mpi4py`"
)

#: the variables an MPI launcher sets to the number of ranks it started (MPICH and Intel MPI's
#: hydra, Open MPI, MVAPICH): a process that sees one of them > 1 is one of several ranks
_LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")

#: default bytes of gradients averaged in one all-reduce (as PyTorch's DDP)
DEFAULT_BUCKET_BYTES = 25 * 2**20

#: what :class:`GradientAllReduce` sums through: ``"auto"`` (MPI on CPUs, NCCL on GPUs, nothing
#: in a single-process world) or ``"nccl"`` (NCCL, in a single-process world too)
BACKENDS = ("auto", "nccl")


def import_mpi() -> ModuleType:
    """``mpi4py.MPI`` (importing it initializes MPI).

    Raises:
        ImportError: mpi4py, or the MPI library it loads, is missing; the message says how to
            install them.
    """
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:  # RuntimeError: mpi4py finds no MPI library
        raise ImportError(
            f"data parallelism over MPI needs mpi4py and an MPI library ({exc}): {_INSTALL_HINT}"
        ) from exc
    return MPI


class World:
    """The processes of a data-parallel run and this process's place among them.

    ``World()`` is the single-process world (rank 0 of 1), on which every collective call of
    this module does nothing (but a ``GradientAllReduce`` made with ``backend="nccl"``);
    :func:`init_world` makes the world of an MPI launch.

    Args:
        rank: this process's index, ``0 <= rank < size``.
        size: the number of processes.
        local_rank: this process's index among the processes on its node.
        local_size: the number of processes on its node.
        comm: the ``mpi4py`` communicator of the ``size`` processes (None for one process).

    Raises:
        TypeError, ValueError: a value that is not an int in range, or a world of several
            processes without a communicator.
    """

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        local_size: int = 1,
        comm: Any = None,
    ) -> None:
        values = {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"World: {name} must be an int, got {value!r}")
        if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
            raise ValueError(
                f"World: need 0 <= rank < size and 0 <= local_rank < local_size <= size, got "
                f"rank={rank}, size={size}, local_rank={local_rank}, local_size={local_size}"
            )
        if size > 1 and comm is None:
            raise ValueError(f"World: a world of {size} processes needs their communicator")
        self._rank, self._size = int(rank), int(size)
        self._local_rank, self._local_size = int(local_rank), int(local_size)
        self._comm = comm
        self._nccl: dict[int, Any] = {}  # NCCL communicators by GPU index, made on first use

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int:
        """This process's index among the processes on its node (its GPU's index)."""
        return self._local_rank

    @property
    def local_size(self) -> int:
        return self._local_size

    @property
    def comm(self) -> Any:
        """The mpi4py communicator (None in a single-process world)."""
        return self._comm

    @property
    def is_distributed(self) -> bool:
        """Whether there are other processes (``size > 1``)."""
        return self._size > 1

    def device(self) -> str:
        """The device this rank trains on: ``"CUDA:<local_rank>"`` where CuPy sees GPUs (one
        GPU per rank on each node), else ``"CPU"``.

        Raises:
            RuntimeError: the node has GPUs, but fewer than the ranks started on it.
        """
        gpus = cuda_device_count()
        if gpus == 0:
            return "CPU"
        if self._local_rank >= gpus:
            raise RuntimeError(
                f"World.device: rank {self._rank} is rank {self._local_rank} of "
                f"{self._local_size} on its node, which has {gpus} GPU(s): start at most "
                f"{gpus} ranks per node (one GPU each)"
            )
        return f"CUDA:{self._local_rank}"

    def barrier(self) -> None:
        """Wait until every rank has called it (nothing to wait for in one process)."""
        if self._comm is not None:
            self._comm.Barrier()

    def _nccl_communicator(self, context: Any) -> Any:
        """The NCCL communicator of every rank's GPU, made on first use (a collective call:
        every rank makes it at the same point): rank 0 creates the unique id, MPI broadcasts
        it (pickled: ``bytes`` from CuPy >= 14, a tuple of ints before, each what its
        ``NcclCommunicator`` takes), and each rank joins with the GPU of ``context`` current.
        A single-process world without a communicator makes a communicator of one rank.

        Raises:
            RuntimeError: CuPy finds no NCCL library.
        """
        index = context.device_id.index
        communicator = self._nccl.get(index)
        if communicator is None:
            nccl = _import_nccl()
            unique_id = nccl.get_unique_id() if self._rank == 0 else None
            if self._comm is not None:
                unique_id = self._comm.bcast(unique_id, root=0)
            with context.device:
                communicator = nccl.NcclCommunicator(self._size, unique_id, self._rank)
            self._nccl[index] = communicator
        return communicator

    def __repr__(self) -> str:
        return (
            f"World(rank={self._rank}, size={self._size}, local_rank={self._local_rank}, "
            f"local_size={self._local_size})"
        )


def _import_nccl() -> ModuleType:
    """``cupy.cuda.nccl``, where CuPy found the NCCL library.

    Raises:
        RuntimeError: CuPy was built or installed without NCCL (``nccl.available`` is False).
    """
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise RuntimeError(
            "data parallelism on GPUs needs NCCL, and CuPy finds no NCCL library: install the "
            "NCCL of CuPy's CUDA version (CuPy's installation guide, 'Additional CUDA Libraries')"
        )
    return nccl


def _launcher_size() -> tuple[str, int] | None:
    """``(variable, ranks)`` when an MPI launcher says it started more than one rank."""
    for name in _LAUNCHER_SIZE_VARIABLES:
        try:
            ranks = int(os.environ.get(name, ""))
        except ValueError:
            continue
        if ranks > 1:
            return name, ranks
    return None


def init_world() -> World:
    """The world of this process: MPI's ``COMM_WORLD`` when mpi4py is installed and the process
    was launched as one of several ranks, else the single-process ``World()``.

    The local rank (a rank's index on its node, which picks its GPU) comes from splitting
    ``COMM_WORLD`` by shared memory, so it holds for any launcher.

    Raises:
        ImportError: an MPI launcher started several ranks (``PMI_SIZE``,
            ``OMPI_COMM_WORLD_SIZE`` or ``MV2_COMM_WORLD_SIZE`` > 1) but mpi4py cannot be
            imported: each rank would otherwise train alone, on its own data. The message says
            how to install it.
    """
    try:
        mpi = import_mpi()
    except ImportError as exc:
        launched = _launcher_size()
        if launched is not None:
            name, ranks = launched
            raise ImportError(
                f"init_world: this process is one of {ranks} ranks of an MPI launch "
                f"({name}={ranks}), but mpi4py cannot be imported, so each rank would train "
                f"alone: {_INSTALL_HINT}"
            ) from exc
        return World()
    comm = mpi.COMM_WORLD
    if comm.Get_size() == 1:
        return World()
    node = comm.Split_type(mpi.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    return World(comm.Get_rank(), comm.Get_size(), local_rank, local_size, comm)


def is_main(world: World | None = None) -> bool:
    """Whether this process is rank 0, the one that writes checkpoints and logs (True in a
    single-process world, and for ``world=None``)."""
    if world is None:
        return True
    if not isinstance(world, World):
        raise TypeError(f"is_main: world must be a World or None, got {world!r}")
    return world.rank == 0


def _check_model(model: Any, who: str) -> None:
    if not isinstance(model, Component):
        raise TypeError(f"{who}: model must be a built Component, got {type(model).__name__}")
    if not model.is_built:
        raise RuntimeError(f"{who}: {model._describe()} is not built: build it first")


def _check_world(world: Any, who: str) -> None:
    if not isinstance(world, World):
        raise TypeError(f"{who}: world must be a World (see init_world), got {world!r}")


def _check_same_model(
    world: World, entries: list[tuple[str, tuple[int, ...], str]], who: str
) -> None:
    """Raise ValueError on every rank unless every rank passed the same ``entries`` (names,
    shapes, dtypes): a collective over different buffers would hang or mix them. Every rank
    compares the same gathered lists, so all raise together."""
    gathered = world.comm.allgather(entries)
    differing = [rank for rank, theirs in enumerate(gathered) if theirs != gathered[0]]
    if differing:
        first = differing[0]
        mine, theirs = gathered[0], gathered[first]
        detail = next(
            (
                f"{a} on rank 0, {b} on rank {first}"
                for a, b in zip(mine, theirs, strict=False)
                if a != b
            ),
            f"{len(mine)} tensors on rank 0, {len(theirs)} on rank {first}",
        )
        raise ValueError(
            f"{who}: the ranks' models differ (ranks {differing} from rank 0: {detail}); every "
            "rank must build the same model with the same build shape"
        )


def _distinct(arrays: Iterator[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(name, array)`` of each distinct array once (a shared one under its first name)."""
    seen: set[int] = set()
    out = []
    for name, array in arrays:
        if id(array) not in seen:
            seen.add(id(array))
            out.append((name, array))
    return out


def _signature(named: list[tuple[str, Any]]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(int(n) for n in a.shape), str(a.dtype)) for name, a in named]


def broadcast_parameters(model: Component, world: World, root: int = 0) -> None:
    """Copy rank ``root``'s parameters into every rank's ``model``, so that all start equal.

    A collective call: every rank calls it with the same model (built alike); nothing happens
    in a single-process world. On a GPU the copy runs on the model's stream through NCCL.

    Raises:
        TypeError: ``model`` is not a Component or ``world`` not a World.
        RuntimeError: ``model`` is not built.
        ValueError: ``root`` is not a rank, or the ranks' parameters differ in name, shape or
            dtype (raised on every rank, before anything is copied).
    """
    who = "broadcast_parameters"
    _check_model(model, who)
    _check_world(world, who)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world.size:
        raise ValueError(f"{who}: root must be a rank in [0, {world.size}), got {root!r}")
    if not world.is_distributed:
        return
    params = _distinct(model.named_parameters())
    _check_same_model(world, _signature(params), who)
    ctx = model.execution_context
    if ctx.device_type is DeviceType.CPU:
        mpi = import_mpi()
        for _, p in params:
            # as bytes: any dtype (bfloat16 too) travels unchanged
            world.comm.Bcast([p.reshape(-1).view(np.uint8), mpi.BYTE], root=root)
        return
    nccl = _import_nccl()
    stream = cast(CudaExecutionContext, ctx).stream
    communicator = world._nccl_communicator(ctx)
    with ctx.activate():
        for _, p in params:
            communicator.bcast(p.data.ptr, p.nbytes, nccl.NCCL_UINT8, root, stream.ptr)


class _Bucket:
    """Gradients averaged in one all-reduce: ``grads`` (consecutive in parameter order),
    packed at ``offsets`` into the flat ``buffer``; ``first`` is the lowest parameter index."""

    __slots__ = ("buffer", "first", "grads", "handle", "launched", "offsets", "stale")

    def __init__(self, first: int, grads: list[Any], offsets: list[int], buffer: Any) -> None:
        self.first, self.grads, self.offsets, self.buffer = first, grads, offsets, buffer
        self.handle: Any = None  # the MPI request of a CPU bucket in flight
        self.launched = False  # its all-reduce is under way (not finished)
        self.stale = False  # its gradients changed since it was launched

    def pack(self, xp: Any) -> None:
        for grad, offset in zip(self.grads, self.offsets, strict=True):
            view = self.buffer[offset : offset + grad.size].reshape(grad.shape)
            xp.copyto(view, grad, casting="unsafe")

    def unpack(self, xp: Any, scale: float) -> None:
        self.buffer *= scale
        for grad, offset in zip(self.grads, self.offsets, strict=True):
            view = self.buffer[offset : offset + grad.size].reshape(grad.shape)
            xp.copyto(grad, view, casting="unsafe")


class _MpiEngine:
    """All-reduce of NumPy buckets over MPI: nonblocking ``Iallreduce`` in place."""

    def __init__(self, world: World) -> None:
        self._mpi = import_mpi()
        self._comm = world.comm

    def launch(self, bucket: _Bucket) -> None:
        bucket.pack(np)
        bucket.handle = self._comm.Iallreduce(self._mpi.IN_PLACE, bucket.buffer, op=self._mpi.SUM)

    def progress(self, buckets: list[_Bucket]) -> None:
        # An MPI without a progress thread moves a nonblocking collective along only inside MPI
        # calls: testing the requests between two blocks' backward is such a call.
        handles = [b.handle for b in buckets if b.handle is not None]
        if handles:
            self._mpi.Request.Testall(handles)

    def drop(self, bucket: _Bucket) -> None:
        """Wait out a stale all-reduce (its buffer is about to be packed again)."""
        bucket.handle.Wait()
        bucket.handle = None

    def finish(self, buckets: list[_Bucket], scale: float) -> None:
        for bucket in buckets:
            bucket.handle.Wait()
            bucket.handle = None
            bucket.unpack(np, scale)


class _NcclEngine:
    """All-reduce of CuPy buckets through NCCL on a stream of its own, ordered after the
    model's stream by events, so that it runs while earlier blocks' backward runs.

    The calls are CuPy's ``cupy.cuda.nccl`` (``cupy_backends/cuda/libs/nccl.pyx``): pointers
    and the stream as ints (``.data.ptr``, ``.ptr``), the count in elements of the NCCL dtype.
    A one-rank communicator runs it on one GPU; between GPUs it has not run."""

    def __init__(self, world: World, ctx: Any) -> None:
        nccl = _import_nccl()
        self._nccl = nccl
        self._ctx = ctx
        self._cupy = ctx.xp
        self._communicator = world._nccl_communicator(ctx)
        with ctx.device:
            self._stream = self._cupy.cuda.Stream(non_blocking=True)

    def _dtype(self, buffer: Any) -> int:
        return self._nccl.NCCL_FLOAT64 if buffer.dtype == np.float64 else self._nccl.NCCL_FLOAT32

    def launch(self, bucket: _Bucket) -> None:
        cupy, ctx = self._cupy, self._ctx
        with ctx.device:
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(ctx.stream)  # after the backward that made the gradients final
            self._stream.wait_event(ready)
            with self._stream:
                bucket.pack(cupy)
            ptr = bucket.buffer.data.ptr
            self._communicator.allReduce(
                ptr, ptr, bucket.buffer.size, self._dtype(bucket.buffer), self._nccl.NCCL_SUM,
                self._stream.ptr,
            )  # fmt: skip

    def progress(self, buckets: list[_Bucket]) -> None:
        """Nothing to do: NCCL runs on its stream by itself."""

    def drop(self, bucket: _Bucket) -> None:
        """Nothing to wait for: the next pack is ordered after it on the stream."""

    def finish(self, buckets: list[_Bucket], scale: float) -> None:
        cupy, ctx = self._cupy, self._ctx
        with ctx.device:
            with self._stream:
                for bucket in buckets:
                    bucket.unpack(cupy, scale)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(self._stream)
            ctx.stream.wait_event(done)  # the optimizer runs after the gradients are back


class GradientAllReduce:
    """Average the parameter gradients of ``model`` across the ranks of ``world``, in buckets.

    The gradients are grouped, last parameters first (the order backward finishes them), into
    buckets of about ``bucket_bytes``. Each bucket is copied into a flat buffer of its own,
    summed across the ranks by one all-reduce, scaled by ``1 / world.size`` and copied back.
    Calling the object (``allreduce(model)``, after the last micro-batch's backward and before
    the gradients are clipped or stepped) leaves the average of every rank's gradients in
    every rank's gradient buffers.

    The copies cost two passes over the gradients per step and buffers the size of the
    gradients (:meth:`get_memory_stats`); in exchange the model's own gradient buffers stay
    the arrays its components allocated, which optimizers and other code already hold, and
    16-bit gradients are summed in FP32 (buckets are FP32, or FP64 for FP64 gradients).

    Overlap: with ``overlap=True`` on a network that calls its
    :attr:`~mila_py.composite.Network.block_backward_hooks` (a Llama), a bucket is launched
    (nonblocking) as soon as the blocks that own its gradients have run backward, so its
    transfer runs while the earlier blocks compute; calling the object launches the rest and
    waits. Launches in a backward whose gradients are not the step's last (gradient
    accumulation) are redone: wrap the earlier micro-batches' backward in :meth:`no_sync` to
    skip them. On CPUs the transfer advances while MPI is called (the object polls it between
    blocks) or by itself with an MPI progress thread (MPICH: ``MPIR_CVAR_ASYNC_PROGRESS=1``),
    which takes a core of its own.

    Every rank constructs it, and calls it, at the same points (collective calls). In a
    single-process world it does nothing and allocates nothing, unless ``backend="nccl"``:
    then a model on a GPU goes through the whole GPU path (buckets, copies, the NCCL
    all-reduce of a one-rank communicator, the scaling by 1), and trains as it would without.

    Args:
        model: a built TRAINING component (a :class:`~mila_py.components.Llama`).
        world: the ranks (:func:`init_world`).
        bucket_bytes: bytes of (FP32) gradients per all-reduce; a larger gradient gets a
            bucket of its own.
        overlap: launch buckets during backward (needs the network's block hooks).
        backend: one of :data:`BACKENDS`: ``"auto"`` sums through MPI on CPUs and NCCL on
            GPUs, and skips a single-process world; ``"nccl"`` needs a model on a GPU and
            sums through NCCL in every world, one of a single process included.

    Raises:
        TypeError: a wrong argument type.
        RuntimeError: ``model`` is not built for TRAINING, or (``overlap=True``) another
            GradientAllReduce already launches during its backward (:meth:`detach` it), or
            CuPy finds no NCCL library.
        ValueError: ``bucket_bytes`` is not > 0, ``backend`` is not one of :data:`BACKENDS`
            (or ``"nccl"`` for a model on the CPU), or the ranks' models differ (raised on
            every rank); on a GPU, bfloat16 gradients carried as ``uint16`` (a CuPy without
            bfloat16).
    """

    def __init__(
        self,
        model: Component,
        world: World,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        overlap: bool = True,
        backend: str = "auto",
    ) -> None:
        who = "GradientAllReduce"
        _check_model(model, who)
        _check_world(world, who)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int | np.integer):
            raise TypeError(f"{who}: bucket_bytes must be an int, got {bucket_bytes!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"{who}: bucket_bytes must be > 0, got {bucket_bytes}")
        if not isinstance(overlap, bool):
            raise TypeError(f"{who}: overlap must be a bool, got {overlap!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
        named = _distinct((name, g) for name, _, g in model.named_parameter_gradients())
        if not named:
            raise RuntimeError(
                f"{who}: {model._describe()} has no parameter gradients: build it with "
                "RuntimeMode.TRAINING"
            )
        ctx = model.execution_context
        on_cpu = ctx.device_type is DeviceType.CPU
        if backend == "nccl" and on_cpu:
            raise ValueError(
                f"{who}: backend='nccl' sums on GPUs, but {model._describe()} is on "
                f"{model.device_id}: use backend='auto' (MPI) for a model on the CPU"
            )
        if not on_cpu and any(g.dtype == np.uint16 for _, g in named):
            raise ValueError(
                f"{who}: {model._describe()} carries bfloat16 gradients as uint16 (a CuPy "
                "without bfloat16), which NCCL cannot sum: install CuPy >= 14"
            )
        self.model = model
        self.world = world
        self.bucket_bytes = int(bucket_bytes)
        self.overlap = overlap
        self.backend = backend
        #: buckets the last call found launched during backward (by the block hooks)
        self.last_early_launches = 0
        self._grads = [g for _, g in named]
        self._buckets: list[_Bucket] = []
        self._engine: Any = None
        self._sync = True
        self._last_first = -1  # the first gradient index of the last block hooked (-1: none)
        self._first_index: dict[int, int | None] = {}  # id(block) -> its first gradient index
        if not world.is_distributed and backend != "nccl":
            return
        if overlap:
            self._refuse_second(model, who)
        if world.is_distributed:
            _check_same_model(world, _signature(named), who)
        self._engine = _MpiEngine(world) if on_cpu else _NcclEngine(world, ctx)
        with ctx.activate():
            self._buckets = self._make_buckets(ctx)
        hooks = getattr(model, "block_backward_hooks", None)
        if overlap and isinstance(hooks, list):
            hooks.append(self._on_block_backward)

    @staticmethod
    def _refuse_second(model: Component, who: str) -> None:
        """Raise RuntimeError if another GradientAllReduce launches during ``model``'s
        backward: both would send every bucket, and the other's would never be waited for."""
        for hook in getattr(model, "block_backward_hooks", None) or ():
            if isinstance(getattr(hook, "__self__", None), GradientAllReduce):
                raise RuntimeError(
                    f"{who}: {model._describe()} already has a GradientAllReduce that launches "
                    "during its backward: use that one, or detach() it first"
                )

    def _make_buckets(self, ctx: Any) -> list[_Bucket]:
        """Consecutive gradients, last first, up to ``bucket_bytes`` each, one dtype each."""
        groups: list[list[int]] = []
        size = 0
        for index in reversed(range(len(self._grads))):
            dtype = _bucket_dtype(self._grads[index].dtype)
            nbytes = self._grads[index].size * dtype.itemsize
            same = bool(groups) and _bucket_dtype(self._grads[groups[-1][0]].dtype) == dtype
            if not (same and size + nbytes <= self.bucket_bytes):
                groups.append([])
                size = 0
            groups[-1].append(index)
            size += nbytes
        buckets = []
        for group in groups:
            grads = [self._grads[i] for i in reversed(group)]  # parameter order inside
            offsets = np.cumsum([0] + [g.size for g in grads]).tolist()
            buffer = ctx.allocate((offsets[-1],), _bucket_dtype(grads[0].dtype), zero=False)
            buckets.append(_Bucket(min(group), grads, offsets[:-1], buffer))
        return buckets

    # ------------------------------------------------------------------ properties
    @property
    def bucket_count(self) -> int:
        """All-reduces per step (0 in a single-process world, unless ``backend="nccl"``)."""
        return len(self._buckets)

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes each bucket's all-reduce sums, in launch order."""
        return [int(b.buffer.nbytes) for b in self._buckets]

    def get_memory_stats(self) -> MemoryStats:
        """The bucket buffers, counted as gradient memory on the model's device."""
        return MemoryStats.from_arrays(
            (MemoryCategory.GRADIENTS, MemoryLocation.DEVICE, b.buffer) for b in self._buckets
        )

    # ------------------------------------------------------------------ overlap
    def _block_first_index(self, block: Component) -> int | None:
        """The lowest index (in the model's gradient order) of ``block``'s gradients."""
        key = id(block)
        if key not in self._first_index:
            position = {id(g): i for i, g in enumerate(self._grads)}
            found = (position.get(id(g)) for _, _, g in block.named_parameter_gradients())
            indices = [i for i in found if i is not None]
            self._first_index[key] = min(indices) if indices else None
        return self._first_index[key]

    def _on_block_backward(self, block: Component) -> None:
        """After ``block``'s backward: launch every bucket whose gradients are now final."""
        first = self._block_first_index(block)
        if first is None:
            return
        if first >= self._last_first:
            # blocks run last to first in one backward: this is a new backward, which adds to
            # every gradient, so what earlier ones launched no longer holds them
            for bucket in self._buckets:
                bucket.stale = bucket.launched
        self._last_first = first
        if not self._sync:
            return
        for bucket in self._buckets:  # in launch order: from the last parameters down
            if bucket.first < first:
                break
            if not bucket.launched or bucket.stale:
                self._launch(bucket)
        self._engine.progress([b for b in self._buckets if b.launched])

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.stale:
            self._engine.drop(bucket)
        self._engine.launch(bucket)
        bucket.launched, bucket.stale = True, False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Launch nothing during the backward passes inside (the earlier micro-batches of an
        accumulated step, whose gradients are not final), as PyTorch's ``DDP.no_sync``."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------ the step
    def __call__(self, model: Component | None = None) -> None:
        """Average the gradients across the ranks: launch the buckets not launched yet (or
        changed since), wait for all, and write ``sum / world.size`` into every gradient.

        Args:
            model: the model this object was made for (the training loop's hook passes it);
                None means that one.

        Raises:
            ValueError: ``model`` is another model (nothing is done).
        """
        if model is not None and model is not self.model:
            raise ValueError(
                f"GradientAllReduce: called with {_describe(model)}, but it averages the "
                f"gradients of {self.model._describe()}"
            )
        if not self._buckets:
            return
        lock = getattr(self.model, "run_lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            ctx = self.model.execution_context
            early = sum(b.launched and not b.stale for b in self._buckets)
            with ctx.activate():
                for bucket in self._buckets:
                    if not bucket.launched or bucket.stale:
                        self._launch(bucket)
                self._engine.finish(self._buckets, 1.0 / self.world.size)
            for bucket in self._buckets:
                bucket.launched = bucket.stale = False
            self._last_first = -1
            self.last_early_launches = early

    def detach(self) -> None:
        """Stop launching during backward: remove the hook from the model (every launched
        all-reduce is waited out and dropped; the next call reduces everything)."""
        hooks = getattr(self.model, "block_backward_hooks", None)
        if isinstance(hooks, list) and self._on_block_backward in hooks:
            hooks.remove(self._on_block_backward)
        for bucket in self._buckets:
            if bucket.launched:
                self._engine.drop(bucket)
                bucket.launched = bucket.stale = False
        self._last_first = -1

    def __repr__(self) -> str:
        return (
            f"GradientAllReduce({self.model._describe()}, {self.world!r}, "
            f"{self.bucket_count} buckets of <= {self.bucket_bytes:,} bytes, "
            f"overlap={self.overlap}, backend={self.backend!r})"
        )


def _bucket_dtype(dtype: Any) -> np.dtype:
    """FP64 gradients sum in FP64; every other float (FP32, FP16, BF16) in FP32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _describe(obj: Any) -> str:
    return obj._describe() if isinstance(obj, Component) else repr(obj)
