"""Model features (docs/features.md) on real models, against float64 numpy references from the same tensors.

- ``attn``: a nanoGPT-style model (``scaled_dot_product_attention`` with ``is_causal``) and HF Llama with grouped
  query heads and right padding (``sdpa`` and ``eager``): the test captures each attention module's input with its own
  hook, recomputes q and k in float64 (HF's rotary embedding applied by HF's own function), materialises the full
  seq x seq logits of every head, and reads the sampled rows (the documented rule, re-implemented here);
- ``weight_features``: the power-iteration estimate against ``numpy.linalg.svd`` of the same weights;
- ``router`` / ``expert_load``: HF Mixtral's own router logits (``output_router_logits``), its top-k from them,
  and the experts' weights, in float64.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainmon import TrainerMonitor
from trainmon.errors import ConfigError, TargetError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_gpt import TinyGPT, gpt_loss, make_batch

RTOL = 2e-5  # float32 logits against float64


def sampled_rows(batch: int, queries: int, wanted: int) -> tuple[list[int], list[int]]:
    """The documented sampling rule: at most ``wanted`` sequences evenly spaced from the first, ceil(wanted /
    sequences) positions evenly spaced up to the last."""
    sequences = min(batch, wanted)
    positions = min(queries, math.ceil(wanted / sequences))
    return [j * batch // sequences for j in range(sequences)], [(m + 1) * queries // positions - 1
                                                                 for m in range(positions)]


def head_reference(logits: np.ndarray, visible: np.ndarray, batch_rows: list[int], positions: list[int]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per head, from the full ``[batch, heads, q, k]`` float64 logits and the visibility mask: the largest visible
    logit and the mean entropy over the sampled rows that see a key."""
    heads = logits.shape[1]
    max_logit, entropy = np.full(heads, -np.inf), np.zeros(heads)
    for h in range(heads):
        entropies = []
        for b in batch_rows:
            for i in positions:
                seen = visible[b, h, i]
                if not seen.any():
                    continue
                row = logits[b, h, i][seen]
                max_logit[h] = max(max_logit[h], row.max())
                p = np.exp(row - row.max())
                p /= p.sum()
                entropies.append(-(p * np.log(p)).sum())
        entropy[h] = np.mean(entropies)
    return max_logit, entropy


def rows_of(record, family: str) -> dict[str, dict[str, float]]:
    return {row.name: dict(row.values) for row in record.rows if row.family == family}


# ----------------------------------------------------------------------------------------- nanoGPT (SDPA)
def _gpt_inputs(model: TinyGPT) -> tuple[dict[str, list], list]:
    """A pre-hook on each block's attention recording its input and its qkv weights as the forward used them."""
    seen: dict[str, list] = {}
    handles = []
    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}.attn"

        def hook(module, args, name=name):
            seen.setdefault(name, []).append((args[0].detach().double().numpy(),
                                              module.qkv.weight.detach().double().numpy(),
                                              module.qkv.bias.detach().double().numpy()))

        handles.append(block.attn.register_forward_pre_hook(hook))
    return seen, handles


