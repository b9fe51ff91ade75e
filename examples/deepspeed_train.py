"""Monitor a DeepSpeed ZeRO run with trainmon (CPU works: gloo + DS_ACCELERATOR=cpu).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_train.py --stage 3
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed_train.py --stage 2   # same
    python examples/deepspeed_train.py --stage 1                                      # one process

Options: --stage 0..3, --bf16, --gas N (gradient accumulation), --steps N, --out DIR,
--no-monitor (plain run, for timing). Prints the step time and where the statistics went.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_env import single_process_env

single_process_env()

import deepspeed  # noqa: E402
import torch  # noqa: E402
from tiny_gpt import TinyGPT, gpt_loss, make_batch  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="./trainmon_output")
    parser.add_argument("--no-monitor", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip a slow CPU-only JIT build
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = torch.distributed.get_rank()

    torch.manual_seed(0)
    model = TinyGPT()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": args.gas,
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    monitor = None
    if not args.no_monitor:
        monitor = TrainerMonitor({"output_dir": args.out, "run_name": f"deepspeed_zero{args.stage}",
                                  "activations": {"enabled": True}, "sinks": ["csv"]})
        monitor.attach(engine)  # all a DeepSpeed user writes (plus monitor.step(loss) if you want the loss)

    start = time.perf_counter()
    for step in range(args.steps):
        for micro in range(args.gas):
            tokens, targets = make_batch(1000 * step + 10 * rank + micro, 4, 64, 256)
            loss = gpt_loss(engine, tokens, targets)
            engine.backward(loss)
            engine.step()  # updates on the accumulation boundary; trainmon follows engine.global_steps
            if monitor is not None:
                monitor.step(loss=loss)  # optional: records loss/micro{i}, and `loss` on the boundary
    elapsed = (time.perf_counter() - start) / args.steps
    run_dir = monitor.run_dir if monitor is not None else None
    if monitor is not None:
        monitor.close()
    if rank == 0:
        print(f"ZeRO-{args.stage}{' bf16' if args.bf16 else ''}: {elapsed * 1000:.1f} ms/step, "
              f"global_steps={engine.global_steps}")
        if run_dir is not None:
            print(f"statistics in {run_dir}:")
            for path in sorted(run_dir.glob("rank*/*.csv")):
                print(f"  {path.relative_to(run_dir)}  ({sum(1 for _ in path.open()) - 1} rows)")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
