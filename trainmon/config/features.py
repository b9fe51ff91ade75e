"""The config sections of the model features: attention logits and entropy, spectral norms of the weights,
mixture-of-experts routing (docs/features.md; re-exported by :mod:`trainmon.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmon.base.schema import setting
from trainmon.config.fields import pattern_list

__all__ = ["ATTENTION_LAYOUTS", "AttentionFeaturesConfig", "FeaturesConfig", "RouterFeaturesConfig",
           "WeightFeaturesConfig"]

ABSENT_RANKS: tuple[str, ...] = ("error", "skip")
ATTENTION_LAYOUTS: tuple[str, ...] = ("sbhd", "bshd")


@dataclass
class AttentionFeaturesConfig:
    """Per-head attention features (family ``attn``; docs/features.md)."""

    enabled: bool = False
    """For every head of every attention module, on collected steps: the largest attention logit
    (``q.k * scale``, masked entries left out) and the mean softmax entropy (nats) over the sampled query rows,
    each scored against all keys; rows ``{module}.head{h}`` (global head index under tensor parallelism), columns
    ``max_logit``, ``entropy``."""
    query_rows: int = setting(64, minimum=1)
    """Query rows sampled per call of a module: spread evenly over the batch (at most this many sequences) and over
    the positions of each sequence, the same ones every step. The seq x seq matrix is never formed: only these rows'
    logits, ``query_rows x keys`` per head."""
    modules: list[str] = pattern_list([])
    """The attention modules (exact names, globs or regexes, among all modules). Empty: every target module
    (``targets.modules``) whose class name ends in ``Attention`` and that holds no such module (HF's
    ``LlamaAttention``, nanoGPT's ``CausalSelfAttention``, Megatron-Core's core attention)."""
    inputs: str | None = setting(None, choices=ATTENTION_LAYOUTS)
    """Where query and key come from. null: from the attention function the module calls (torch's
    ``scaled_dot_product_attention``, with its mask, ``is_causal``, scale and grouped heads; or a softmax over
    ``[batch, heads, queries, keys]`` scores, as HF's eager attention computes them); Megatron-Core's core attention
    from its inputs. ``sbhd`` / ``bshd``: the module's first two positional inputs are the query and the key in this
    layout (msprobe's ``sa_order``), scaled by ``1/sqrt(head size)``, with the mask ``causal`` says."""
    causal: bool = True
    """With ``inputs``: a query sees the keys at or before its position only."""


@dataclass
class WeightFeaturesConfig:
    """Spectral features of the weight matrices (family ``weight_features``; docs/features.md)."""

    enabled: bool = False
    """For every 2-D target parameter, at the end of each collected step: the spectral norm ``sigma_1`` by power
    iteration on the device (a vector per matrix kept from one collected step to the next) and the stable rank
    ``||W||_F^2 / sigma_1^2``; rows named by the parameter, columns ``spectral_norm``, ``stable_rank``. Shards
    (tensor parallelism, FSDP2) are combined exactly: one all-reduce per iteration over their group."""
    iterations: int = setting(2, minimum=1, maximum=1000)
    """Power iterations per collected step, continuing from the previous step's vector (so the estimate, a lower
    bound of ``sigma_1``, converges over the collected steps and follows the weights as they change)."""
    params: list[str] = pattern_list([])
    """The parameters measured, among the 2-D ones of the model: exact names, globs or regexes. Empty: the 2-D
    target parameters (``targets.params``)."""
    embeddings: bool = True
    """Measure embedding tables too (``nn.Embedding``, Megatron-Core's vocabulary-parallel embedding)."""


@dataclass
class RouterFeaturesConfig:
    """Mixture-of-experts router features (families ``router`` and ``expert_load``; docs/features.md)."""

    enabled: bool = False
    """For every router, per micro-step of a collected step, from its logits and its top-k choice: the load
    imbalance (max / mean tokens per expert), the mean entropy of the routing softmax per token, the z-loss (mean
    ``logsumexp(logits)^2``) and the mean pairwise cosine similarity of the experts' weights (family ``router``, row
    ``{router}``); the tokens routed to each expert and their share (family ``expert_load``, rows
    ``{router}.expert{e}``)."""
    modules: list[str] = pattern_list([])
    """The router modules (exact names, globs or regexes, among all modules). Empty: every module whose class name
    ends in ``Router`` (HF's ``MixtralTopKRouter``, ``OlmoeTopKRouter``, ``Qwen2MoeTopKRouter``, ...; Megatron-Core's
    ``TopKRouter``)."""
    expert_similarity: bool = True
    """Compute ``expert_similarity`` (NaN when the experts' weights are not found next to the router)."""


@dataclass
class FeaturesConfig:
    """Model features computed on collected steps, on the device (docs/features.md)."""

    attention: AttentionFeaturesConfig = field(default_factory=AttentionFeaturesConfig)
    """Per-head attention logits and entropy."""
    weights: WeightFeaturesConfig = field(default_factory=WeightFeaturesConfig)
    """Spectral norm and stable rank of the weight matrices."""
    router: RouterFeaturesConfig = field(default_factory=RouterFeaturesConfig)
    """Mixture-of-experts routing."""

    @property
    def enabled(self) -> bool:
        """Whether any feature is on."""
        return self.attention.enabled or self.weights.enabled or self.router.enabled