@pytest.mark.parametrize("query_rows", [6, 64])  # a sample (4 sequences x 2 positions), every row (4 x 16)
def test_sdpa_heads_match_float64(tmp_path, query_rows):
    torch.manual_seed(0)
    batch, seq, heads = 4, 16, 4
    model = TinyGPT(vocab=64, d=32, layers=2, heads=heads, seq=seq)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen, handles = _gpt_inputs(model)
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False},
              "features": {"attention": {"enabled": True, "query_rows": query_rows}}}
    records = []
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(2):
            tokens, targets = make_batch(step, batch, seq, 64)
            loss = gpt_loss(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(monitor.step(loss=loss))
    for handle in handles:
        handle.remove()
    if query_rows == 64:
        batch_rows, positions = list(range(batch)), list(range(seq))
    else:
        batch_rows, positions = sampled_rows(batch, seq, query_rows)
        assert (batch_rows, positions) == ([0, 1, 2, 3], [7, 15])
    causal = np.tril(np.ones((seq, seq), bool))[None, None].repeat(batch, 0).repeat(heads, 1)
    for step, record in enumerate(records):
        got = rows_of(record, "attn")
        assert len(got) == 2 * heads
        for name, calls in seen.items():
            x, weight, bias = calls[step]
            qkv = (x @ weight.T + bias).reshape(batch, seq, 3, heads, -1).transpose(2, 0, 3, 1, 4)
            q, k = qkv[0], qkv[1]
            logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
            max_logit, entropy = head_reference(logits, causal, batch_rows, positions)
            for h in range(heads):
                values = got[f"{name}.head{h}"]
                assert values["max_logit"] == pytest.approx(max_logit[h], rel=RTOL), (step, name, h)
                assert values["entropy"] == pytest.approx(entropy[h], rel=RTOL), (step, name, h)


# ----------------------------------------------------------------------------------------- HF Llama
def _llama(attn: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation=attn)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_llama_grouped_heads_with_padding_match_float64(tmp_path, attn):
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _llama(attn)
    batch, seq, heads, groups = 3, 12, 4, 2
    seen: dict[str, tuple] = {}

    def capture(name):
        @torch.no_grad()
        def hook(module, args, kwargs):
            hidden = (args[0] if args else kwargs["hidden_states"]).detach().double()
            cos, sin = (t.detach().double() for t in kwargs["position_embeddings"])
            size = module.head_dim
            q = torch.nn.functional.linear(hidden, module.q_proj.weight.double()).view(batch, seq, -1, size)
            k = torch.nn.functional.linear(hidden, module.k_proj.weight.double()).view(batch, seq, -1, size)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # HF's own rotary
            seen[name] = (q.numpy(), k.numpy(), module.scaling)
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(capture(f"model.layers.{i}.self_attn"), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    tokens = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 9:] = 0  # right padding: the padded keys are masked for every query
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "features": {"attention": {"enabled": True, "query_rows": 9}}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        out = model(input_ids=tokens, attention_mask=mask, labels=tokens, use_cache=False)
        out.loss.backward()
        optimizer.step()
        record = monitor.step(loss=out.loss)
    for handle in handles:
        handle.remove()
    got = rows_of(record, "attn")
    assert sorted(got) == sorted(f"model.layers.{i}.self_attn.head{h}" for i in range(2) for h in range(heads))
    batch_rows, positions = sampled_rows(batch, seq, 9)
    visible = np.tril(np.ones((seq, seq), bool))[None, None] & (mask.numpy()[:, None, None, :] > 0)
    visible = np.broadcast_to(visible, (batch, heads, seq, seq))
    for name, (q, k, scaling) in seen.items():
        k = np.repeat(k, heads // groups, axis=1)  # query head h reads key head h // 2
        logits = q @ k.transpose(0, 1, 3, 2) * scaling
        max_logit, entropy = head_reference(logits, visible, batch_rows, positions)
        for h in range(heads):
            values = got[f"{name}.head{h}"]
            assert values["max_logit"] == pytest.approx(max_logit[h], rel=RTOL), (attn, name, h)
            assert values["entropy"] == pytest.approx(entropy[h], rel=RTOL), (attn, name, h)


# ----------------------------------------------------------------------------------------- weights
def test_power_iteration_spectral_norm_and_stable_rank_match_svd(tmp_path):
    """Fixed weights (lr 0): 4 iterations per collected step; after 10 collected steps (40 iterations from a random
    start) every matrix's spectral norm is within 1e-3 of numpy's largest singular value, its stable rank within
    2e-3 (it divides by sigma squared). These randomly initialised matrices have sigma_2 / sigma_1 up to 0.99 and
    need 11 to 36 iterations (docs/features.md)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["parquet"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "features": {"weights": {"enabled": True, "iterations": 4}}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(10):
            tokens, targets = make_batch(step, 2, 16, 64)
            loss = gpt_loss(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record = monitor.step(loss=loss)
    got = rows_of(record, "weight_features")
    matrices = {name: p.detach().double().numpy() for name, p in model.named_parameters() if p.dim() == 2}
    assert sorted(got) == sorted(matrices)
    for name, weight in matrices.items():
        sigma = np.linalg.svd(weight, compute_uv=False)[0]
        assert got[name]["spectral_norm"] == pytest.approx(sigma, rel=1e-3), name
        assert got[name]["spectral_norm"] <= sigma * (1 + 1e-6), name  # a lower bound
        assert got[name]["stable_rank"] == pytest.approx((weight ** 2).sum() / sigma ** 2, rel=2e-3), name
    from trainmon.tools.store import open_run

    stored = open_run(tmp_path / "r").sql("SELECT rank, name, step, spectral_norm, stable_rank FROM weight_features "
                                          "WHERE step = 9").df()
    assert set(stored["rank"]) == {0} and len(stored) == len(matrices)
    for row in stored.itertuples():
        assert row.spectral_norm == pytest.approx(got[row.name]["spectral_norm"], rel=1e-6)


def test_power_iteration_follows_training_weights(tmp_path):
    """Adam at lr 1e-3 moves the weights every step; the default 2 iterations per collected step, continued from
    step to step, bring the estimate within 1e-3 of the moving sigma_1 after 30 steps."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=1, heads=4, seq=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False},
              "features": {"weights": {"enabled": True, "params": ["blocks.*"]}}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(30):
            tokens, targets = make_batch(step, 2, 16, 64)
            loss = gpt_loss(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record = monitor.step(loss=loss)
    got = rows_of(record, "weight_features")
    assert sorted(got) == ["blocks.0.attn.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight",
                           "blocks.0.mlp.fc2.weight"]
    for name, values in got.items():
        weight = model.get_parameter(name).detach().double().numpy()
        assert values["spectral_norm"] == pytest.approx(np.linalg.svd(weight, compute_uv=False)[0], rel=1e-3), name


# ----------------------------------------------------------------------------------------- router (HF Mixtral)
def _mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32,
                                        output_router_logits=True)
    torch.manual_seed(2)
    return transformers.MixtralForCausalLM(config)


def test_mixtral_router_features_match_its_own_logits(tmp_path):
    model = _mixtral()
    experts, top_k = 4, 2
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "features": {"router": {"enabled": True}}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():  # HF puts its output-recording hooks on at the first forward: before the monitor's
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    router_logits = []
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=2)
        for micro in range(2):
            tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(micro))
            out = model(input_ids=tokens, labels=tokens)
            router_logits.append([t.detach().double().numpy() for t in out.router_logits])  # the model's own
            out.loss.backward()
        optimizer.step()
        record = monitor.step(loss=out.loss)
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    rows = [(row.name, row.key.micro_step, dict(row.values)) for row in record.rows if row.family == "router"]
    assert sorted((name, micro) for name, micro, _ in rows) == sorted((r, m) for r in routers for m in range(2))
    load = {(row.name, row.key.micro_step): dict(row.values) for row in record.rows if row.family == "expert_load"}
    assert len(load) == 2 * 2 * experts
    for name, micro, values in rows:
        layer = routers.index(name)
        logits = router_logits[micro][layer]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=1)) + logits.max(axis=1)
        probs = np.exp(logits - log_norm[:, None])
        chosen = np.argsort(-probs, axis=1)[:, :top_k]
        counts = np.bincount(chosen.ravel(), minlength=experts).astype(float)
        assert values["imbalance"] == pytest.approx(counts.max() / counts.mean(), rel=1e-6), name
        assert values["entropy"] == pytest.approx(-(probs * np.log(probs)).sum(axis=1).mean(), rel=RTOL), name
        assert values["z_loss"] == pytest.approx((log_norm ** 2).mean(), rel=RTOL), name
        for e in range(experts):
            assert load[(f"{name}.expert{e}", micro)] == pytest.approx(
                {"tokens": counts[e], "share": counts[e] / counts.sum()}, rel=1e-6)
        block = model.get_submodule(name.rpartition(".")[0]).experts
        vectors = np.concatenate([p.detach().double().numpy().reshape(experts, -1)
                                  for p in block.parameters(recurse=False)], axis=1)
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        gram = unit @ unit.T
        pairs = gram[~np.eye(experts, dtype=bool)].mean()
        assert values["expert_similarity"] == pytest.approx(pairs, rel=1e-4, abs=1e-6), name


