"""``module.compile()`` in place (torchtitan's per-block compile) and optimizer containers, in plain torch.

References are the test's own float64 copies of the tensors the optimizer used. The backend is ``aot_eager``:
dynamo's tracing, which is what a trainmon hook inside a ``fullgraph`` region breaks, without inductor's C++
build (seconds per graph on this machine).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.loops.common import assert_rows_match, config, data, rows, scalars
from tests.reference import METRICS, np_stats
from tests.torchtitan_optimizer import OptimizersContainer
from trainmon import TrainerMonitor
from trainmon.collect.optimizer_parts import OptimizerContainerError
from trainmon.integrations.torch import CompiledRootError

ACTIVATIONS = {"enabled": True, "metrics": ["norm", "max"]}
PARAM_GROUPS = [
    {"pattern": r"bias", "optimizer_name": "Adam", "optimizer_kwargs": {"lr": 1e-2}},
    {"pattern": r".*", "optimizer_name": "AdamW", "optimizer_kwargs": {"lr": 3e-2, "weight_decay": 0.1}},
]


def _compile_works() -> bool:
    try:
        module = Block()
        module.compile(backend="aot_eager", fullgraph=True)
        module(torch.ones(1, 8))
        return True
    except Exception:  # a capability probe
        return False


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 16)
        self.fc2 = nn.Linear(16, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


needs_compile = pytest.mark.skipif(not _compile_works(), reason="torch.compile (aot_eager) does not run here")


class Counting:
    """``aot_eager``, counting the graphs dynamo compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, inputs, **kwargs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, inputs, **kwargs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: compiled code (and its recompile count, which a ``fullgraph``
    compile turns into an error at 8) is kept per code object, across the tests of one process."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(model, optimizer, monitor, steps, used=None, states=None, compile_at=None, named=None):
    named = named or model  # where the parameter names come from (the module inside a compiled wrapper)
    for step in range(steps):
        if compile_at is not None and step == compile_at[0]:
            compile_at[1]()
        x, y = data(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if used is not None:
            used[step] = {name: p.grad.double().numpy().copy() for name, p in named.named_parameters()}
        optimizer.step()
        if states is not None:
            inner = optimizer.optimizers if hasattr(optimizer, "optimizers") else [optimizer]
            names = {id(p): name for name, p in named.named_parameters()}
            states[step] = {names[id(p)]: part.state[p]["exp_avg"].double().numpy().copy()
                            for part in inner for group in part.param_groups for p in group["params"]}
        optimizer.zero_grad()
        if monitor is not None:
            monitor.step()


@needs_compile
@pytest.mark.parametrize("container", [False, True], ids=["adam", "optimizers_container"])
def test_blocks_compiled_in_place_with_fullgraph_train_monitored_bit_identically(tmp_path, caplog, container):
    def make():
        torch.manual_seed(0)
        net, backend = Net(), Counting()
        for block in net.blocks:
            block.compile(backend=backend, fullgraph=True)
        optimizer = OptimizersContainer(PARAM_GROUPS, [net]) if container else torch.optim.Adam(net.parameters(), 1e-2)
        return net, optimizer, backend

    plain, plain_optimizer, plain_backend = make()
    _train(plain, plain_optimizer, None, 5)
    net, optimizer, backend = make()
    cfg = config(tmp_path, step_interval=2, activations=ACTIVATIONS,
                 optimizer_states={"states": ["exp_avg", "exp_avg_sq"], "metrics": METRICS})
    used, states = {}, {}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMonitor(cfg).attach(net, optimizer)
        _train(net, optimizer, monitor, 5, used, states)
        monitor.close()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), net.parameters()))
    # the same graphs as without trainmon (one per block input's requires_grad), never recompiled for its hooks
    assert backend.graphs == plain_backend.graphs == 2
    warnings = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1 and "blocks.0.fc1" in warnings[0] and "'blocks.0', 'blocks.1'" in warnings[0]
    assert set(rows(tmp_path, "actv").name) == {"head.input", "head.output"}
    reduced, exp_avg = rows(tmp_path, "grad_reduced"), rows(tmp_path, "exp_avg")
    for step in (0, 2, 4):
        assert_rows_match(reduced, step, used[step])
        assert_rows_match(rows(tmp_path, "grad_unreduced"), step, used[step])
        assert_rows_match(exp_avg, step, states[step], metrics=METRICS)
    assert sorted(set(reduced.step)) == [0, 2, 4]
    if container:  # lr of each inner optimizer's group, in order
        values = scalars(tmp_path)
        assert list(values["lr/group0"]) == [1e-2] * 3 and list(values["lr/group1"]) == [3e-2] * 3


