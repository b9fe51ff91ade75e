"""Monitor a Megatron-Core GPTModel with trainmon (TP / PP / VPP / DP, distributed optimizer, bf16).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/megatron_gpt.py --tp 2
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/megatron_gpt.py --pp 2 --vpp 2
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/megatron_gpt.py --distributed-optimizer --bf16

Options: --tp, --pp, --vpp (virtual pipeline chunks per stage), --distributed-optimizer, --bf16,
--micro-batches N, --steps N, --out DIR, --no-monitor (plain run, for timing). On a machine without CUDA the
script applies ``examples/mcore_cpu_shim.py``, a **CPU-only test shim** that patches torch and Megatron globally so
that Megatron-Core 0.16 runs on CPU with gloo; on GPUs (nccl) nothing is patched.
The trainmon lines are marked ``# trainmon``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

CPU = not torch.cuda.is_available()
if CPU:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mcore_cpu_shim  # CPU-only test shim, not part of trainmon

    seed_all = mcore_cpu_shim.apply()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402  # trainmon

VOCAB, SEQ = 128, 16


def build(args: argparse.Namespace) -> tuple[list[torch.nn.Module], object, TransformerConfig]:
    """Model chunks (one per virtual stage) and the optimizer, as Megatron's get_model does."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    cfg = TransformerConfig(num_layers=2 * args.pp * (args.vpp or 1), hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=CPU, tensor_model_parallel_size=args.tp,
                            pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp,
                            pipeline_dtype=dtype, bf16=args.bf16, params_dtype=dtype)
    chunks = []
    for stage in range(args.vpp or 1):
        if args.vpp:
            kw = dict(vp_stage=stage, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                      post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage))
        else:
            kw = dict(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        module = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                          max_sequence_length=SEQ, **kw)
        if args.bf16:
            module = Float16Module(cfg, module)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer,
                                                   grad_reduce_in_fp32=True)
        chunks.append(DDP(config=cfg, ddp_config=ddp_config, module=module, disable_bucketing=stage > 0))
    cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=args.bf16,
                                                       use_distributed_optimizer=args.distributed_optimizer),
                                       chunks)
    return chunks, optimizer, cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="./trainmon_output")
    parser.add_argument("--no-monitor", action="store_true")
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo" if CPU else "nccl")
    if not CPU:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                 virtual_pipeline_model_parallel_size=args.vpp)
    if CPU:
        seed_all()
    else:
        model_parallel_cuda_manual_seed(123)
    chunks, optimizer, cfg = build(args)

    monitor = TrainerMonitor({"output_dir": args.out, "activations": {"enabled": True},  # trainmon
                              "targets": {"modules": ["decoder.layers.*", "decoder.layers.*.mlp"]},
                              "enabled": not args.no_monitor})
    monitor.attach(chunks, optimizer, grad_acc_steps=args.micro_batches)  # trainmon: groups from parallel_state

    device = "cpu" if CPU else "cuda"
    batch = 4 // ps.get_data_parallel_world_size() if ps.get_data_parallel_world_size() <= 4 else 1
    generator = torch.Generator().manual_seed(ps.get_data_parallel_rank())

    def forward_step(data_iterator: object, model: torch.nn.Module) -> tuple[torch.Tensor, object]:
        tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=generator).to(device)
        position_ids = torch.arange(SEQ, device=device).expand(batch, SEQ)
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).triu(1).view(1, 1, SEQ, SEQ)
        output = model(tokens, position_ids, mask, labels=tokens.roll(-1, dims=1))
        return output, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    forward_backward = get_forward_backward_func()
    start = time.perf_counter()
    for step in range(args.steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=[None] * len(chunks),
                                  model=chunks, num_microbatches=args.micro_batches, seq_length=SEQ,
                                  micro_batch_size=batch, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        # The loss exists on the last pipeline stage only (losses == [] elsewhere).
        loss = torch.stack([item["lm loss"] for item in losses]).mean() if losses else None
        monitor.step(loss=loss)  # trainmon
        if losses and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f} grad norm {grad_norm:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    run_dir = monitor.run_dir
    monitor.close()  # trainmon
    if torch.distributed.get_rank() == 0:
        print(f"{args.steps} steps in {elapsed:.2f} s; statistics in {run_dir}")
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
