"""Linear: ``y = x W^T + b`` with the weight in PyTorch / Hugging Face layout ``[out, in]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mila_py.build_context import BuildContext
from mila_py.components._layer import Layer, check_sizes, is_bool
from mila_py.devices import DeviceType

__all__ = ["Linear", "LinearConfig", "transposes"]


def transposes(layer: Any, in_features: int, out_features: int) -> bool:
    """Whether an INFERENCE build of ``layer`` (a component with its execution context) stores
    an ``[out, in]`` weight as ``[in, out]`` storage: for widening products
    (``in_features <= out_features``) of FP32/FP64 CPU builds only (see :class:`Linear`)."""
    cpu = layer.device_id.device_type is DeviceType.CPU
    return cpu and in_features <= out_features and not layer.precision.is_reduced


@dataclass(frozen=True)
class LinearConfig:
    """Configuration of a :class:`Linear` layer.

    Args:
        in_features: width of the input.
        out_features: width of the output.
        bias: whether the layer has a bias ``[out_features]`` (Llama projections have none).

    Raises:
        TypeError: a non-int size or a non-bool ``bias``.
        ValueError: a size that is not positive.
    """

    in_features: int
    out_features: int
    bias: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction)."""
        check_sizes(self, "in_features", "out_features")
        if not is_bool(self.bias):
            raise TypeError(f"LinearConfig: bias must be a bool, got {self.bias!r}")


