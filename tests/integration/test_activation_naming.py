"""The activation families on real models: every floating tensor a target module takes or returns gets its row,
named by one rule in both directions, and equals float64 numpy of the tensor torch really used.

References come from the test's own hooks (forward hooks with kwargs, tensor hooks on the outputs and inputs,
torch's own full backward hooks for ``input_grad`` under ``grad_hooks: module``), named by the rule the README
documents, written out here independently of trainmon: a tensor's path in the value (tuple/list position, dict
key), the prefix alone for a tuple/list holding one floating tensor, ``{module}.call{k}`` for the k-th later call
of a module in a micro-step, no rows for integer/bool or empty tensors. Real HF transformers models (Llama, and
Mixtral, whose router returns integer expert ids) built from small configs, and plain torch models (a module
shared by two parents, an expert that gets no token, a checkpoint wrapper). Run on both statistics paths by the
test command (``TRAINMON_TEST_DEVICE_PATH=1``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from torch import nn

from tests.reference import METRICS, assert_close, np_stats, read_family
from trainmon import TrainerMonitor

transformers = pytest.importorskip("transformers")

ALL = {"enabled": True, "metrics": METRICS}


def _walk(value, path=()):
    """``(path, tensor)`` of every floating tensor in ``value`` (the test's own walk)."""
    if isinstance(value, torch.Tensor):
        return [(path, value)] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [item for i, v in enumerate(value) for item in _walk(v, (*path, str(i)))]
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _walk(v, (*path, str(k)))]
    return []


def _named(value, prefix):
    found = _walk(value)
    if isinstance(value, (tuple, list)) and len(found) == 1:
        return [(prefix, found[0][1])]
    return [(".".join((prefix, *path)), tensor) for path, tensor in found]


def _copy(tensor):
    return tensor.detach().double().numpy().copy()


class Truth:
    """The test's own hooks on every module: float64 copies of what each call took, returned and got back."""

    def __init__(self, model: nn.Module, grad_hooks: str) -> None:
        self.values: dict[tuple[int, str], np.ndarray] = {}
        self.step = 0
        self.calls: dict[str, int] = defaultdict(int)
        self.handles = []
        seen = set()
        for name, module in model.named_modules():
            if not name or id(module) in seen:
                continue
            seen.add(id(module))
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
            if grad_hooks == "module":
                self.handles.append(module.register_full_backward_hook(self._module_backward(name)))

    def new_step(self, step: int) -> None:
        self.step = step
        self.calls.clear()

    def _put(self, name, tensor):
        if tensor.numel():
            self.values[(self.step, name)] = _copy(tensor)

    def _grad_into(self, name):
        def hook(grad):
            if grad is not None:
                self._put(name, grad)
        return hook

    def _pre(self, name):
        def hook(module, args, kwargs):
            call = self.calls[name]
            self.calls[name] += 1
            module.__dict__.setdefault("_truth_calls", []).append(call)
            module.__dict__["_truth_single"] = len(_walk(args)) == 1  # how its input rows are named
            prefix = name if call == 0 else f"{name}.call{call}"
            for row, tensor in _named(args, f"{prefix}.input") + _named(kwargs, f"{prefix}.input"):
                self._put(row, tensor)
                if self.tensor_inputs and tensor.requires_grad and tensor.grad_fn is not None:
                    tensor.register_hook(self._grad_into(f"{prefix}.input_grad{row[len(prefix) + 6:]}"))
        return hook

    tensor_inputs = False

    def _post(self, name):
        def hook(module, args, kwargs, output):
            call = module.__dict__["_truth_calls"].pop()
            prefix = name if call == 0 else f"{name}.call{call}"
            for row, tensor in _named(output, f"{prefix}.output"):
                self._put(row, tensor)
                if tensor.requires_grad and tensor.grad_fn is not None:
                    tensor.register_hook(self._grad_into(f"{prefix}.output_grad{row[len(prefix) + 7:]}"))
        return hook

    def _module_backward(self, name):
        def hook(module, grad_input, grad_output):  # torch's own gradient w.r.t. the positional inputs
            for i, grad in enumerate(grad_input):
                if grad is not None and grad.is_floating_point():
                    self._put(f"{name}.input_grad" if module._truth_single else f"{name}.input_grad.{i}", grad)
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _train(tmp_path, model, batches, grad_hooks, *, targets=("*",), repeated=()):
    torch.manual_seed(0)
    truth = Truth(model, grad_hooks)
    truth.tensor_inputs = grad_hooks == "tensor"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "targets": {"modules": list(targets)},
              "activations": {**ALL, "grad_hooks": grad_hooks}, "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False},
              "anomaly": {"detectors": [{"type": "nonfinite"}]}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step, batch in enumerate(batches):
            truth.new_step(step)
            loss = batch(model)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    truth.remove()
    rank = tmp_path / "run" / "rank0"
    return read_family(rank, "actv"), read_family(rank, "actv_grad"), truth.values, rank


