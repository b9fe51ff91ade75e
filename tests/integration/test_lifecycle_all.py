"""One lifecycle across every integration: construct, attach, 3 steps with every family on, close twice, nothing left.

Plain torch, FSDP2 (``fully_shard`` on a 1-rank gloo group) and MindSpore (PyNative) run in this process;
DeepSpeed (ZeRO-0 and ZeRO-2) and Megatron-Core (TP=1, with ``examples/mcore_cpu_shim.py``, which patches torch
for the whole process) each run in a process of their own, forked from one warm server
(``tests/launch.py``'s :class:`RankServers`): this file is also the script those processes run
(``python test_lifecycle_all.py OUT CASE``).

Every case makes the same explicit checks (:class:`Leftovers`), wherever it runs: after the second
``close()`` no hook the monitor added is on any module, parameter or optimizer (nor a global module or
optimizer hook), no trainmon callable is left in the instance dictionary of a model, engine or optimizer
(the step wrappers), ``torch.distributed``'s collectives are the original functions, no ``trainmon*``
thread is alive, no file under the output directory is open, and the process group state (initialised,
world size, number of groups) is the one before ``attach``. The test then reads the rows back: every
family the case turns on has rows at steps 0-2, and every value is finite.

A framework that cannot be imported here skips its case with the import error.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run as a script (the subprocess cases): the repository must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import _open_files, _trainmon_threads  # the leak fixtures' own probes

STEPS = 3
STATES = ["exp_avg", "exp_avg_sq", "update", "ratio"]
TORCH_FAMILIES = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", *STATES, "param")
RUN = "run"
SKIP_FILE = "skipped.txt"  # a subprocess case that cannot import its framework writes why, and exits 0

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")
_PARAM_HOOKS = ("_post_accumulate_grad_hooks", "_backward_hooks")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")
_MINDSPORE_HOOKS = ("_forward_hook", "_forward_pre_hook", "_backward_hook", "_backward_pre_hook")


def config(out: Path, communication: bool) -> dict[str, Any]:
    """Every family on: activations (and their gradients), weight gradients (unreduced and reduced), every
    Adam state, the parameters, and the collectives where the case has a process group."""
    return {"output_dir": str(out), "run_name": RUN, "sinks": ["csv"],
            "activations": {"enabled": True}, "weight_grads": {"enabled": True},
            "optimizer_states": {"enabled": True, "states": STATES}, "params": {"enabled": True},
            "communication": {"enabled": communication}}


# ----------------------------------------------------------------------------- what a monitor may leave
def _hooks(obj: object, attrs: Iterable[str]) -> dict[str, dict[Any, Any]]:
    """``attribute -> {key: hook}`` of the hook containers ``attrs`` of ``obj``."""
    out = {}
    for attr in attrs:
        value = getattr(obj, attr, None)
        if callable(value):  # MindSpore's Parameter.hooks()
            value = value()
        if isinstance(value, dict):
            out[attr] = dict(value)
        else:  # a list of hooks: keyed by identity
            out[attr] = {id(hook): hook for hook in value or ()}
    return out


def _origin(value: object) -> str:
    """The module that defined a callable (through ``functools.partial``), or ``""`` when unknown."""
    while hasattr(value, "func"):
        value = value.func
    return getattr(value, "__module__", None) or ""


def _from_trainmon(value: object) -> bool:
    return callable(value) and _origin(value).split(".")[0] == "trainmon"


def _new_hooks(before: dict[str, dict[Any, Any]], now: dict[str, dict[Any, Any]]) -> list[str]:
    """Hooks in ``now`` that are trainmon's, or new since ``before`` and of no known other origin (a
    framework's own hooks added while training, such as FSDP2's state-dict hooks, are not counted)."""
    return [attr for attr, hooks in now.items() for key, hook in hooks.items()
            if _from_trainmon(hook) or (key not in before[attr] and not _origin(hook))]


def _torch_objects(models: Iterable[Any], optimizers: Iterable[Any]) -> Iterator[tuple[str, object, tuple[str, ...]]]:
    """``(label, object, hook attributes)`` of every torch module, parameter and optimizer given."""
    import torch

    for model in models:
        for name, module in model.named_modules():
            yield f"module {name or '<root>'}", module, _MODULE_HOOKS
        for name, param in model.named_parameters():
            yield f"parameter {name}", param, _PARAM_HOOKS
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.Optimizer):
            yield f"optimizer {type(optimizer).__name__}", optimizer, _OPTIMIZER_HOOKS


def _mindspore_objects(net: Any, optimizer: Any) -> Iterator[tuple[str, object, tuple[str, ...]]]:
    for name, cell in [*net.cells_and_names(), ("optimizer", optimizer)]:
        yield f"cell {name or '<root>'}", cell, _MINDSPORE_HOOKS
    for param in net.get_parameters():
        yield f"parameter {param.name}", param, ("hooks",)


def _group_state() -> tuple[bool, int, int]:
    """``(initialised, world size, process groups)`` of torch.distributed in this process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False, 0, 0
    return True, dist.get_world_size(), len(dist.distributed_c10d._world.pg_map)


