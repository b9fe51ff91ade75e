"""FSDP2 on CUDA (one rank, NCCL): grad probe, dump and free benchmark on device tensors.

The 2-rank CPU tests (``tests/distributed/test_fsdp2_features.py``) check the combination of shards; this
one checks the CUDA paths (pinned non-blocking copies of the probe, the dump's host copies of unsharded
CUDA parameters, the re-run on CUDA) against float64 numpy of ``full_tensor()``.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def test_fsdp2_probe_dump_and_free_benchmark_on_cuda(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.launch import free_port
    from trainmon import TrainerMonitor
    from trainmon.probe.storage import direction_path, read_direction_header

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 1)).cuda()
        mesh = init_device_mesh("cuda", (1,))
        for block in (model[1], model[2]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        names = {id(p): name for name, p in model.named_parameters()}
        grads: dict[str, np.ndarray] = {}
        params: dict[str, np.ndarray] = {}
        step = {"n": 0}

        def pre_hook(opt, args, kwargs):
            for p in (p for group in opt.param_groups for p in group["params"]):
                grads[f"{step['n']}|{names[id(p)]}"] = p.grad.full_tensor().double().cpu().numpy()

        optimizer.register_step_pre_hook(pre_hook)
        monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "cuda", "sinks": ["csv"],
                                  "grad_probe": {"enabled": True, "level": "L2"},
                                  "dump": {"enabled": True, "mode": "tensor"},
                                  "free_benchmark": {"enabled": True, "pert_mode": "change_value"}})
        monitor.attach(model, optimizer)
        monitor.dump(["1.fc1"], steps=[1])
        monitor.free_benchmark(["1", "1.fc1"], steps=[1])
        generator = torch.Generator().manual_seed(1)
        for n in range(3):
            step["n"] = n
            x, y = torch.randn(32, 8, generator=generator).cuda(), torch.randn(32, 1, generator=generator).cuda()
            if n == 1:
                params = {name: p.detach().full_tensor().double().cpu().numpy() for name, p in model.named_parameters()}
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
        bench = monitor._session.actions["free_benchmark"]
        results = sorted(r.name for r in bench.results)
        monitor.close()
    finally:
        dist.destroy_process_group()
    rank_dir = tmp_path / "cuda" / "rank0"
    summary = pd.read_csv(rank_dir / "grad_probe" / "grad_summary.csv", keep_default_na=False, na_values=["nan"])
    assert len(summary) == 3 * len(names)
    for key, grad in grads.items():
        n, name = key.split("|")
        row = summary[(summary.name == name) & (summary.step == int(n))].iloc[0]
        g = grad.ravel()
        for column, want in (("max", g.max()), ("min", g.min()), ("norm", np.linalg.norm(g))):
            assert np.isclose(float(row[column]), want, rtol=1e-5, atol=1e-7), (key, column)
        bits = read_direction_header(direction_path(rank_dir / "grad_probe", int(n), name, 0)).bits()
        np.testing.assert_array_equal(bits, np.packbits(g > 0, bitorder="little"))
    dump_dir = rank_dir / "dump" / "step1"
    fc1 = json.loads((dump_dir / "dump.json").read_text())["data"]["Module.1.fc1.Linear.forward.0"]
    saved = torch.load(dump_dir / "dump_tensor_data" / fc1["parameters"]["weight"]["data_name"], weights_only=True)
    np.testing.assert_allclose(saved.double().numpy(), params["1.fc1.weight"], rtol=1e-6)
    assert results == ["1", "1.fc1"]  # the block (an FSDP module) re-run before FSDP reshards it