def _check(rows, values, family, ignore=lambda name: False):
    """Every trainmon row equals its reference; every reference of the family has exactly one row."""
    assert not rows.duplicated(["step", "micro_step", "name"]).any(), rows[rows.duplicated(["step", "name"])]
    got = {(int(r.step), r.name): r for r in rows.itertuples() if not ignore(r.name)}
    kinds = ("input", "output") if family == "actv" else ("input_grad", "output_grad")
    want = {key: value for key, value in values.items()
            if any(f".{kind}" in key[1] and not (family == "actv" and "_grad" in key[1]) for kind in kinds)
            and not ignore(key[1])}
    assert set(got) == set(want), (sorted(set(want) - set(got))[:8], sorted(set(got) - set(want))[:8])
    for key, array in want.items():
        row = got[key]._asdict()
        assert_close(row, np_stats(array), METRICS, rtol=1e-4, atol=1e-6, label=f"{family} {key}")


def _llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _lm_batches(steps=2):
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(steps)]
    return [lambda model, tokens=tokens: model(input_ids=tokens, labels=tokens).loss for tokens in ids]


@pytest.mark.parametrize("grad_hooks", ["module", "tensor"])
def test_llama_rows_are_complete_named_alike_and_match_float64(tmp_path, grad_hooks):
    actv, actv_grad, values, rank = _train(tmp_path, _llama(), _lm_batches(), grad_hooks)
    module_input_grad = lambda name: grad_hooks == "module" and ".input_grad" in name  # noqa: E731
    _check(actv, values, "actv")
    _check(actv_grad, values, "actv_grad", ignore=module_input_grad)
    names = set(actv.name)
    grads = set(actv_grad.name)
    # 1. an HF ModelOutput: each of its tensors has its forward and its gradient row, by key
    assert "model.output.last_hidden_state" in names and "model.output_grad.last_hidden_state" in grads
    # 2. position_embeddings=(cos, sin) as a keyword argument: two rows, two names
    assert {"model.layers.0.input.position_embeddings.0", "model.layers.0.input.position_embeddings.1"} <= names
    # 3. (attn_output, None): one rule in both directions
    assert "model.layers.0.self_attn.output" in names and "model.layers.0.self_attn.output_grad" in grads
    assert not any(name.startswith("model.layers.0.self_attn.output") and name.endswith(".0")
                   for name in names | grads)
    # 6. token ids, position ids, labels: no rows
    assert not any(name.startswith("model.embed_tokens.input") or "position_ids" in name or "labels" in name
                   or "input_ids" in name for name in names)
    if grad_hooks == "module":  # the gradient through each module only: torch's own full backward hooks
        module_rows = actv_grad[actv_grad.name.str.contains(".input_grad")]
        assert len(module_rows) > 0
        _check(module_rows, {k: v for k, v in values.items() if ".input_grad" in k[1]}, "actv_grad")
    assert not (rank / "anomalies.jsonl").exists() or not (rank / "anomalies.jsonl").read_text().strip()