def _collectives() -> dict[str, object]:
    import torch.distributed as dist

    from trainmon.config import COMM_OPS

    return {name: getattr(dist, name, None) for name in COMM_OPS}


class Leftovers:
    """A snapshot taken before ``attach``; :meth:`check` after ``close()`` lists what the monitor left behind.

    A hook counts when it is trainmon's (defined in the package), or new since the snapshot and of no known
    origin; the frameworks' own hooks (DeepSpeed's, Megatron's, FSDP2's, some added while training) do not.
    """

    def __init__(self, out: Path, objects: Iterable[tuple[str, object, tuple[str, ...]]],
                 instances: Iterable[object] = (), torch_loaded: bool = True) -> None:
        self.out, self.torch_loaded = out, torch_loaded
        self.objects = [(label, obj, attrs, _hooks(obj, attrs)) for label, obj, attrs in objects]
        self.instances = list(instances)
        self.threads = {thread.name for thread in _trainmon_threads()}
        if torch_loaded:
            from torch.nn.modules import module as module_globals
            from torch.optim import optimizer as optimizer_globals

            self.globals = [(module_globals, ("_global_forward_hooks", "_global_forward_pre_hooks",
                                              "_global_backward_hooks", "_global_backward_pre_hooks")),
                            (optimizer_globals, ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"))]
            self.global_hooks = [_hooks(namespace, attrs) for namespace, attrs in self.globals]
            self.collectives, self.groups = _collectives(), _group_state()

    def _new_threads(self) -> list[str]:
        return sorted({thread.name for thread in _trainmon_threads()} - self.threads)

    def check(self) -> list[str]:
        left = []
        for label, obj, attrs, before in self.objects:
            left += [f"{label}: {attr}" for attr in _new_hooks(before, _hooks(obj, attrs))]
        for obj in self.instances:  # the step wrappers live in the instance dictionary while attached
            left += [f"{type(obj).__name__}.{name}: trainmon's {value!r}" for name, value in vars(obj).items()
                     if _from_trainmon(value)]
        if self.torch_loaded:
            for (namespace, attrs), before in zip(self.globals, self.global_hooks):
                left += [f"global {attr}" for attr in _new_hooks(before, _hooks(namespace, attrs))]
            left += [f"torch.distributed.{name} is not the original" for name, fn in _collectives().items()
                     if fn is not self.collectives[name]]
            if _group_state() != self.groups:
                left.append(f"process groups (initialised, world size, groups): {_group_state()}, before {self.groups}")
        deadline = time.monotonic() + 1.0  # writer threads end a moment after close() returned
        while self._new_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        left += [f"thread {name}" for name in self._new_threads()]
        left += [f"open file {path}" for path in _open_files((str(self.out.resolve()) + os.sep,)).values()]
        return sorted(set(left))


def _close_twice(monitor: Any, leftovers: Leftovers) -> None:
    monitor.close()
    monitor.close()  # idempotent
    left = leftovers.check()
    assert not left, f"left behind after close(): {left}"


# ----------------------------------------------------------------------------- the cases
def _mean_over_ranks(loss: Any) -> Any:
    """The loss averaged over the ranks, as a training loop logs it: a collective of the loop's own, so that the
    ``comm`` family has rows in every case with a process group (FSDP2 issues none of its own on one rank)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _train_tinynet(out: Path, communication: bool, shard: Callable[[Any], None] = lambda model: None) -> None:
    """TinyNet with Adam, ``shard`` applied to it first; the loss averaged over the ranks with ``communication``."""
    import torch

    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    torch.manual_seed(0)
    model = TinyNet()
    shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    leftovers = Leftovers(out, _torch_objects([model], [optimizer]), [model, optimizer])
    monitor = TrainerMonitor(config(out, communication=communication))
    monitor.attach(model, optimizer)
    for step in range(STEPS):
        loss = loss_fn(model, *batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=_mean_over_ranks(loss) if communication else loss)
    _close_twice(monitor, leftovers)


def run_torch(out: Path) -> None:
    _train_tinynet(out, communication=False)


def run_fsdp2(out: Path) -> None:
    """Each block, then the root, ``fully_shard``ed on a 1-rank gloo group made here (and destroyed after)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(model: Any) -> None:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    assert not dist.is_initialized(), "a process group is already alive"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _train_tinynet(out, communication=True, shard=shard)
    finally:
        dist.destroy_process_group()


def run_mindspore(out: Path) -> None:
    import mindspore as ms
    from mindspore import Tensor, nn

    from tests.integration.test_mindspore_families import Mlp, _data
    from trainmon import TrainerMonitor

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(0)
    net = Mlp()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    leftovers = Leftovers(out, _mindspore_objects(net, optimizer), [net, optimizer], torch_loaded=False)
    monitor = TrainerMonitor(config(out, communication=False))  # collectives need msrun: not in one process
    monitor.attach(net, optimizer)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, optimizer.parameters)
    for step in range(STEPS):
        loss, grads = grad_fn(*(Tensor(a) for a in _data(step)))
        optimizer(grads)
        monitor.step(loss=loss)
    _close_twice(monitor, leftovers)


def run_deepspeed(out: Path, stage: int) -> None:
    """ZeRO ``stage`` in this (forked) process: a world of one on gloo."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)
    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    before = _group_state()
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        torch.manual_seed(0)
        model = TinyNet()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}}})
        optimizers = [engine.optimizer, getattr(engine.optimizer, "optimizer", None)]
        leftovers = Leftovers(out, _torch_objects([engine], optimizers), [engine, *filter(None, optimizers)])
        monitor = TrainerMonitor(config(out, communication=True))
        monitor.attach(engine)
        for step in range(STEPS):
            loss = loss_fn(engine, *batch(step))
            engine.backward(loss)
            engine.step()
            monitor.step(loss=_mean_over_ranks(loss))
        _close_twice(monitor, leftovers)
    finally:
        torch.distributed.destroy_process_group()
    assert _group_state() == before


def run_megatron(out: Path) -> None:
    """A 2-layer GPTModel, TP=1 PP=1, Megatron's DDP and Adam, in this (forked) process: a world of one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import mcore_cpu_shim  # CPU-only test shim, shared with examples/megatron_gpt.py

    seed_all = mcore_cpu_shim.apply()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainmon import TrainerMonitor

    batch, seq, vocab, micro_batches = 2, 16, 128, 2
    before = _group_state()
    dist.init_process_group("gloo")
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        seed_all()
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32)
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                       max_sequence_length=seq, pre_process=True, post_process=True)
        chunks = [DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)]
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), chunks)
        leaves = getattr(opt, "chained_optimizers", [opt])
        optimizers = [*leaves, *(leaf.optimizer for leaf in leaves)]
        leftovers = Leftovers(out, _torch_objects(chunks, optimizers), [*chunks, opt, *optimizers])
        monitor = TrainerMonitor(config(out, communication=True))
        monitor.attach(chunks, opt, grad_acc_steps=micro_batches)

        def step_fn(data: Iterator[Any], model: Any) -> tuple[Any, Callable[[Any], Any]]:
            tokens = next(data)
            position = torch.arange(seq).expand(tokens.shape[0], seq)
            mask = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
            output = model(tokens, position, mask, labels=tokens.roll(-1, dims=1))
            return output, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        for step in range(STEPS):
            generator = torch.Generator().manual_seed(step)
            data = iter([torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(micro_batches)])
            for chunk in chunks:
                chunk.zero_grad_buffer()
            opt.zero_grad()
            losses = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=chunks,
                                                 num_microbatches=micro_batches, seq_length=seq,
                                                 micro_batch_size=batch, forward_only=False)
            opt.step()
            monitor.step(loss=_mean_over_ranks(torch.stack([x["loss"] for x in losses]).mean()))
        _close_twice(monitor, leftovers)
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    assert _group_state() == before