# ----------------------------------------------------------------------------------------- the step model
def test_micro_steps_checkpointing_and_a_raising_forward(tmp_path):
    """Rows per micro-step; a forward re-run by activation checkpointing inside the backward adds none; a forward
    that raises leaves torch's function-mode stack as it was; no hook is left (the conftest fixture)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner: TinyGPT) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            inner = self.inner
            x = inner.tok(tokens) + inner.pos(torch.arange(tokens.shape[1]))
            for block in inner.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return inner.head(inner.ln_f(x))

    torch.manual_seed(0)
    model = Checkpointed(TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    modes = torch._C._len_torch_function_stack()
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"],
              "features": {"attention": {"enabled": True}, "weights": {"enabled": True}}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=3)
        for micro in range(3):
            tokens, targets = make_batch(micro, 2, 16, 64)
            gpt_loss(model, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        record = monitor.step()
        attn = [(row.name, row.key.micro_step) for row in record.rows if row.family == "attn"]
        assert sorted(attn) == sorted((f"inner.blocks.{b}.attn.head{h}", m)
                                      for b in range(2) for h in range(4) for m in range(3))
        assert torch._C._len_torch_function_stack() == modes
        failing = model.inner.blocks[1].attn.proj
        handle = failing.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("user's bug")))
        with pytest.raises(RuntimeError, match="user's bug"):
            model(make_batch(5, 2, 16, 64)[0])
        handle.remove()
        assert torch._C._len_torch_function_stack() == modes
        tokens, targets = make_batch(6, 2, 16, 64)
        gpt_loss(model, tokens, targets).backward()
        optimizer.step()
        record = monitor.step()
        assert sum(row.family == "attn" for row in record.rows) == 8
        assert not any(row.nonfinite for row in record.rows)
    assert torch._C._len_torch_function_stack() == modes


def test_uncollected_steps_install_no_feature_hook(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=1, heads=4, seq=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "step_interval": 2,
              "features": {"attention": {"enabled": True}, "router": {"enabled": True, "modules": ["blocks.0.mlp"]}}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        counts = []
        for step in range(2):
            counts.append(len(model.blocks[0].attn._forward_pre_hooks) + len(model.blocks[0].mlp._forward_hooks))
            tokens, targets = make_batch(step, 2, 16, 64)
            gpt_loss(model, tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
        monitor.close()  # closing twice leaves nothing behind either (the conftest fixture checks the hooks)
    assert counts == [2, 0]


def test_bad_feature_config_fails_with_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"features.attention.inputs"):
        TrainerMonitor({"features": {"attention": {"inputs": "bhsd"}}})
    with pytest.raises(ConfigError, match=r"features.weights.iterations"):
        TrainerMonitor({"features": {"weights": {"iterations": 0}}})
    model = TinyGPT(vocab=64, d=32, layers=1, heads=4, seq=16)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "features": {"attention": {"enabled": True,
                                                                                      "modules": ["blocks.9.attn"]}}})
    with pytest.raises(TargetError, match=r"features.attention.modules"):
        monitor.attach(model)
    monitor.close()
    with pytest.raises(ConfigError, match=r"anomaly.detectors\[0\].series\[0\]"):
        TrainerMonitor({"anomaly": {"detectors": [{"type": "spike", "series": ["attn/*/norm"]}]}})
    TrainerMonitor({"anomaly": {"detectors": [{"type": "spike", "series": ["attn/*/max_logit"]}]}}).close()


# ----------------------------------------------------------------------------------------- msprobe's L2 config
class _CoreAttention(torch.nn.Module):
    """A core attention as msprobe's ``attention_hook`` expects it: ``(q, k, v)`` in ``[s, b, h, d]``, causal."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
        causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, -math.inf).softmax(-1)
        return torch.einsum("bhst,tbhd->sbhd", probs, v).flatten(2)