def _mixtral():
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("grad_hooks", ["module", "tensor"])
def test_mixtral_router_and_experts_rows_match_float64(tmp_path, grad_hooks):
    actv, actv_grad, values, _ = _train(tmp_path, _mixtral(), _lm_batches(), grad_hooks)
    module_input_grad = lambda name: grad_hooks == "module" and ".input_grad" in name  # noqa: E731
    _check(actv, values, "actv")
    _check(actv_grad, values, "actv_grad", ignore=module_input_grad)
    gate = "model.layers.0.mlp.gate"  # returns (router_logits, top_k_weights, top_k_index)
    names = set(actv.name)
    assert {f"{gate}.output.0", f"{gate}.output.1"} <= names and f"{gate}.output.2" not in names  # ids: no row
    assert "model.layers.0.mlp.experts.input.1" not in names  # top_k_index, an integer input


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _TinyMoE(nn.Module):
    """Tokens go to expert 0 or 1 by sign; expert 2 never gets a token (an empty batch every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.proj, self.decoder.proj = self.shared, self.shared  # one module, three names
        self.experts = nn.ModuleList(_Expert() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x, mask):
        h = self.encoder.proj(x)
        route = torch.where(h[:, 0] > 0, 0, 1)
        route = torch.where(h[:, 1] > 100, 2, route)  # never true
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            chosen = (route == i).nonzero().squeeze(1)
            out = out.index_add(0, chosen, expert(h[chosen]))
        return self.head(self.decoder.proj(out) * mask.unsqueeze(1))


@pytest.mark.parametrize("grad_hooks", ["module", "tensor"])
def test_a_shared_module_s_calls_and_an_empty_expert(tmp_path, grad_hooks):
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randn(6, 8, generator=generator), torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool))
            for _ in range(3)]
    batches = [lambda model, x=x, m=m: model(x, m).square().mean() for x, m in data]
    # a target named by an alias selects the module (rows under its first name)
    actv, actv_grad, values, rank = _train(tmp_path, _TinyMoE(), batches, grad_hooks,
                                           targets=("decoder.proj", "re:^experts\\.[0-9]$", "head"))
    values = {k: v for k, v in values.items() if k[1].split(".")[0] in ("shared", "experts", "head")
              and not k[1].startswith("experts.0.fc") and not k[1].startswith("experts.1.fc")
              and not k[1].startswith("experts.2.fc")}
    module_input_grad = lambda name: grad_hooks == "module" and ".input_grad" in name  # noqa: E731
    _check(actv, values, "actv")
    _check(actv_grad, values, "actv_grad", ignore=module_input_grad)
    names = set(actv.name)
    assert {"shared.output", "shared.call1.output"} <= names  # two calls: the encoder's, the decoder's
    assert not any(name.startswith("experts.2") for name in names | set(actv_grad.name))  # never a token
    text = (rank / "anomalies.jsonl").read_text() if (rank / "anomalies.jsonl").exists() else ""
    assert not text.strip(), text  # an empty expert is no NaN


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x):
        return x + self.mlp(x)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _wrapped_run(tmp_path, wrap: bool):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = _Stack()
    if wrap:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "targets": {"modules": ["layers.*.mlp"], "params": ["layers.*.mlp.0.weight"]},
              "activations": ALL, "weight_grads": {"metrics": METRICS}, "optimizer_states": {"enabled": False}}
    grads = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(2):
            model(x).backward()
            for name, param in model.named_parameters():
                grads[(step, name)] = _copy(param.grad)
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    rank = tmp_path / "run" / "rank0"
    return read_family(rank, "actv"), read_family(rank, "grad_reduced"), grads


def test_checkpoint_wrapper_leaves_no_trace_in_names(tmp_path):
    actv, grads, raw = _wrapped_run(tmp_path / "wrapped", wrap=True)
    plain_actv, plain_grads, _ = _wrapped_run(tmp_path / "plain", wrap=False)
    assert sorted(set(actv.name)) == sorted(set(plain_actv.name))
    assert set(actv.name) >= {"layers.0.mlp.output", "layers.1.mlp.input"}
    assert sorted(set(grads.name)) == ["layers.0.mlp.0.weight", "layers.1.mlp.0.weight"]
    for row in grads.itertuples():  # the gradient torch gave, under the wrapped name
        want = raw[(row.step, row.name.replace("layers.0.", "layers.0._checkpoint_wrapped_module.")
                    .replace("layers.1.", "layers.1._checkpoint_wrapped_module."))]
        assert_close(row._asdict(), np_stats(want), METRICS, label=row.name)
    for column in METRICS:  # the same training, the same values
        assert np.allclose(actv[column].to_numpy(float), plain_actv[column].to_numpy(float), equal_nan=True)


def test_a_tied_parameter_is_selected_by_any_of_its_names(tmp_path):
    """HF tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``; a target naming either selects it,
    and its rows carry its first name, with the gradient torch accumulated on it."""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor_config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                      "targets": {"params": ["lm_head.weight"]}, "weight_grads": {"metrics": METRICS},
                      "optimizer_states": {"enabled": False}}
    with TrainerMonitor(monitor_config) as monitor:
        monitor.attach(model, optimizer)
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
        model(input_ids=tokens, labels=tokens).loss.backward()
        grad = _copy(model.lm_head.weight.grad)
        optimizer.step()
        monitor.step()
    rows = read_family(tmp_path / "run" / "rank0", "grad_reduced")
    assert list(rows.name) == ["model.embed_tokens.weight"]
    assert_close(rows.iloc[0], np_stats(grad), METRICS, label="tied")


def test_a_scalar_count_passed_along_is_not_an_activation_but_a_loss_output_is(tmp_path):
    """HF passes ``num_items_in_batch`` (a float 0-d count) down to every block as a keyword: no row. A module
    whose output is a 0-d loss that requires grad keeps its row, equal to the loss."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, num_items_in_batch=None):
            return self.fc(x)

    class Loss(torch.nn.Module):
        def forward(self, y, num_items_in_batch):
            return (y ** 2).sum() / num_items_in_batch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.loss = Block(), Loss()

        def forward(self, x):
            count = torch.tensor(float(x.shape[0]))
            return self.loss(self.block(x, num_items_in_batch=count), count)

    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "activations": {"enabled": True, "inputs": True}}
    with TrainerMonitor(config).attach(net, optimizer) as monitor:
        loss = net(torch.randn(3, 4))
        loss.backward()
        optimizer.step()
        monitor.step()
    actv = read_family(tmp_path / "run" / "rank0", "actv").set_index("name")
    assert not [name for name in actv.index if "num_items" in name or name.endswith("input.1")], list(actv.index)
    assert "block.input" in actv.index  # x: named by the prefix alone (the count does not count)
    assert np.isclose(actv.loc["loss.output", "norm"], abs(float(loss)), rtol=1e-6)
