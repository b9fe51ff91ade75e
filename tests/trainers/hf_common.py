"""What the HF Trainer tests share (in-process and in the processes of ``scripts/hf_train.py``): padded
causal-LM data, the models, and the test's own references read from the tensors the Trainer really used
(float64 numpy), never from trainmon."""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB, SEQ = 64, 16


class PaddedTokens(torch.utils.data.Dataset):
    """Random token rows of random lengths (3 to ``SEQ``), right-padded: ``labels`` is -100 on the padding,
    so the micro-batches hold different numbers of items."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.lengths = torch.randint(3, SEQ + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        mask = (torch.arange(SEQ) < self.lengths[i]).long()
        ids = torch.where(mask.bool(), self.ids[i], 0)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def gpt2() -> torch.nn.Module:
    """A randomly initialised 2-layer GPT-2 (its forward takes ``**kwargs``: the Trainer passes it
    ``num_items_in_batch``)."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class NoKwargsLM(torch.nn.Module):
    """A user's own causal LM whose ``forward`` takes no ``**kwargs``: the Trainer passes no
    ``num_items_in_batch`` and divides each micro-batch's mean loss by the accumulation steps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.hidden = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> dict:
        logits = self.head(torch.tanh(self.hidden(self.embed(input_ids))))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        return {"loss": loss, "logits": logits}


class LossReference:
    """The test's own forward hook: per training forward, the float64 sum of the token losses (next-token
    prediction: logits ``[:, :-1]`` against labels ``[:, 1:]``, -100 ignored), computed with numpy from the
    logits the model produced and the labels it was given, with two item counts: the predicted tokens
    (``labels[:, 1:] != -100``) and every label (``labels != -100``). The Trainer counts ``num_items_in_batch``
    the second way for a model whose ``loss_type`` is not a causal-LM one (``GPT2LMHeadModel``'s is None:
    ``Trainer._loss_shifts_labels`` is False), so its logged loss divides by that count."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.micro: list[tuple[float, int, int]] = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        logits = output["logits"].detach().double().numpy()[:, :-1]
        labels = kwargs["labels"].numpy()[:, 1:]
        keep = labels != -100
        top = logits.max(-1, keepdims=True)
        logsumexp = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        picked = np.take_along_axis(logits, np.where(keep, labels, 0)[..., None], -1)[..., 0]
        every_label = int((kwargs["labels"].numpy() != -100).sum())
        self.micro.append((float(((logsumexp - picked) * keep).sum()), int(keep.sum()), every_label))


def trainer_counts_every_label(model: torch.nn.Module) -> bool:
    """Whether the Trainer counts ``num_items_in_batch`` over every label rather than the predicted ones (its
    rule in transformers 5: labels ``[..., 1:]`` only for a model whose ``loss_type`` maps to ``ForCausalLMLoss``)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is not ForCausalLMLoss


def expected_losses(micro_per_rank: list[list[tuple[float, int, int]]], acc: int, *, normalised: bool,
                    across_ranks: bool, every_label: bool = False) -> list[float]:
    """The loss of each step in float64, as the Trainer defines it (transformers 5):

    - ``normalised`` (the model takes ``num_items_in_batch``): the summed token loss of the accumulated batch
      over its items, every rank's when ``across_ranks`` (``average_tokens_across_devices``), else each rank's
      own, averaged over the ranks; items counted over every label with ``every_label``;
    - otherwise: the mean over micro-batches of each micro-batch's token mean, averaged over the ranks.
    """
    steps = len(micro_per_rank[0]) // acc
    items = 2 if every_label else 1
    out = []
    for step in range(steps):
        chunks = [np.array(micro[step * acc:(step + 1) * acc], dtype=np.float64) for micro in micro_per_rank]
        if normalised and across_ranks:
            out.append(sum(c[:, 0].sum() for c in chunks) / sum(c[:, items].sum() for c in chunks))
        elif normalised:
            out.append(float(np.mean([c[:, 0].sum() / c[:, items].sum() for c in chunks])))
        else:
            out.append(float(np.mean([np.mean(c[:, 0] / c[:, 1]) for c in chunks])))
    return out