class _Layer(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.linear_qkv = torch.nn.Linear(d, 3 * d)
        self.core_attention = _CoreAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, d]
        q, k, v = self.linear_qkv(x).view(x.shape[0], x.shape[1], 3, self.heads, -1).unbind(2)
        return x + self.core_attention(q, k, v)


def test_msprobe_l2_config_measures_its_modules(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = tmp_path / "monitor.json"
    path.write_text('{"recording_l2_features": true, "format": "csv", "l2_targets": '
                    '{"attention_hook": ["0:1.core_attention"], "linear_hook": []}}')
    torch.manual_seed(0)
    seq, batch, d, heads = 10, 3, 16, 2
    model = torch.nn.Sequential()
    model.add_module("embedding", torch.nn.Embedding(32, d))
    model.add_module("layers", torch.nn.Sequential(_Layer(d, heads), _Layer(d, heads)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = []
    handle = model.layers[1].core_attention.register_forward_pre_hook(
        lambda module, args: captured.append([a.detach().double().numpy() for a in args[:2]]))
    with TrainerMonitor.from_msprobe(path) as monitor:
        monitor.attach(model, optimizer)
        loss = model(torch.randint(0, 32, (seq, batch))).square().mean()
        loss.backward()
        optimizer.step()
        record = monitor.step(loss=loss)
    handle.remove()
    attn = rows_of(record, "attn")
    assert sorted(attn) == ["layers.1.core_attention.head0", "layers.1.core_attention.head1"]
    q, k = (a.transpose(1, 2, 0, 3) for a in captured[0])  # [s, b, h, d] -> [b, h, s, d]
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    visible = np.broadcast_to(np.tril(np.ones((seq, seq), bool)), logits.shape)
    max_logit, entropy = head_reference(logits, visible, *sampled_rows(batch, seq, 64))
    for h in range(heads):
        assert attn[f"layers.1.core_attention.head{h}"] == pytest.approx(
            {"max_logit": max_logit[h], "entropy": entropy[h]}, rel=RTOL)
    # linear_hook: [] is every 2-D weight that is not an embedding table
    assert sorted(rows_of(record, "weight_features")) == ["layers.0.linear_qkv.weight", "layers.1.linear_qkv.weight"]


def test_a_failing_feature_is_switched_off_and_training_is_unchanged(tmp_path, monkeypatch):
    """trainmon's own exception in the attention features and in the power iteration switches those parts off (a
    warning, failures.json); the other rows go on, and the parameters are bit-identical to a run without monitor."""
    from trainmon.collect import attention, spectral

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of trainmon's")

    monkeypatch.setattr(attention, "features_from_qk", broken)
    monkeypatch.setattr(spectral, "gram_product", broken)

    def run(monitored: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"],
                                  "features": {"attention": {"enabled": True}, "weights": {"enabled": True}}})
        if monitored:
            monitor.attach(model, optimizer)
        for step in range(3):
            tokens, targets = make_batch(step, 2, 16, 64)
            loss = gpt_loss(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record = monitor.step(loss=loss) if monitored else None
            if record is not None:
                families = {row.family for row in record.rows}
                assert "grad_reduced" in families and not families & {"attn", "weight_features"}
        monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    for plain, monitored in zip(run(False), run(True)):
        assert torch.equal(plain, monitored)
    failures = (tmp_path / "r" / "rank0" / "failures.json").read_text()
    assert "attention_features" in failures and "weight_features" in failures


class _GroupedAttention(torch.nn.Module):
    """SDPA with grouped key heads (``enable_gqa``), a mask of its own (boolean, or added with HF's ``finfo.min``)
    and an explicit scale."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 4 * 8)
        self.k = torch.nn.Linear(16, 2 * 8)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 8).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=self.mask, scale=0.3,
                                                               enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_grouped_heads_mask_and_scale(tmp_path, kind):
    torch.manual_seed(4)
    batch, seq = 3, 10
    mask = torch.rand(batch, 1, seq, seq) > 0.4
    mask[:, :, 2] = False  # query row 2 sees no key: left out of the entropy
    given = mask if kind == "bool" else torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    model = torch.nn.Sequential(_GroupedAttention(given))
    x = torch.randn(batch, seq, 16)
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False},
              "features": {"attention": {"enabled": True, "query_rows": 64, "modules": ["0"]}}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model)
        model(x).sum().backward()
        record = monitor.step()
    layer = model[0]
    with torch.no_grad():
        q = layer.q(x).double().view(batch, seq, 4, 8).transpose(1, 2).numpy()
        k = layer.k(x).double().view(batch, seq, 2, 8).transpose(1, 2).numpy()
    logits = q @ np.repeat(k, 2, axis=1).transpose(0, 1, 3, 2) * 0.3
    visible = np.broadcast_to(mask.numpy(), logits.shape)
    max_logit, entropy = head_reference(logits, visible, list(range(batch)), list(range(seq)))
    got = rows_of(record, "attn")
    assert sorted(got) == [f"0.head{h}" for h in range(4)]
    for h in range(4):
        assert got[f"0.head{h}"] == pytest.approx({"max_logit": max_logit[h], "entropy": entropy[h]}, rel=RTOL)
