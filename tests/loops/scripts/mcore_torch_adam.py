"""NVIDIA's examples/run_simple_mcore_train_loop.py shape: a Megatron-Core GPTModel (no Megatron DDP)
trained with a plain ``torch.optim.Adam`` through ``get_forward_backward_func``, on one gloo rank.

``python mcore_torch_adam.py OUT``: writes the monitor's run to ``OUT/run`` and, as the reference,
the gradients the optimizer used (its own step pre-hook, float64) to ``OUT/used.npz``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import mcore_cpu_shim  # CPU-only test shim, shared with examples/megatron_gpt.py

seed_all = mcore_cpu_shim.apply()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    seed_all()
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            pipeline_dtype=torch.float32)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                   max_sequence_length=16)
    optimizer = torch.optim.Adam(gpt.parameters(), lr=1e-3)
    monitor = TrainerMonitor({"output_dir": str(out), "run_name": "run", "sinks": ["csv"],
                              "weight_grads": {"metrics": ["norm", "min", "max", "mean"]},
                              "params": {"enabled": True}})
    monitor.attach(gpt, optimizer)
    used: dict[str, np.ndarray] = {}
    step = 0

    def capture(opt, args, kwargs):
        for name, p in gpt.named_parameters():
            if p.grad is not None:
                used[f"{step}|{name}"] = p.grad.detach().double().numpy()

    handle = optimizer.register_step_pre_hook(capture)
    B, S = 2, 16
    tok = torch.randint(0, 128, (B, S))
    pos = torch.arange(S).expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)

    def step_fn(data_iterator, model):
        out = model(tok, pos, mask, labels=tok)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    for step in range(3):  # noqa: B007 - capture() reads it
        optimizer.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=step_fn, data_iterator=None, model=[gpt],
                                             num_microbatches=1, seq_length=S, micro_batch_size=B,
                                             forward_only=False)
        optimizer.step()
        monitor.step(loss=losses[0]["loss"])
    monitor.close()
    handle.remove()
    np.savez(out / "used.npz", **used)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