class Linear(Layer):
    """Fully connected layer ``y = x W^T + b``.

    Parameters: ``weight [out_features, in_features]`` ~ Normal(0, 0.02) and, with
    ``config.bias``, ``bias [out_features]`` = 0 (when the build initializes parameters).
    INFERENCE builds of a layer that widens (``in_features <= out_features``) store the weight
    as ``[in_features, out_features]`` and expose ``weight`` as its transposed view (same shape
    and values, Fortran order): a decode step's matrix-vector product then streams it up to 15%
    faster on the CPU; narrowing layers keep ``[out, in]`` rows, faster for them. 16-bit
    (FP16, BF16) CPU builds keep ``[out, in]`` rows in every case: the decode kernel that reads
    16-bit weights (:mod:`mila_py.ops.cpu._fused_linear`) streams rows faster. CUDA builds keep
    ``[out, in]`` rows too: a decode step's products there are one kernel over those rows
    (:mod:`mila_py.ops.cuda.linear`), and cuBLAS takes either layout for the rest. A parent may
    instead hand the layer its weight as a view of a buffer it packs with others (see
    :class:`~mila_py.components.swiglu.SwiGLU`): ``weight`` is then that view, whatever its
    strides.

    The build shape is the input's, ``[B, T, in_features]`` (any number of leading dimensions);
    calls may use smaller leading dimensions. TRAINING builds own ``dinput``, which
    :meth:`backward` fills.

    Args:
        name: component name.
        config: a :class:`LinearConfig`.
        device: ``"CPU"``, ... for a standalone component; None inside a Network.
        precision: FP32, BF16 or FP16 (FP64 on the CPU); products accumulate in FP32.
    """

    _OP_NAME = "LinearOp"
    _CONFIG_TYPE = LinearConfig
    config: LinearConfig
    #: ``[out_features, in_features]`` view the next build takes as its weight instead of
    #: allocating one; set (or reset to None) by a parent just before it builds this layer
    _packed_weight: Any = None

    def _on_building(self, build_context: BuildContext) -> None:
        cfg = self.config
        lead = self._build_lead(build_context, cfg.in_features, "[B, T, in_features]")
        packed = self._packed_weight
        if packed is not None:
            if tuple(packed.shape) != (cfg.out_features, cfg.in_features):
                raise ValueError(
                    f"{self._describe()}: a packed weight must be [{cfg.out_features}, "
                    f"{cfg.in_features}], got {list(packed.shape)}"
                )
            weight = self._add_parameter("weight", packed)
        elif build_context.is_inference and transposes(self, cfg.in_features, cfg.out_features):
            # Decode multiplies one row by W^T. CPU BLAS streams a wide W^T faster from [in, out]
            # rows (the output head gains most), a tall one from [out, in] rows (down_proj; see
            # docs/performance.md). ``weight`` stays [out, in].
            storage = self._allocate((cfg.in_features, cfg.out_features))
            weight = self._add_parameter("weight", storage.T)
        else:
            weight = self._add_parameter(
                "weight", self._allocate((cfg.out_features, cfg.in_features))
            )
        if cfg.bias:
            self._add_parameter("bias", self._allocate((cfg.out_features,)))
        if build_context.should_initialize_parameters:
            self._init_normal(weight)  # the bias stays zero
        self._add_workspace("output", (*lead, cfg.out_features))
        if build_context.is_training:
            self._add_workspace("dinput", (*lead, cfg.in_features))
        self._max_lead = lead

    @property
    def weight(self) -> Any:
        """``[out_features, in_features]`` (after build)."""
        self._require_built("weight")
        return self._parameters["weight"]

    @property
    def bias(self) -> Any:
        """``[out_features]``, or None for a layer without bias (after build)."""
        self._require_built("bias")
        return self._parameters.get("bias")

    def forward(self, x: Any) -> Any:
        """``y = x W^T + b``.

        Args:
            x: ``[B', T', in_features]`` with ``B' <= B``, ``T' <= T`` of the build shape. On
                TRAINING builds it is kept (not copied) for :meth:`backward`: do not modify it.

        Returns:
            ``[B', T', out_features]``: a view of the component-owned output buffer, overwritten
            by the next forward.

        Raises:
            TypeError: ``x`` is not an array of this device and precision.
            ValueError: ``x`` has the wrong width or exceeds the build shape.
            RuntimeError: before build.
        """
        self._require_built("forward()")
        self._check_floats(x, "x", self.config.in_features)
        return self._forward(x)

    def _forward(self, x: Any) -> Any:
        """:meth:`forward` without the input checks, for a parent passing a buffer it owns (or
        one it has checked): this device and dtype, ``[*lead, in_features]`` within the build."""
        y = self._view("output", (*x.shape[:-1], self.config.out_features))
        self._op.forward(x, self._parameters["weight"], self._parameters.get("bias"), y)
        if self._build_context.is_training:  # type: ignore[union-attr]
            self._saved = x
        return y

    def _bind_forward(self, x: Any) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that compute :meth:`forward` of the buffer ``x`` (its values
        at call time) into the output view ``y``, for a decode plan (INFERENCE builds)."""
        y = self._view("output", (*x.shape[:-1], self.config.out_features))
        weight, bias = self._parameters["weight"], self._parameters.get("bias")
        return [self._op.bind_forward(x, weight, bias, y)], y

    def backward(self, dy: Any) -> Any:
        """Accumulate ``dW += dy^T x`` (and ``db += sum(dy)``); return ``dx = dy W``.

        Args:
            dy: ``[B', T', out_features]``, the gradient of the last forward's output.

        Returns:
            ``[B', T', in_features]``: a view of the component-owned ``dinput`` buffer,
            overwritten by the next backward.

        Raises:
            RuntimeError: on INFERENCE builds, or before any forward.
            TypeError, ValueError: ``dy`` does not match the last forward's output.
        """
        self._require_backward()
        x = self._saved
        self._check_grad(dy, "dy", (*x.shape[:-1], self.config.out_features))
        dx = self._view("dinput", tuple(x.shape))
        self._op.backward(
            x,
            self._parameters["weight"],
            dy,
            self._gradients["weight"],
            self._gradients.get("bias"),
            dx,
        )
        return dx

    def _extra_repr(self) -> str:
        cfg = self.config
        return f"in={cfg.in_features}, out={cfg.out_features}, bias={cfg.bias}"
