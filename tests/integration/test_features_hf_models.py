"""``attn`` and ``router`` features on HF causal LMs beyond Llama / Mixtral (docs/features.md), against float64 truth
from the framework itself.

The truth model is a float64 copy of the trained model at that step (float32 where HF's grouped expert kernel takes no
float64), run through an attention function registered in HF's own ``AttentionInterface`` that calls the model's own
``eager_attention_forward`` and records the query and key (after the rotary embedding and any q/k norm), the scale and
the mask it was given, and the probabilities it returned: ``max_logit`` is the largest ``q.k * scaling`` over the
unmasked keys, ``entropy`` the mean over rows of the entropy of HF's probabilities (an attention sink's share is
``1 - sum(p)``). Bloom and Falcon (ALiBi, no attention interface): q and k from the module's own fused projection of
the input it was given, the probabilities from ``output_attentions`` (eager) or the module's own additive mask
(sdpa). Routers: against ``output_router_logits`` and the top-k indices recomputed from them.
"""

from __future__ import annotations

import copy
import logging
import sys

import numpy as np
import pytest
import torch

from trainmon import TrainerMonitor

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
RTOL = 3e-5  # float32 features against float64
BATCH, SEQ = 2, 16
_SEEN: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


def _truth_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out, probs = sys.modules[type(module).__module__].eager_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
    logits = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    visible = (attention_mask > torch.finfo(attention_mask.dtype).min / 2).expand_as(logits)
    _SEEN.append((logits.detach(), visible, probs.detach()))
    return out, probs


def _register_truth() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("trainmon_truth", _truth_attention)
    AttentionMaskInterface.register("trainmon_truth", eager_mask)
    return "trainmon_truth"


def _per_head(logits: np.ndarray, visible: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per head: the largest visible logit, and the mean over rows that see a key of the entropy of ``probs`` (plus
    the sink's share ``1 - sum(p)`` when the softmax had one)."""
    max_logit = np.where(visible, logits, -np.inf).max(axis=(0, 2, 3))
    plogp = np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1.0)), 0.0).sum(-1)
    sink = np.clip(1.0 - probs.sum(-1), 0.0, None)
    sink_term = np.where(sink > 1e-12, sink * np.log(np.where(sink > 1e-12, sink, 1.0)), 0.0)
    seen = visible.any(-1)
    entropy = (-(plogp + sink_term) * seen).sum(axis=(0, 2)) / seen.sum(axis=(0, 2))
    return max_logit, entropy


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 5:] = 0  # right padding
    return tokens, mask


