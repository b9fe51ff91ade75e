"""Tiny real torch models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    """Embedding -> 2 residual MLP blocks -> head; sized for millisecond steps."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(seed: int, n: int = 4, seq: int = 8, vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class InPlaceMLP(nn.Module):
    """Linear -> ReLU(inplace=True) -> Linear: in-place ops on a target's output."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, inplace: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU(inplace=inplace)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TwoOutputs(nn.Module):
    """Returns ``(a, b)``; a loss on ``b`` only leaves ``a`` without a gradient."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc_a = nn.Linear(d, d)
        self.fc_b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc_a(x), self.fc_b(x)


class TwoOutputsNet(nn.Module):
    """A projection, then :class:`TwoOutputs`; the loss uses ``b``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.pair = TwoOutputs(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, b = self.pair(self.proj(x))
        return b
