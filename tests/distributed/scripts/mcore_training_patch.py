"""Megatron-LM's ``pretrain``/``train``/``train_step`` (megatron/training/training.py at core_v0.16.1) reduced to the
lines that matter here, with the patch of docs/megatron.md applied as written there, on megatron-core with a tiny
GPTModel (PP=2 on two CPU processes, 2 micro-batches, gradient clipping on as Megatron's default ``clip_grad=1.0``).

``OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 mcore_training_patch.py OUT``

megatron-core's wheel has no ``megatron.training``: what ``train_step`` does around the optimizer is copied from
training.py (zero the grad buffers and the optimizer, ``forward_backward_func``, ``optimizer.step()``, the
maximum of the grad norm over the model-parallel group, the loss averaged over micro-batches on the last stage).
Each rank writes ``OUT/returned_rank{R}.json``: per iteration the ``grad_norm`` and ``lm loss`` that
``train_step`` returned, the references of the test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import mcore_cpu_shim  # CPU-only test shim, shared with examples/megatron_gpt.py

seed_all = mcore_cpu_shim.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402  (the patch's import)

B, S, V, MICRO, ITERS, START = 2, 16, 128, 2, 3, 5  # START: a run resumed from iteration 5 (args.iteration)


def get_num_microbatches() -> int:
    return MICRO


def setup_model_and_optimizer() -> tuple[list[torch.nn.Module], object]:
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S,
                   pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    model = [DDP(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)]
    cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), model)
    return model, optimizer


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    position_ids = torch.arange(S).expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
    output = model(tokens, position_ids, mask, labels=tokens)

    def loss_func(output_tensor):  # pretrain_gpt.py's loss_func, legacy reporting (one value per micro-batch)
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def train_step(forward_step_func, data_iterator, model, optimizer):
    """training.py's train_step, without the features this test does not use."""
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=get_num_microbatches(), seq_length=S, micro_batch_size=B, forward_only=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    # reduce_max_stat_across_model_parallel_group(grad_norm), as training.py does
    stat = torch.tensor([-1.0 if grad_norm is None else grad_norm], dtype=torch.float32)
    dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    grad_norm = None if stat.item() < 0 else stat.item()
    skipped_iter = 0 if update_successful else 1
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        loss_reduced = {key: torch.cat([x[key].view(-1) for x in losses_reduced]).mean()
                        for key in losses_reduced[0]}
        return loss_reduced, skipped_iter, grad_norm
    return {}, skipped_iter, grad_norm


def train(forward_step_func, model, optimizer, train_data_iterator, returned, monitor=None):
    iteration = START
    while iteration < START + ITERS:
        loss_dict, skipped_iter, grad_norm = train_step(forward_step_func, train_data_iterator, model, optimizer)
        if monitor is not None:  # loss_dict is {} off the last pipeline stage; grad_norm comes from optimizer.step()
            monitor.step(loss=loss_dict.get("lm loss"))
        returned[iteration] = {"grad_norm": grad_norm, "skipped_iter": skipped_iter,
                               "lm loss": float(loss_dict["lm loss"]) if loss_dict else None}
        iteration += 1
    return iteration


def pretrain(out: Path) -> None:
    mpu.initialize_model_parallel(pipeline_model_parallel_size=2)
    seed_all()
    model, optimizer = setup_model_and_optimizer()
    generator = torch.Generator().manual_seed(7)
    data = iter([torch.randint(0, V, (B, S), generator=generator) for _ in range(MICRO * ITERS)])
    returned: dict[int, dict] = {}
    # the patch (docs/megatron.md), with args.iteration == START
    monitor = TrainerMonitor(os.environ.get("TRAINMON_CONFIG", "monitor.yaml"))
    monitor.attach(model, optimizer, grad_acc_steps=get_num_microbatches(), start_step=START)
    try:
        train(forward_step, model, optimizer, data, returned, monitor=monitor)
    finally:
        monitor.close()
    (out / f"returned_rank{dist.get_rank()}.json").write_text(json.dumps(returned))
    mpu.destroy_model_parallel()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        pretrain(Path(sys.argv[1]))
    finally:
        dist.destroy_process_group()