def _train(tmp_path, model, truth, steps: int = 2, router: bool = False):
    """Trains ``steps`` SGD steps with the monitor; ``truth(model, tokens, mask)`` gives the per-layer float64 truth
    before each step's forward. Returns [(record, truth)] per step."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    features = {"attention": {"enabled": True, "query_rows": BATCH * SEQ}}  # every row
    if router:
        features["router"] = {"enabled": True}
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "features": features}
    if router:  # HF installs its output-recording hooks on the first such call: before the monitor's snapshot
        with torch.no_grad():
            model(input_ids=_batch(0)[0], use_cache=False, output_router_logits=True)
    out = []
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(steps):
            tokens, mask = _batch(step)
            expected = truth(model, tokens, mask)
            result = model(input_ids=tokens, attention_mask=mask, labels=tokens, use_cache=False,
                           output_router_logits=router or None)
            result.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append((monitor.step(loss=result.loss), expected, tokens))
    return out


def _interface_truth(double: bool = True):
    name = _register_truth()

    def truth(model, tokens, mask):
        ref = copy.deepcopy(model)
        ref = ref.double() if double else ref
        for module in ref.modules():
            if hasattr(module, "config"):
                module.config._attn_implementation = name
        _SEEN.clear()
        with torch.no_grad():
            result = ref(input_ids=tokens, attention_mask=mask, use_cache=False,
                         output_router_logits=hasattr(ref.config, "num_experts_per_tok") or None)
        layers = [_per_head(*(t.double().numpy() for t in seen)) for seen in _SEEN]
        return layers, getattr(result, "router_logits", None)

    return truth


def _check_attention(runs, prefix: str, layers: int = 2) -> None:
    for record, (expected, _), _ in runs:
        got = {row.name: dict(row.values) for row in record.rows if row.family == "attn"}
        assert len(expected) == layers
        assert len(got) == layers * len(expected[0][0]), sorted(got)
        for layer, (max_logit, entropy) in enumerate(expected):
            for h in range(len(max_logit)):
                values = got[prefix.format(layer) + f".head{h}"]
                assert values["max_logit"] == pytest.approx(max_logit[h], rel=RTOL), (layer, h)
                assert values["entropy"] == pytest.approx(entropy[h], rel=RTOL), (layer, h)


def _model(config_name: str, model_name: str, attn: str, **kwargs):
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = config_cls(vocab_size=64, **kwargs)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config)


_SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 64}
_LAYERS = "model.layers.{}.self_attn"
_DENSE = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8}, _LAYERS),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "pad_token_id": 0}, _LAYERS),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8,
                                                          "query_pre_attn_scalar": 4, "sliding_window": 6},
               "model.layers.{}.self_attn"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"num_key_value_heads": 2}, "model.layers.{}.self_attn"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, "gpt_neox.layers.{}.attention"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}, "model.layers.{}.self_attn"),
}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("qwen3", "gemma3") else pytest.mark.slow)
                                  for n in _DENSE])
def test_dense_models_match_the_framework(tmp_path, name, attn):
    """QK-norm (Qwen3, OLMo2), query_pre_attn_scalar and sliding windows (Gemma 3), partial rotary (GPT-NeoX, Phi3),
    grouped heads, right padding: every head of every layer, two training steps."""
    config_name, model_name, extra, prefix = _DENSE[name]
    model = _model(config_name, model_name, attn, **{**_SMALL, **extra})
    _check_attention(_train(tmp_path, model, _interface_truth()), prefix)


def test_gpt2_matches_the_framework(tmp_path):
    model = _model("GPT2Config", "GPT2LMHeadModel", "sdpa", n_embd=32, n_layer=2, n_head=4, n_positions=64)
    _check_attention(_train(tmp_path, model, _interface_truth(), steps=1), "transformer.h.{}.attn")


def test_gemma2_softcapping_max_logit_is_before_the_cap(tmp_path):
    """Gemma 2 (eager: HF's sdpa refuses a softcap): ``max_logit`` is ``q.k * scaling`` before
    ``cap * tanh(s / cap)``, ``entropy`` that of the capped softmax. A small cap so that it bites: the capped
    maximum would be below 0.3."""
    model = _model("Gemma2Config", "Gemma2ForCausalLM", "eager", **_SMALL, num_key_value_heads=2, head_dim=8,
                   attn_logit_softcapping=0.3, query_pre_attn_scalar=4, sliding_window=6)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    runs = _train(tmp_path, model, _interface_truth())
    _check_attention(runs, "model.layers.{}.self_attn")
    assert max(m.max() for m, _ in runs[0][1][0]) > 0.35  # above the cap 0.3: a capped value would differ


def test_gpt_oss_sinks_and_router(tmp_path):
    """GPT-OSS (eager; HF has no sdpa for its sinks): the sink column is in the softmax (entropy), not a key
    (max_logit, before the row maximum HF subtracts); its router against ``output_router_logits``."""
    model = _model("GptOssConfig", "GptOssForCausalLM", "eager", **_SMALL, num_key_value_heads=2, head_dim=8,
                   num_local_experts=4, num_experts_per_tok=2, sliding_window=6)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    runs = _train(tmp_path, model, _interface_truth(double=False), router=True)
    _check_attention(runs, "model.layers.{}.self_attn")
    _check_router(runs, 4, 2)


@pytest.mark.parametrize("name", ["Qwen3Moe", "Qwen2Moe", "Olmoe", "DeepseekV3"])
def test_moe_routers_match_their_own_logits(tmp_path, name):
    extra = {"Qwen3Moe": {"num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8},
             "Qwen2Moe": {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24},
             "Olmoe": {"num_experts": 4},
             "DeepseekV3": {"n_routed_experts": 4, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16,
                            "first_k_dense_replace": 0, "q_lora_rank": None, "kv_lora_rank": 16,
                            "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
                            "num_key_value_heads": 4}}[name]
    kwargs = {**_SMALL, "num_key_value_heads": 2, "num_experts_per_tok": 2, **extra}
    model = _model(f"{name}Config", f"{name}ForCausalLM", "sdpa", **kwargs)
    runs = _train(tmp_path, model, _interface_truth(double=False), steps=1, router=True)
    _check_attention(runs, "model.layers.{}.self_attn")
    _check_router(runs, 4, 2)


def _check_router(runs, experts: int, top_k: int) -> None:
    for record, (_, router_logits), tokens in runs:
        routers = {row.name: dict(row.values) for row in record.rows if row.family == "router"}
        load = {row.name: dict(row.values) for row in record.rows if row.family == "expert_load"}
        assert len(routers) == len(router_logits)
        for name, logits in zip(sorted(routers), router_logits):
            logits = logits.double().reshape(-1, experts).numpy()
            shifted = logits - logits.max(-1, keepdims=True)
            probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
            entropy = -(probs * np.log(probs)).sum(-1).mean()
            z_loss = ((np.log(np.exp(shifted).sum(-1)) + logits.max(-1)) ** 2).mean()
            assert routers[name]["entropy"] == pytest.approx(entropy, rel=RTOL)
            assert routers[name]["z_loss"] == pytest.approx(z_loss, rel=RTOL)
            tokens_of = [load[f"{name}.expert{e}"]["tokens"] for e in range(experts)]
            assert sum(tokens_of) == tokens.numel() * top_k  # every token, padding included, k choices
            assert routers[name]["imbalance"] == pytest.approx(max(tokens_of) / np.mean(tokens_of), rel=1e-6)


# ----------------------------------------------------------------------------------------- ALiBi (no interface)
def _alibi_truth(name: str, attn: str):
    def truth(model, tokens, mask):
        ref = copy.deepcopy(model).double()
        seen = []
        modules = [m for m in ref.modules() if type(m).__name__.endswith("Attention")]

        def hook(module, args, kwargs):
            seen.append((module, (args[0] if args else kwargs["hidden_states"]).detach(), kwargs["attention_mask"]))

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
        with torch.no_grad():
            result = ref(input_ids=tokens, attention_mask=mask, use_cache=False, output_attentions=attn == "eager")
        for handle in handles:
            handle.remove()
        layers = []
        for layer, (module, hidden, module_mask) in enumerate(seen):
            with torch.no_grad():
                fused = module.query_key_value(hidden)
                if name == "bloom":
                    q, k, _ = module._reshape(fused)
                else:
                    q, k, _ = (t.transpose(1, 2) for t in module._split_heads(fused))
                logits = q @ k.transpose(-1, -2) * module.inv_norm_factor
                # eager: HF's probabilities; sdpa: the bias rides the additive mask the module was given
                probs = result.attentions[layer] if attn == "eager" else torch.softmax(logits + module_mask, dim=-1)
            causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
            visible = (causal & (mask[:, None, None, :] > 0)).expand_as(logits)
            layers.append(_per_head(logits.numpy(), visible.numpy(), probs.double().numpy()))
        return layers, None

    return truth


@pytest.mark.parametrize("name,attn", [("bloom", "eager"), ("falcon", "eager"), ("falcon", "sdpa")])
def test_alibi_bias_is_in_the_entropy_not_the_max_logit(tmp_path, name, attn):
    """ALiBi's bias (Bloom: ``alibi.baddbmm``; Falcon: added before the scale in eager, in the additive mask in
    sdpa) is in the scores the softmax sees (entropy); ``max_logit`` is ``q.k * scale`` without it."""
    if name == "bloom":
        model = _model("BloomConfig", "BloomForCausalLM", attn, hidden_size=32, n_layer=2, n_head=4)
        prefix = "transformer.h.{}.self_attention"
    else:
        model = _model("FalconConfig", "FalconForCausalLM", attn, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, alibi=True, new_decoder_architecture=False, multi_query=False)
        prefix = "transformer.h.{}.self_attention"
    _check_attention(_train(tmp_path, model, _alibi_truth(name, attn)), prefix)


# ----------------------------------------------------------------------------------------- refused
class _TensorScaled(torch.nn.Module):
    """Eager attention whose scores are multiplied by a learned per-head tensor: a scale trainmon cannot read."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(16, 2 * 16)
        self.gain = torch.nn.Parameter(torch.ones(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 4, 4).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * self.gain
        return torch.softmax(scores, dim=-1).sum()


def test_a_scale_trainmon_cannot_read_is_refused_with_one_warning(tmp_path, caplog):
    model = torch.nn.Sequential(_TensorScaled())
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False},
              "features": {"attention": {"enabled": True, "modules": ["0"]}}}
    with caplog.at_level(logging.WARNING, logger="trainmon"), TrainerMonitor(config) as monitor:
        monitor.attach(model)
        for _ in range(2):
            model(torch.randn(2, 8, 16)).backward()
            record = monitor.step()
            assert not [row for row in record.rows if row.family == "attn"]
    warned = [r for r in caplog.records if "multiplied by a tensor" in r.getMessage()]
    assert len(warned) == 1 and "module 0" in warned[0].getMessage()