@needs_compile
def test_a_module_compiled_after_attach_loses_its_activation_hooks_and_nothing_breaks(tmp_path, caplog):
    torch.manual_seed(0)
    net, backend = Net(), Counting()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    cfg = config(tmp_path, activations=ACTIVATIONS)  # every step collected: the hooks are never disarmed
    used = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMonitor(cfg).attach(net, optimizer)
        assert not [r for r in caplog.records if "torch.compile" in r.getMessage()]
        _train(net, optimizer, monitor, 5, used,
               compile_at=(2, lambda: net.blocks[1].compile(backend=backend, fullgraph=True)))
        monitor.close()
    warnings = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1 and "blocks.1.fc2" in warnings[0] and "blocks.0" not in warnings[0].split("(")[1]
    actv = rows(tmp_path, "actv")
    for step in range(5):
        names = set(actv[actv.step == step].name)
        assert {"blocks.0.fc1.output", "head.output"} <= names, step
        # step 2 ran the compiled block with the hooks still in (traced: no rows); from step 3 on they are gone
        assert any(n.startswith("blocks.1") for n in names) == (step < 2), (step, sorted(names))
    assert backend.graphs == 1  # removing the hooks after step 2 did not recompile (they were never traced in)
    for step in range(5):
        assert_rows_match(rows(tmp_path, "grad_reduced"), step, used[step])


@needs_compile
def test_a_root_compiled_in_place_is_refused_at_attach(tmp_path):
    net = Net()
    net.compile(backend="aot_eager")
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
    monitor = TrainerMonitor(config(tmp_path))
    with pytest.raises(CompiledRootError, match=r"torch.compile\(model\) wrapper"):
        monitor.attach(net, torch.optim.SGD(net.parameters(), lr=0.1))
    monitor.close()
    assert hooks == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())


@needs_compile
def test_a_whole_model_compile_wrapper_with_fullgraph_is_monitored(tmp_path):
    torch.manual_seed(0)
    net = Net()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    optimizer = OptimizersContainer(PARAM_GROUPS, [net])
    monitor = TrainerMonitor(config(tmp_path)).attach(compiled, optimizer)
    used, states = {}, {}
    _train(compiled, optimizer, monitor, 3, used, states, named=net)
    monitor.close()
    for step in range(3):
        assert_rows_match(rows(tmp_path, "grad_reduced"), step, used[step])
        assert_rows_match(rows(tmp_path, "exp_avg"), step, states[step])
    grad_norm = scalars(tmp_path)["grad_norm"]
    for step in range(3):
        want = sum(float((g * g).sum()) for g in used[step].values()) ** 0.5
        assert grad_norm[step] == pytest.approx(want, rel=1e-5)
        assert rows(tmp_path, "grad_reduced").query(f"step == {step} and name == 'head.weight'").norm.iloc[0] == \
            pytest.approx(np_stats(used[step]["head.weight"])["norm"], rel=1e-5)


def test_a_container_whose_inner_optimizers_miss_parameters_is_refused_at_attach(tmp_path):
    net = Net()
    optimizer = OptimizersContainer(PARAM_GROUPS, [net])
    optimizer.optimizers.pop()  # the AdamW part: its parameters are in no inner optimizer now
    monitor = TrainerMonitor(config(tmp_path))
    with pytest.raises(OptimizerContainerError, match=r"in none of them"):
        monitor.attach(net, optimizer)
    monitor.close()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_traced_modules_names_the_compiled_regions_like_the_rows(monkeypatch):
    import torch.distributed as dist

    from tests.launch import free_port
    from trainmon.integrations.torch import traced_modules

    net = Net()
    net.blocks[0].compile(backend="aot_eager")                                # in place: itself and below
    net.blocks[1] = torch.compile(net.blocks[1], backend="aot_eager")         # a wrapper: below it, not itself
    names = {id(m): name for name, m in net.named_modules()}
    found = {names[key]: region for key, region in traced_modules(net).items()}
    assert found == {"blocks.0": "blocks.0", "blocks.0.fc1": "blocks.0", "blocks.0.fc2": "blocks.0",
                     "blocks.1._orig_mod": "blocks.1", "blocks.1._orig_mod.fc1": "blocks.1",
                     "blocks.1._orig_mod.fc2": "blocks.1"}
    whole = torch.compile(Net(), backend="aot_eager")
    assert set(traced_modules(whole).values()) == {""} and len(traced_modules(whole)) == len(list(whole.modules())) - 1
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        inner = Net()
        inner.blocks[0].compile(backend="aot_eager")
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
        assert set(traced_modules(ddp).values()) == {"blocks.0"}  # named as the rows are: no "module."
    finally:
        dist.destroy_process_group()
