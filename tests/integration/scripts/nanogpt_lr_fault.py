"""A nanoGPT-style training script (Karpathy's nanoGPT ``model.py`` and ``train.py``, cut down to run on a CPU in
seconds) with trainmon added the way the README says, and a learning-rate bug: from ``--bad-step`` on, ``get_lr``
returns 100 times the scheduled rate (the kind of scheduler bug that ruins a run without a NaN).

    python tests/integration/scripts/nanogpt_lr_fault.py CONFIG [--bad-step 60] [--steps 80]

Prints ``iter {n}: loss {x}`` per step as nanoGPT does, and ``run_dir {path}`` at the end.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F

from trainmon import TrainerMonitor


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--bad-step", type=int, default=60)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    torch.manual_seed(1337)
    torch.set_num_threads(1)
    # the data: a character-level corpus, as nanoGPT's shakespeare_char (a repeated text here)
    text = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are "
            "all resolved rather to die than to famish? All: Resolved. resolved. ") * 40
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    block_size, batch_size = 32, 16

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block_size, (batch_size,))
        return (torch.stack([data[i:i + block_size] for i in ix]),
                torch.stack([data[i + 1:i + 1 + block_size] for i in ix]))

    learning_rate, warmup_iters, lr_decay_iters, min_lr = 3e-3, 10, 300, 3e-4

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            lr = learning_rate * (it + 1) / (warmup_iters + 1)
        else:
            ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
            lr = min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)
        return lr * 100 if 0 <= args.bad_step <= it else lr  # the bug

    model = GPT(len(chars), block_size, n_layer=2, n_head=4, n_embd=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    monitor = TrainerMonitor(args.config)        # trainmon, line 1
    monitor.attach(model, optimizer)             # trainmon, line 2
    for iter_num in range(args.steps):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        X, Y = get_batch()
        _, loss = model(X, Y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.step(loss=loss)                  # trainmon, line 3
        print(f"iter {iter_num}: loss {loss.item():.4f}", flush=True)
    monitor.close()
    print(f"run_dir {monitor.run_dir}", flush=True)


if __name__ == "__main__":
    main()
