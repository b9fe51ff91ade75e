"""Model features on a tiny Megatron-Core GPTModel on CPU (2 gloo ranks), with the script's own float64 references.

``OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 mcore_features_run.py OUT``

Case ``tp2`` (TP=2, 4 heads in 2 query groups: each rank holds 2 heads and 1 group): every core attention's query
and key, captured by the script's own pre-hook and all-gathered over the TP ranks, give the float64 features of all
4 global heads; the weights, all-gathered along their ``partition_dim``, give numpy's largest singular value.
Case ``moe`` (TP=1, DP=2, 4 experts, top-2, Megatron's ``TopKRouter`` and ``SequentialMLP``): the router's input and
weight give its logits in float64, its ``routing_map`` output the tokens per expert, its local experts' weights the
similarity. References go to ``OUT/{case}/refs_rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import mcore_cpu_shim  # CPU-only test shim, shared with examples/megatron_gpt.py

seed_all = mcore_cpu_shim.apply()

import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402

moe_utils.te_general_gemm = None  # CPU shim: without Transformer Engine this name is left undefined (a NameError)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402

B, S, V, M, STEPS = 2, 16, 64, 2, 2
HEADS, GROUPS, EXPERTS, TOP_K = 4, 2, 4, 2


def gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def head_features(q: np.ndarray, k: np.ndarray, scale: float) -> list[list[float]]:
    """Per global head, over every (sequence, position) row (B x S <= 64 query_rows: all of them), causal: the
    largest logit and the mean entropy. ``q``: [s, b, heads, d], ``k``: [s, b, groups, d]."""
    q, k = q.transpose(1, 2, 0, 3), k.transpose(1, 2, 0, 3)  # [b, h, s, d]
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    logits = q @ k.transpose(0, 1, 3, 2) * scale
    visible = np.tril(np.ones((q.shape[2], k.shape[2]), bool))
    out = []
    for h in range(q.shape[1]):
        rows = [logits[b, h, i][visible[i]] for b in range(q.shape[0]) for i in range(q.shape[2])]
        entropies = []
        for row in rows:
            p = np.exp(row - row.max())
            p /= p.sum()
            entropies.append(float(-(p * np.log(p)).sum()))
        out.append([float(max(row.max() for row in rows)), float(np.mean(entropies))])
    return out


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step + 17 * ps.get_data_parallel_rank())
    return [(tok, tok.roll(-1, dims=1)) for tok in (torch.randint(0, V, (B, S), generator=g) for _ in range(M))]


def run_case(name: str, out: Path) -> None:
    moe = name == "moe"
    tp = 1 if moe else 2
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_all()
    extra = dict(num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_token_dispatcher_type="allgather",
                 moe_aux_loss_coeff=0.0, add_bias_linear=False) if moe else dict(num_query_groups=GROUPS)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=HEADS, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False) if moe else get_gpt_layer_local_spec()
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=S)
    chunk = DDP(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e6), [chunk])
    features = {"attention": {"enabled": True}, "weights": {"enabled": True, "iterations": 200},
                "router": {"enabled": moe}}
    monitor = TrainerMonitor({"output_dir": str(out), "run_name": name, "sinks": ["csv"],
                              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
                              "features": features})
    monitor.attach([chunk], opt, grad_acc_steps=M)
    tp_group = ps.get_tensor_model_parallel_group()
    captured: dict[str, list] = {}
    handles = []
    for lname, layer in ((f"decoder.layers.{i}", layer) for i, layer in enumerate(gpt.decoder.layers)):
        core = layer.self_attention.core_attention

        def grab(module, args, kwargs, row=f"{lname}.self_attention.core_attention"):
            q, k = (gather(a.detach(), 2, tp_group).double().numpy() for a in args[:2])
            captured.setdefault(row, []).append(head_features(q, k, module.softmax_scale))

        handles.append(core.register_forward_pre_hook(grab, with_kwargs=True))
        if moe:
            def routed(module, args, output, row=f"{lname}.mlp.router", experts=layer.mlp.experts):
                hidden = args[0].detach().double().reshape(-1, module.weight.shape[1]).numpy()
                logits = hidden @ module.weight.detach().double().numpy().T
                counts = output[1].detach().reshape(-1, EXPERTS).sum(0).double().numpy()
                log_norm = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
                probs = np.exp(logits - log_norm[:, None])
                chosen = np.argsort(-logits, axis=1)[:, :TOP_K]  # the top-k of the float64 logits
                vectors = np.stack([np.concatenate([p.detach().double().numpy().ravel() for p in e.parameters()])
                                    for e in experts.local_experts])
                unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
                gram = unit @ unit.T
                captured.setdefault(row, []).append({
                    "imbalance": float(counts.max() / counts.mean()),
                    "entropy": float(-(probs * np.log(probs)).sum(1).mean()),
                    "z_loss": float((log_norm ** 2).mean()),
                    "expert_similarity": float(gram[~np.eye(len(vectors), dtype=bool)].mean()),
                    "tokens": counts.tolist(),
                    "tokens_from_logits": np.bincount(chosen.ravel(), minlength=EXPERTS).tolist()})

            handles.append(layer.mlp.router.register_forward_hook(routed))
    refs: dict[str, dict] = {}
    for step in range(STEPS):
        captured.clear()
        data = iter(batches(step))

        def step_fn(it, mod):
            tok, labels = next(it)
            pos = torch.arange(S).expand(tok.shape[0], S)
            mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
            output = mod(tok, pos, mask, labels=labels)
            return output, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        chunk.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(forward_step_func=step_fn, data_iterator=data, model=[chunk], num_microbatches=M,
                                    seq_length=S, micro_batch_size=B, forward_only=False)
        opt.step()
        monitor.step()
        weights = {}
        for pname, p in gpt.named_parameters():
            if p.dim() != 2:
                continue
            whole = gather(p.detach(), p.partition_dim, tp_group) if getattr(p, "tensor_model_parallel", False) \
                else p.detach()
            matrix = whole.double().numpy()
            sigma = float(np.linalg.svd(matrix, compute_uv=False)[0])
            weights[pname] = {"spectral_norm": sigma, "stable_rank": float((matrix ** 2).sum() / sigma ** 2)}
        refs[str(step)] = {"captured": {k: v for k, v in captured.items()}, "weights": weights}
    for handle in handles:
        handle.remove()
    monitor.close()
    with open(out / name / f"refs_rank{dist.get_rank()}.json", "w") as f:
        json.dump({"tp_rank": ps.get_tensor_model_parallel_rank(), "tp": tp, "steps": refs}, f)
    ps.destroy_model_parallel()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        for name in ("tp2", "moe"):
            run_case(name, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
