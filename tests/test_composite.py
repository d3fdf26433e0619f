"""mila_py.composite: CompositeComponent and Network."""

from __future__ import annotations

import numpy as np
import pytest

from mila_py import (
    BuildContext,
    Component,
    CompositeComponent,
    DeviceId,
    MemoryStats,
    Network,
    Precision,
    RuntimeMode,
    TrainingMode,
    devices,
)
from mila_py.components import LinearConfig
from mila_py.devices import create_execution_context
from mila_py.ops.registry import create_op

TRAIN = RuntimeMode.TRAINING
INFER = RuntimeMode.INFERENCE


def train_ctx(*shape: int) -> BuildContext:
    return BuildContext(shape or (2, 4), TRAIN)


def infer_ctx(*shape: int) -> BuildContext:
    return BuildContext(shape or (2, 4), INFER)


# ---------------------------------------------------------------------------- test components
class Linear(Component):
    """A weight (out, in) and a bias (out,)."""

    def __init__(self, name: str, in_features: int = 4, out_features: int = 4, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.in_features = in_features
        self.out_features = out_features

    def _on_building(self, build_context: BuildContext) -> None:
        self._add_parameter("weight", self._allocate((self.out_features, self.in_features)))
        self._add_parameter("bias", self._allocate((self.out_features,)))


class Recorder(Component):
    """Records hook calls; may fail the context hook, the build or one mode switch."""

    def __init__(
        self, name: str, *, fail_context=False, fail_build=False, fail_mode=None, **kwargs
    ) -> None:
        super().__init__(name, **kwargs)
        self.calls: list[tuple] = []
        self.fail_context = fail_context
        self.fail_build = fail_build
        self.fail_mode = fail_mode

    def _on_execution_context_set(self) -> None:
        self.calls.append(("context", self.execution_context))
        if self.fail_context:
            raise RuntimeError(f"{self.name}: simulated context failure")

    def _on_building(self, build_context: BuildContext) -> None:
        self._add_parameter("w", self._allocate((2, 2)))
        self.calls.append(("build", build_context))
        if self.fail_build:
            raise RuntimeError(f"{self.name}: simulated build failure")

    def _on_training_mode_changing(self, mode: TrainingMode) -> None:
        self.calls.append(("mode", mode))
        if mode is self.fail_mode:
            raise RuntimeError(f"{self.name}: simulated mode failure")


class SharedTable(Component):
    """Registers a state table that several components may share (like RoPE's cos/sin cache)."""

    def __init__(self, name: str, table_holder: dict, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.table_holder = table_holder

    def _on_building(self, build_context: BuildContext) -> None:
        if "table" not in self.table_holder:
            self.table_holder["table"] = self._allocate((32, 8))  # 1024 B in FP32
        self._add_state("table", self.table_holder["table"])
        self._add_state("own", self._allocate((4,)))  # 16 B each


def block(name: str, *children: Component) -> CompositeComponent:
    composite = CompositeComponent(name)
    for child in children:
        composite.add_component(child)
    return composite


def mlp_network(device: str = "CPU") -> Network:
    """net -> [embed(4x8+8), block -> [fc1(8x16+16), fc2(16x8+8)], head(8x2+2)]."""
    return (
        Network("net", device=device)
        .add_component(Linear("embed", 8, 4))
        .add_component(block("block", Linear("fc1", 8, 16), Linear("fc2", 16, 8)))
        .add_component(Linear("head", 2, 8))
    )


EXPECTED_NAMES = [
    "embed.weight",
    "embed.bias",
    "block.fc1.weight",
    "block.fc1.bias",
    "block.fc2.weight",
    "block.fc2.bias",
    "head.weight",
    "head.bias",
]
EXPECTED_SHAPES = [(4, 8), (4,), (16, 8), (16,), (8, 16), (8,), (8, 2), (8,)]


# ---------------------------------------------------------------------------- children
def test_children_keep_insertion_order() -> None:
    comp = CompositeComponent("c")
    names = ["zeta", "alpha", "mid", "beta"]
    for name in names:
        comp.add_component(Component(name))
    assert [child.name for child in comp] == names
    assert list(comp.components) == names
    assert len(comp) == 4


def test_add_component_is_chainable() -> None:
    comp = CompositeComponent("c")
    a, b = Component("a"), Component("b")
    assert comp.add_component(a) is comp
    assert comp.add_component(a.__class__("c2")).add_component(b) is comp
    assert comp.get_component("a") is a
    assert comp.get_component("b") is b


def test_components_is_a_copy() -> None:
    comp = block("c", Component("a"))
    copy = comp.components
    copy.clear()
    assert comp.has_component("a")
    assert len(comp) == 1


def test_duplicate_child_name_raises_and_keeps_the_first() -> None:
    comp = CompositeComponent("c")
    first = Component("x")
    comp.add_component(first)
    with pytest.raises(ValueError, match=r"'c'.*'x'"):
        comp.add_component(Component("x"))
    assert comp.get_component("x") is first
    assert len(comp) == 1


def test_child_with_a_context_is_refused() -> None:
    comp = CompositeComponent("c")
    standalone = Linear("lin", device="CPU")
    with pytest.raises(RuntimeError, match=r"lin.*execution context"):
        comp.add_component(standalone)
    assert len(comp) == 0


def test_add_non_component_raises_type_error() -> None:
    comp = CompositeComponent("c")
    with pytest.raises(TypeError):
        comp.add_component("child")  # type: ignore[arg-type]


def test_cycles_are_refused() -> None:
    outer = CompositeComponent("outer")
    inner = CompositeComponent("inner")
    outer.add_component(inner)
    with pytest.raises(ValueError, match="cycle"):
        outer.add_component(outer)
    with pytest.raises(ValueError, match="cycle"):
        inner.add_component(outer)
    assert len(inner) == 0


def test_add_after_build_raises() -> None:
    net = Network("net").add_component(Linear("a"))
    net.build(train_ctx())
    with pytest.raises(RuntimeError, match=r"net.*built"):
        net.add_component(Linear("b"))
    assert list(net.components) == ["a"]


def test_get_component_raises_key_error_listing_children() -> None:
    comp = block("c", Component("alpha"), Component("beta"))
    with pytest.raises(KeyError, match=r"gamma.*alpha.*beta"):
        comp.get_component("gamma")
    assert not comp.has_component("gamma")
    assert comp.has_component("alpha")


def test_find_component_by_dotted_path() -> None:
    leaf = Component("c")
    tree = block("root", block("a", block("b", leaf), Component("sibling")))
    assert tree.find_component("a.b.c") is leaf
    assert tree.find_component("a") is tree.get_component("a")
    assert tree.find_component("a.sibling").name == "sibling"
    with pytest.raises(KeyError, match="missing"):
        tree.find_component("a.missing.c")
    with pytest.raises(KeyError, match=r"'a\.b\.c\.d'"):
        tree.find_component("a.b.c.d")  # c is a leaf: it has no children
    with pytest.raises(KeyError):
        tree.find_component("")


def test_find_component_names_how_far_the_path_resolved() -> None:
    tree = block("root", block("a", block("b", Component("c")), Component("sibling")))
    with pytest.raises(KeyError, match=r"'a' \(CompositeComponent 'a'\) has no 'missing\.c' "
                                       r"\(its children: \['b', 'sibling'\]\)"):  # fmt: skip
        tree.find_component("a.missing.c")
    with pytest.raises(
        KeyError, match=r"'a\.b\.c' \(Component 'c'\) has no 'd' \(its children: \[\]\)"
    ):
        tree.find_component("a.b.c.d")
    with pytest.raises(KeyError, match=r": it has no 'x\.y' \(its children: \['a'\]\)"):
        tree.find_component("x.y")
    dotted = Network("net").add_component(block("a.b", Component("c")))
    with pytest.raises(KeyError, match=r"'a\.b' \(CompositeComponent 'a\.b'\) has no 'x'"):
        dotted.find_component("a.b.x")  # the child named "a.b" is a step, not "a"


class ReleaseFails(Component):
    """Its release hook raises once its op is gone (an op-dropping hook that fails midway)."""

    def _on_execution_context_set(self) -> None:
        self.op = create_op("LinearOp", self.execution_context, LinearConfig(2, 2), self.precision)

    def _on_execution_context_released(self) -> None:
        super()._on_execution_context_released()
        raise RuntimeError(f"{self.name}: simulated release failure")

    def _on_building(self, build_context: BuildContext) -> None:
        pass


def test_a_failing_release_leaves_the_children_in_place_as_they_were() -> None:
    keep, bad = Linear("keep"), ReleaseFails("bad")
    inner = block("inner", ReleaseFails("deep"))
    net = Network("net", device="CPU").add_component(keep).add_component(bad)
    net.add_component(inner)
    for remove in (lambda: net.remove_component("bad"), lambda: net.remove_component("inner"),
                   net.clear_components):  # fmt: skip
        with pytest.raises(RuntimeError, match="simulated release failure"):
            remove()
        assert list(net.components) == ["keep", "bad", "inner"]
        for child in (keep, bad, inner, inner.get_component("deep")):
            assert child.execution_context is net.execution_context
        assert bad.op is not None and inner.get_component("deep").op is not None
    net.build(train_ctx())
    assert net.is_built and bad.is_built


def test_remove_component_before_build() -> None:
    a, b, c = Component("a"), Component("b"), Component("c")
    comp = block("comp", a, b, c)
    assert comp.remove_component("b") is b
    assert [child.name for child in comp] == ["a", "c"]
    with pytest.raises(KeyError, match="b"):
        comp.remove_component("b")
    comp.add_component(Component("b"))
    assert [child.name for child in comp] == ["a", "c", "b"]


def test_a_child_belongs_to_one_composite_at_a_time() -> None:
    """Adding a child that has a parent is refused (removing it from one parent would take the
    context the other gave it); once removed, or cleared, it can join another."""
    child = Component("c")
    first, second = block("first", child), CompositeComponent("second")
    with pytest.raises(RuntimeError, match="already belongs to CompositeComponent 'first'"):
        second.add_component(child)
    assert len(second) == 0
    net = Network("net", device="CPU").add_component(first)
    assert child.has_execution_context
    second.add_component(first.remove_component("c"))
    assert not child.has_execution_context and second.get_component("c") is child
    second.clear_components()
    first.add_component(child)
    assert child.execution_context is net.execution_context


def test_composites_with_a_fixed_set_of_children_refuse_changes() -> None:
    """Composites whose build knows each child by name (SwiGLU, attention, a Llama block, a
    Llama) refuse added and removed children instead of failing at build or later."""
    from mila_py.components import AttentionConfig, GroupedQueryAttention, SwiGLU, SwiGLUConfig
    from mila_py.models import Llama, LlamaBlock, LlamaConfig

    llama = LlamaConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=8,
                        max_seq_len=8)  # fmt: skip
    fixed = [
        SwiGLU("mlp", SwiGLUConfig(8, 16)),
        GroupedQueryAttention("attn", AttentionConfig(8, 2, 1, max_seq_len=8)),
        LlamaBlock("block", llama),
        Llama("llama", llama, device="CPU"),
    ]
    for composite in fixed:
        children = list(composite.components)
        with pytest.raises(RuntimeError, match="fixed set of children"):
            composite.add_component(Component("extra"))
        with pytest.raises(RuntimeError, match="fixed set of children"):
            composite.remove_component(children[0])
        with pytest.raises(RuntimeError, match="fixed set of children"):
            composite.clear_components()
        assert list(composite.components) == children


def test_clear_components_before_build() -> None:
    comp = block("comp", Component("a"), Component("b"))
    comp.clear_components()
    assert len(comp) == 0
    assert list(comp) == []
    comp.add_component(Component("a"))
    assert list(comp.components) == ["a"]


def test_dotted_child_names_are_found_and_never_mixed_up() -> None:
    """A child named "a.b" beside a child "a" holding "b": find_component takes the longest
    name; a build refuses the clash of paths (shared parameter names and initial values)
    before allocating anything; renamed, the tree builds."""
    inner = Linear("c", 2, 2)
    dotted = Linear("c", 2, 2)
    net = Network("net").add_component(block("a", block("b", inner)))
    net.add_component(block("a.b", dotted))
    assert net.find_component("a.b.c") is dotted  # the longest child name first
    assert net.find_component("a.b").name == "a.b"
    assert net.find_component("a").find_component("b.c") is inner
    with pytest.raises(KeyError, match=r"no descendant 'a\.x'"):
        net.find_component("a.x")
    other = Network("other").add_component(block("a", Component("b.c")))
    other.add_component(block("a.b", Component("x")))
    assert other.find_component("a.b.c").name == "b.c"  # "a.b" has no "c": back to "a"
    with pytest.raises(ValueError, match=r"both have the path 'a\.b'"):
        net.build(train_ctx())
    assert not net.is_built and not inner.is_built and net.get_parameters() == []
    net.remove_component("a.b")
    net.add_component(block("a_b", Linear("c", 2, 2)))  # renamed: paths differ
    net.build(train_ctx())
    names = [name for name, _ in net.named_parameters()]
    assert names == ["a.b.c.weight", "a.b.c.bias", "a_b.c.weight", "a_b.c.bias"]
    assert net.get_gradients()[0] is inner._gradients["weight"]


def test_a_removed_child_leaves_the_context_behind_and_joins_another_tree() -> None:
    """Removal undoes what the tree's context did in the child's subtree (its hooks' work
    included, and for grandchildren added after it joined); it builds in its new tree."""
    late = Recorder("late")
    child = block("child", Recorder("early"))
    first = Network("first").add_component(child)
    child.add_component(late)  # joins with the context already there
    assert all(c.has_execution_context for c in child._walk())
    assert first.remove_component("child") is child
    assert not any(c.has_execution_context for c in child._walk())
    second = Network("second").add_component(child)
    second.build(train_ctx())
    assert child.execution_context is second.execution_context
    assert [n for n, _ in second.named_parameters()] == ["child.early.w", "child.late.w"]
    # a grandchild moved elsewhere first keeps its new tree's context when its old parent goes
    leaf = Linear("leaf")
    mid = block("mid", leaf)
    net = Network("net").add_component(mid).add_component(block("other"))
    mid.remove_component("leaf")
    net.get_component("other").add_component(leaf)
    leaf.out_features = 6  # changed after joining: kept
    net.remove_component("mid")
    assert leaf.execution_context is net.execution_context and leaf.out_features == 6
    net.build(train_ctx())
    assert net.find_component("other.leaf").get_parameters()[0].shape == (6, 4)
    # a part of a tree is built by the tree's root, never on its own (its network could not
    # build it again); refused with nothing changed, and the tree builds
    part = Linear("part")
    holder = block("holder", part)
    owner = Network("owner").add_component(holder)
    with pytest.raises(RuntimeError, match="built from its root \\(Network 'owner'\\)"):
        part.build(train_ctx())
    assert not part.is_built and part.get_parameters() == []
    owner.build(train_ctx())
    assert part.is_built
    # a real layer drops its op with the context and makes a new one in its next tree
    from mila_py.components import Rope, RopeConfig

    rope = Rope("rope", RopeConfig(channels=8, n_heads=2, n_kv_heads=1, max_seq_len=16))
    Network("a").add_component(rope).remove_component("rope")
    assert rope.op is None
    Network("b").add_component(rope).build(BuildContext((1, 4, 8), INFER))
    q, k = np.ones((1, 4, 8), np.float32), np.ones((1, 4, 4), np.float32)
    rope.forward(q, k)
    assert not np.allclose(q[0, 1], 1.0)  # rotated
    gone = Linear("gone")
    third = Network("third").add_component(gone).add_component(Linear("kept"))
    third.clear_components()
    assert not gone.has_execution_context
    Network("fourth").add_component(gone).build(train_ctx())


def test_remove_and_clear_after_build_raise() -> None:
    net = Network("net").add_component(Linear("a")).add_component(Linear("b"))
    net.build(train_ctx())
    with pytest.raises(RuntimeError, match="built"):
        net.remove_component("a")
    with pytest.raises(RuntimeError, match="built"):
        net.clear_components()
    assert list(net.components) == ["a", "b"]


# ---------------------------------------------------------------------------- Network and contexts
def test_network_owns_its_context_and_defaults_to_cpu() -> None:
    net = Network("net")
    assert net.has_execution_context
    assert net.device_id == DeviceId.parse("CPU")
    assert net._owns_context


def test_network_needs_a_device() -> None:
    with pytest.raises(ValueError, match="device"):
        Network("net", device=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Network("net", device="tpu:0")
    with pytest.raises(ValueError):
        Network("9net")


def test_context_propagates_to_children_added_before_and_after(device: str) -> None:
    early = block("early", Recorder("deep"))
    comp = CompositeComponent("comp")
    comp.add_component(early)
    ctx = devices.create_execution_context(device)  # looked up now: the emulated CUDA:0's too
    comp.set_execution_context(ctx)
    late = Recorder("late")
    comp.add_component(late)
    for node in (comp, early, early.get_component("deep"), late):
        assert node.execution_context is ctx
    assert late.calls == [("context", ctx)]
    assert early.get_component("deep").calls == [("context", ctx)]


def test_network_gives_its_context_to_the_whole_tree(device: str) -> None:
    net = mlp_network(device)
    ctx = net.execution_context
    for path in ("embed", "block", "block.fc1", "block.fc2", "head"):
        assert net.find_component(path).execution_context is ctx
        assert not net.find_component(path)._owns_context


def test_failing_child_hook_leaves_no_context_anywhere_and_can_be_retried() -> None:
    bad = Recorder("bad", fail_context=True)
    inner = block("inner", Recorder("leaf"))
    outer = block("outer", inner, bad)
    ctx = create_execution_context("CPU")
    with pytest.raises(RuntimeError, match="simulated context failure"):
        outer.set_execution_context(ctx)
    for node in (outer, inner, inner.get_component("leaf"), bad):
        assert not node.has_execution_context, node.name
    bad.fail_context = False
    outer.set_execution_context(ctx)
    for node in (outer, inner, inner.get_component("leaf"), bad):
        assert node.execution_context is ctx


def test_adding_a_child_whose_hook_fails_leaves_both_unchanged() -> None:
    net = Network("net")
    child = block("child", Recorder("ok"), Recorder("bad", fail_context=True))
    with pytest.raises(RuntimeError, match="simulated context failure"):
        net.add_component(child)
    assert not net.has_component("child")
    assert not child.has_execution_context
    assert not child.get_component("ok").has_execution_context
    child.get_component("bad").fail_context = False
    net.add_component(child)
    assert child.find_component("ok").execution_context is net.execution_context


# ---------------------------------------------------------------------------- build and modes
def test_build_builds_every_child_with_the_composite_context() -> None:
    a, b = Recorder("a"), Recorder("b")
    net = Network("net").add_component(a).add_component(block("blk", b))
    bc = train_ctx(2, 3)
    net.build(bc)
    for node in (net, a, b, net.get_component("blk")):
        assert node.is_built
        assert node.build_context is bc
        assert node.training_mode is TrainingMode.NORMAL
    assert a.calls[-1] == ("build", bc)


def test_build_without_context_raises() -> None:
    comp = block("comp", Linear("a"))
    with pytest.raises(RuntimeError, match="execution context"):
        comp.build(train_ctx())
    assert not comp.get_component("a").is_built


def test_failed_child_build_rolls_back_the_whole_tree_and_can_be_retried() -> None:
    first = Linear("first")
    deep = Linear("deep")
    bad = Recorder("bad", fail_build=True)
    net = Network("net").add_component(first).add_component(block("blk", deep)).add_component(bad)
    with pytest.raises(RuntimeError, match="simulated build failure"):
        net.build(train_ctx())
    for node in (net, first, deep, net.get_component("blk"), bad):
        assert not node.is_built, node.name
        assert node.training_mode is None
        assert node.get_parameters() == []
    assert net.get_memory_stats() == MemoryStats()
    assert net.get_gradients() == []
    bad.fail_build = False
    net.build(train_ctx())
    assert all(node.is_built for node in (net, first, deep, bad))
    assert net.parameter_count() == 2 * (16 + 4) + 4


def test_training_mode_propagates_to_every_child() -> None:
    a, b = Recorder("a"), Recorder("b")
    net = Network("net").add_component(a).add_component(block("blk", b))
    net.build(train_ctx())
    net.set_training_mode(TrainingMode.EVAL)
    for node in (net, a, b, net.get_component("blk")):
        assert node.training_mode is TrainingMode.EVAL
    assert a.calls[-1] == ("mode", TrainingMode.EVAL)
    assert b.calls[-1] == ("mode", TrainingMode.EVAL)
    net.eval()  # no-op: no hook called
    assert [c for c in a.calls if c[0] == "mode"] == [("mode", TrainingMode.EVAL)]
    net.train()
    assert all(n.training_mode is TrainingMode.NORMAL for n in (net, a, b))
    # a child switched on its own comes back with its network, which is in the mode already
    b.eval()
    a_calls = len(a.calls)
    net.train()
    assert all(n.training_mode is TrainingMode.NORMAL for n in (net, a, b))
    assert b.calls[-1] == ("mode", TrainingMode.NORMAL) and len(a.calls) == a_calls  # a: no-op


def test_failing_child_mode_switch_restores_the_children_already_switched() -> None:
    a = Recorder("a")
    b = Recorder("b", fail_mode=TrainingMode.EVAL)
    net = Network("net").add_component(a).add_component(b)
    net.build(train_ctx())
    with pytest.raises(RuntimeError, match="simulated mode failure"):
        net.eval()
    assert net.training_mode is TrainingMode.NORMAL
    assert a.training_mode is TrainingMode.NORMAL
    assert b.training_mode is TrainingMode.NORMAL


def test_failing_mode_switch_puts_every_grandchild_back_in_its_own_mode() -> None:
    """A grandchild switched on its own keeps its mode after a failed switch of the network
    (not the mode of its parent)."""
    own, other = Recorder("own"), Recorder("other")
    bad = Recorder("bad", fail_mode=TrainingMode.EVAL)
    inner = block("inner", own, other)
    net = Network("net").add_component(inner).add_component(bad)
    net.build(train_ctx())
    own.eval()
    with pytest.raises(RuntimeError, match="simulated mode failure"):
        net.eval()
    assert own.training_mode is TrainingMode.EVAL
    assert own.calls[-1] == ("mode", TrainingMode.EVAL)  # never switched back and forth
    for node in (net, inner, other, bad):
        assert node.training_mode is TrainingMode.NORMAL
    assert other.calls[-2:] == [("mode", TrainingMode.EVAL), ("mode", TrainingMode.NORMAL)]


class Dropping(CompositeComponent):
    """A composite whose hook has a part of its own (a dropout switch), then propagates."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.dropout_active = True

    def _on_training_mode_changing(self, mode: TrainingMode) -> None:
        self.dropout_active = mode is TrainingMode.NORMAL
        super()._on_training_mode_changing(mode)


def test_failing_mode_switch_runs_a_composites_own_hook_back() -> None:
    own = Recorder("own")
    dropping = Dropping("dropping").add_component(own).add_component(Recorder("other"))
    bad = Recorder("bad", fail_mode=TrainingMode.EVAL)
    net = Network("net").add_component(dropping).add_component(bad)
    net.build(train_ctx())
    own.eval()
    with pytest.raises(RuntimeError, match="simulated mode failure"):
        net.eval()
    assert dropping.training_mode is TrainingMode.NORMAL and dropping.dropout_active
    assert own.training_mode is TrainingMode.EVAL  # its own mode, after its parent's hook ran
    assert dropping.get_component("other").training_mode is TrainingMode.NORMAL


def test_a_shared_parameter_is_counted_once() -> None:
    """Two components holding the same array: one parameter, as memory stats count it."""
    first, second = Linear("first"), Linear("second")
    net = Network("net").add_component(first).add_component(second)
    net.build(train_ctx())
    second._parameters["weight"] = first._parameters["weight"]
    assert net.parameter_count() == 16 + 4 + 4
    assert net.get_memory_stats().device_parameter_bytes == (16 + 4 + 4) * 4
    assert "params=24" in repr(net)


def test_inference_network_reports_eval_everywhere_and_refuses_mode_changes() -> None:
    net = mlp_network()
    net.build(infer_ctx())
    for path in ("embed", "block", "block.fc1", "head"):
        assert net.find_component(path).training_mode is TrainingMode.EVAL
    with pytest.raises(RuntimeError, match="INFERENCE"):
        net.set_training_mode(TrainingMode.NORMAL)
    assert net.training_mode is TrainingMode.EVAL


def test_set_training_mode_before_build_raises() -> None:
    net = mlp_network()
    with pytest.raises(RuntimeError):
        net.set_training_mode(TrainingMode.EVAL)


# ---------------------------------------------------------------------------- aggregation
def test_parameters_aggregate_in_canonical_order(device: str) -> None:
    net = mlp_network(device)
    net.build(train_ctx(2, 8))
    names = [name for name, _ in net.named_parameters()]
    assert names == EXPECTED_NAMES
    params = net.get_parameters()
    assert [p.shape for p in params] == EXPECTED_SHAPES
    own = [p for child in net for p in child.get_parameters()]
    assert all(a is b for a, b in zip(params, own, strict=True))
    assert net.parameter_count() == sum(int(np.prod(s)) for s in EXPECTED_SHAPES)


def test_gradients_aggregate_aligned_with_parameters(device: str, host) -> None:
    net = mlp_network(device)
    net.build(train_ctx(2, 8))
    grads = net.get_gradients()
    assert [g.shape for g in grads] == EXPECTED_SHAPES
    assert [name for name, _ in net.named_gradients()] == EXPECTED_NAMES
    for g in grads:
        g.fill(3)
    net.zero_gradients()
    assert all(not host(g).any() for g in grads)


def test_inference_network_has_no_gradients() -> None:
    net = mlp_network()
    net.build(infer_ctx(2, 8))
    assert net.get_gradients() == []
    assert len(net.get_parameters()) == len(EXPECTED_NAMES)


def test_memory_stats_aggregate_over_the_tree() -> None:
    net = mlp_network()
    net.build(train_ctx(2, 8))
    n_params = sum(int(np.prod(s)) for s in EXPECTED_SHAPES)
    stats = net.get_memory_stats()
    assert stats.device_parameter_bytes == n_params * 4
    assert stats.device_gradient_bytes == n_params * 4
    assert stats.device_state_bytes == 0
    assert stats.host_total_bytes == 0
    children_sum = sum((child.get_memory_stats() for child in net), MemoryStats())
    assert stats == children_sum


def test_memory_stats_follow_precision() -> None:
    net = Network("net", precision=Precision.FP16)
    net.add_component(Linear("lin", 4, 4, precision=Precision.FP16))
    net.build(infer_ctx())
    assert net.get_memory_stats().device_parameter_bytes == 20 * 2


def test_shared_buffer_is_counted_once_in_the_aggregate() -> None:
    holder: dict = {}
    a = SharedTable("a", holder)
    b = SharedTable("b", holder)
    c = SharedTable("c", holder)
    net = Network("net").add_component(a).add_component(block("blk", b, c))
    net.build(infer_ctx())
    assert a.get_memory_stats().device_state_bytes == 1024 + 16
    assert b.get_memory_stats().device_state_bytes == 1024 + 16
    assert net.find_component("blk").get_memory_stats().device_state_bytes == 1024 + 2 * 16
    assert net.get_memory_stats().device_state_bytes == 1024 + 3 * 16
    naive = sum((x.get_memory_stats() for x in (a, b, c)), MemoryStats())
    assert naive.device_state_bytes == 3 * (1024 + 16)


def test_equal_but_distinct_buffers_are_each_counted() -> None:
    a = SharedTable("a", {})
    b = SharedTable("b", {})
    net = Network("net").add_component(a).add_component(b)
    net.build(infer_ctx())
    assert net.get_memory_stats().device_state_bytes == 2 * (1024 + 16)


# ---------------------------------------------------------------------------- repr
def test_repr_prints_the_tree_with_parameter_counts() -> None:
    net = mlp_network()
    net.build(train_ctx(2, 8))
    lines = repr(net).splitlines()
    assert len(lines) == 6
    assert lines[0].startswith("Network('net'")
    assert "3 children" in lines[0]
    total = sum(int(np.prod(s)) for s in EXPECTED_SHAPES)
    assert f"params={total:,}" in lines[0]
    expected = [
        ("  ", "Linear('embed'", 4 * 8 + 4),
        ("  ", "CompositeComponent('block'", 16 * 8 + 16 + 8 * 16 + 8),
        ("    ", "Linear('fc1'", 16 * 8 + 16),
        ("    ", "Linear('fc2'", 8 * 16 + 8),
        ("  ", "Linear('head'", 8 * 2 + 8),
    ]
    for line, (indent, head, count) in zip(lines[1:], expected, strict=True):
        assert line.startswith(indent + head), line
        assert not line[len(indent)].isspace()
        assert f"params={count:,}" in line, line
    assert "2 children" in lines[2]


def test_repr_of_an_unbuilt_composite() -> None:
    comp = block("comp", Linear("a"))
    text = repr(comp)
    assert "unbuilt" in text
    assert "params=0" in text
    assert text.splitlines()[1].startswith("  Linear('a'")


def test_a_child_whose_op_is_missing_is_named_when_it_joins() -> None:
    """A precision its device lacks is found when the child gets the context: the error names
    the child, its precision and the device, and the network is left as it was."""
    from mila_py.components._layer import Layer
    from mila_py.devices import DeviceType
    from mila_py.ops.operation import Operation
    from mila_py.ops.registry import OpNotFoundError, register_op

    @register_op("TestOnlyOp_composite_fp32", DeviceType.CPU, precisions=[Precision.FP32])
    class Fp32OnlyOp(Operation):
        pass

    class Narrow(Layer):  # a layer whose op the CPU has in FP32 alone
        _OP_NAME = "TestOnlyOp_composite_fp32"
        _CONFIG_TYPE = LinearConfig

    child = Narrow("half", LinearConfig(4, 4), precision=Precision.FP16)
    net = Network("net", device="CPU")
    with pytest.raises(
        OpNotFoundError, match=r"Narrow 'half' \(FP16 on CPU:0\): no op 'TestOnlyOp_composite_fp32'"
    ):
        net.add_component(child)
    assert len(net) == 0 and not child.has_execution_context
    block_of_it = CompositeComponent("blk").add_component(Narrow("deep", LinearConfig(4, 4),
                                                                 precision=Precision.FP16))  # fmt: skip
    with pytest.raises(OpNotFoundError, match=r"^Narrow 'deep' \(FP16 on CPU:0\)"):
        net.add_component(block_of_it)  # named once, by the leaf, not again by its parent