# Per case: how it runs, and the families it writes (comm: where the case has a process group).
IN_PROCESS: dict[str, Callable[[Path], None]] = {"torch": run_torch, "fsdp2": run_fsdp2, "mindspore": run_mindspore}
SUBPROCESS: dict[str, Callable[[Path], None]] = {
    "deepspeed_zero0": lambda out: run_deepspeed(out, 0), "deepspeed_zero2": lambda out: run_deepspeed(out, 2),
    "megatron": run_megatron}
FRAMEWORK = {"torch": "torch", "fsdp2": "torch", "mindspore": "mindspore", "deepspeed_zero0": "deepspeed",
             "deepspeed_zero2": "deepspeed", "megatron": "megatron.core"}
FAMILIES = {"torch": TORCH_FAMILIES, "fsdp2": (*TORCH_FAMILIES, "comm"), "mindspore": TORCH_FAMILIES,
            "deepspeed_zero0": (*TORCH_FAMILIES, "comm"), "deepspeed_zero2": (*TORCH_FAMILIES, "comm"),
            "megatron": (*TORCH_FAMILIES, "comm")}


# ----------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One warm fork server (a world of one) with DeepSpeed and Megatron-Core imported once."""
    from tests.launch import DEEPSPEED_PRELOAD, RankServers

    preload = (*DEEPSPEED_PRELOAD, "megatron.core", "megatron.core.models.gpt.gpt_model",
               "megatron.core.optimizer", "megatron.core.distributed")
    rank_servers = RankServers(1, preload, tmp_path_factory.mktemp("lifecycle_servers"))
    yield rank_servers
    rank_servers.close()


def _cases() -> list[Any]:
    light = {"torch", "fsdp2"}
    return [pytest.param(case, id=case, marks=() if case in light else pytest.mark.slow) for case in FAMILIES]


@pytest.mark.parametrize("case", _cases())
def test_lifecycle(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    out = tmp_path / case
    out.mkdir()
    if case in IN_PROCESS:
        try:
            __import__(FRAMEWORK[case])
        except ImportError as error:
            pytest.skip(f"{FRAMEWORK[case]} cannot be imported here: {error}")
        IN_PROCESS[case](out)
    else:
        servers = request.getfixturevalue("servers")
        ok, output = servers.run([__file__, out, case], tmp_path / "logs", timeout=120.0)
        if not ok:
            pytest.fail(f"case {case} failed:\n{output[-8000:]}", pytrace=False)
        if (out / SKIP_FILE).exists():
            pytest.skip((out / SKIP_FILE).read_text())
    _assert_rows(out / RUN / "rank0", FAMILIES[case])


def _assert_rows(rank_dir: Path, families: Iterable[str]) -> None:
    """Every family has rows at each step, with finite values in every metric column."""
    import csv

    for family in families:
        path = rank_dir / f"{family}.csv"
        assert path.exists(), f"no {family} rows: {sorted(p.name for p in rank_dir.glob('*.csv'))}"
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert {int(row["step"]) for row in rows} == set(range(STEPS)), family
        for row in rows:
            values = {k: float(v) for k, v in row.items() if k not in ("vpp_stage", "name", "step", "micro_step")}
            assert values and all(math.isfinite(v) for v in values.values()), (family, row)


def main() -> None:
    """The subprocess cases: ``python test_lifecycle_all.py OUT CASE``."""
    out, case = Path(sys.argv[1]), sys.argv[2]
    try:
        __import__(FRAMEWORK[case])
    except ImportError:
        (out / SKIP_FILE).write_text(f"{FRAMEWORK[case]} cannot be imported here:\n{traceback.format_exc()[-2000:]}")
        return
    SUBPROCESS[case](out)
    print(json.dumps({"case": case, "done": True}))


if __name__ == "__main__":
    main()
