"""Where steps and micro-steps begin and end on the loops people write: closures (LBFGS, Lightning's
automatic optimisation), evaluation forwards between steps (nanoGPT, HF Trainer), passes that raise,
``monitor.step()`` called twice. References are the test's own float64 copies of the tensors used."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.integration.test_torch_lifecycle import _TransferCounter
from tests.loops.common import MLP, assert_rows_match, config, data, global_norm, grads64, rows, scalars
from tests.reference import METRICS
from trainmon import TrainerMonitor

ACTIVATIONS = {"enabled": True, "metrics": METRICS}


def test_lbfgs_closure_grads_are_those_of_the_first_evaluation(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    monitor = TrainerMonitor(config(tmp_path)).attach(model, optimizer)
    first: dict[int, dict] = {}
    transfers = []
    for step in range(3):
        x, y = data(step)

        def closure(x=x, y=y, step=step):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            first.setdefault(step, grads64(model))  # the gradient the step's direction starts from
            return loss

        with _TransferCounter() as counter:
            loss = optimizer.step(closure)
            monitor.step(loss=loss)
        transfers.append(counter.calls)
    monitor.close()
    reduced, values = rows(tmp_path, "grad_reduced"), scalars(tmp_path)
    for step in range(3):
        assert_rows_match(reduced, step, first[step])
        assert np.isclose(values.loc[step, "grad_norm"], global_norm(first[step]), rtol=1e-5)
    assert transfers == [["cpu"]] * 3


def test_lbfgs_closure_without_monitor_step(tmp_path):
    """pytorch/examples' time_sequence_prediction: ``optimizer.step(closure)`` with LBFGS, which evaluates the closure
    several times a step, a ``no_grad`` prediction after each step, no ``monitor.step()``. Each evaluation is a
    micro-step of its optimizer step (activations and ``grad_unreduced`` per evaluation, against the closure's own
    float64 copies), ``grad_reduced`` is the first evaluation's, and every step, the last one too (ended by
    ``close()`` after its optimizer step: before, it had no ``step_skipped``), has ``step_skipped`` 0."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    monitor = TrainerMonitor(config(tmp_path, activations=ACTIVATIONS, targets={"modules": ["fc1"]}))
    monitor.attach(model, optimizer)
    evaluations: dict[int, list[dict]] = {}
    for step in range(3):
        x, y = data(step)
        evaluations[step] = []

        def closure(x=x, y=y, step=step):
            optimizer.zero_grad()
            hidden = model.fc1(x)  # the test's own copy of fc1's output, as the model computes it
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            evaluations[step].append({"fc1": hidden.detach().double().numpy(), "grads": grads64(model)})
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            model(data(100)[0])
    monitor.close()
    unreduced, reduced, actv = rows(tmp_path, "grad_unreduced"), rows(tmp_path, "grad_reduced"), rows(tmp_path, "actv")
    for step, evaluated in evaluations.items():
        assert sorted(set(unreduced[unreduced.step == step].micro_step)) == list(range(len(evaluated)))
        for micro, evaluation in enumerate(evaluated):
            assert_rows_match(unreduced, step, evaluation["grads"], micro_step=micro)
            at = actv[(actv.step == step) & (actv.micro_step == micro) & (actv.name == "fc1.output")]
            assert np.isclose(float(at["norm"].iloc[0]), np.linalg.norm(evaluation["fc1"]), rtol=1e-5)
        assert_rows_match(reduced, step, evaluated[0]["grads"])
    assert list(scalars(tmp_path)["step_skipped"]) == [0.0, 0.0, 0.0]


def test_lightning_style_accumulation_with_a_closure(tmp_path):
    """Lightning's automatic optimisation: micro-batches 0..k-2 run forward+backward outside the
    optimizer; the last runs inside ``optimizer.step(closure)``. The step uses the sum of all."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMonitor(config(tmp_path, params={"enabled": True})).attach(model, optimizer, grad_acc_steps=3)
    used = {}
    for step in range(3):
        for micro in range(3):
            x, y = data(10 * step + micro)

            def closure(x=x, y=y):
                loss = torch.nn.functional.mse_loss(model(x), y) / 3
                loss.backward()
                return loss

            if micro < 2:
                closure()
            else:
                optimizer.step(closure=closure)
                used[step] = grads64(model)
                optimizer.zero_grad()
        monitor.step()
    monitor.close()
    reduced, unreduced, values = rows(tmp_path, "grad_reduced"), rows(tmp_path, "grad_unreduced"), scalars(tmp_path)
    for step in range(3):
        assert_rows_match(reduced, step, used[step])
        assert_rows_match(unreduced, step, used[step], micro_step=2)  # the last micro-step's accumulation
        assert np.isclose(values.loc[step, "grad_norm"], global_norm(used[step]), rtol=1e-5)
    assert set(unreduced.micro_step) == {2}


def _capture_training_activations(model, store):
    """The test's own forward hook: outputs of fc1 in training forwards only."""
    def hook(module, args, output):
        if torch.is_grad_enabled() and model.training:
            store.append(output.detach().double().numpy().copy())
    return model.fc1.register_forward_hook(hook)


@pytest.mark.parametrize("user_steps", [True, False], ids=["monitor.step", "no-monitor.step"])
@pytest.mark.parametrize("eval_mode", ["no_grad", "inference_mode", "eval_with_grad"])
def test_eval_forwards_between_steps_record_nothing(tmp_path, user_steps, eval_mode):
    """nanoGPT's estimate_loss() every N steps; HF Trainer's evaluation loop."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = config(tmp_path, activations=ACTIVATIONS, targets={"modules": ["fc1"]})
    monitor = TrainerMonitor(cfg).attach(model, optimizer, grad_acc_steps=2)
    acts: dict[int, list] = {}
    handle = _capture_training_activations(model, acts.setdefault(-1, []))
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "eval_with_grad": torch.enable_grad}[eval_mode]
    counter = _TransferCounter().__enter__()
    for step in range(4):
        if step % 2 == 0:  # evaluate before training, as nanoGPT does at iter % eval_interval == 0
            model.eval()
            with context():
                for k in range(3):
                    model(data(100 + k)[0])
            model.train()
        acts[step] = []
        handle.remove()
        handle = _capture_training_activations(model, acts[step])
        for micro in range(2):
            x, y = data(10 * step + micro)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        if user_steps:
            monitor.step()
    monitor.close()
    counter.__exit__(None, None, None)
    handle.remove()
    assert counter.calls == ["cpu"] * 4  # one transfer per collected step, evaluation forwards add none
    actv = rows(tmp_path, "actv")
    assert sorted(set(actv.step)) == [0, 1, 2, 3]  # no phantom step from the evaluation at close
    for step in range(4):
        at = actv[(actv.step == step) & (actv.name == "fc1.output")].sort_values("micro_step")
        assert list(at.micro_step) == [0, 1]  # evaluation forwards do not shift training micro-steps
        for (_, row), reference in zip(at.iterrows(), acts[step]):
            assert np.isclose(row["norm"], np.linalg.norm(reference), rtol=1e-5)
    unreduced = rows(tmp_path, "grad_unreduced")
    assert set(unreduced.micro_step) == {1}


class _VAE(torch.nn.Module):
    """pytorch/examples' VAE (smaller): its evaluation draws samples with ``model.decode(z)``, a method that calls
    submodules itself, not through the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = torch.nn.Linear(16, 12), torch.nn.Linear(12, 4), torch.nn.Linear(12, 4)
        self.fc3, self.fc4 = torch.nn.Linear(4, 12), torch.nn.Linear(12, 16)

    def decode(self, z):
        return torch.sigmoid(self.fc4(torch.relu(self.fc3(z))))

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        return self.decode(mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)), mu, logvar


@pytest.mark.parametrize("user_steps", [True, False], ids=["monitor.step", "no-monitor.step"])
def test_an_evaluation_calling_submodules_under_no_grad_records_nothing(tmp_path, user_steps):
    """vae/main.py's test(): after each epoch, ``model.eval()``, then under ``torch.no_grad()`` test forwards and
    ``sample = model.decode(torch.randn(64, 20))``. Before, decode's fc3 and fc4 calls were recorded into the epoch's
    last training step as second calls (``fc3.call1.output``, ...) of its micro-step. The truth: the activations the
    test's own hooks read in the training forwards."""
    torch.manual_seed(0)
    model = _VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = TrainerMonitor(config(tmp_path, activations=ACTIVATIONS)).attach(model, optimizer)
    seen: list[dict[str, np.ndarray]] = []
    handles = [getattr(model, name).register_forward_hook(
        lambda module, args, out, name=name: seen[-1].__setitem__(name, out.detach().double().numpy())
        if torch.is_grad_enabled() else None) for name in ("fc3", "fc4")]
    step = 0
    for _ in range(2):
        model.train()
        for _ in range(3):
            seen.append({})
            x = torch.rand(8, 16)
            recon, mu, logvar = model(x)
            loss = torch.nn.functional.binary_cross_entropy(recon, x, reduction="sum") - 0.5 * torch.sum(
                1 + logvar - mu.pow(2) - logvar.exp())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if user_steps:
                monitor.step(loss=loss)
            step += 1
        model.eval()
        with torch.no_grad():
            model(torch.rand(8, 16))
            model.decode(torch.randn(6, 4))
    monitor.close()
    for handle in handles:
        handle.remove()
    actv = rows(tmp_path, "actv")
    assert sorted(set(actv.step)) == list(range(step))
    for at_step, reference in enumerate(seen):
        at = actv[actv.step == at_step]
        assert sorted(at.name) == sorted(f"fc{k}.{side}" for k in ("1", "21", "22", "3", "4")
                                         for side in ("input", "output")), at_step
        assert set(at.micro_step) == {0}
        for name, array in reference.items():
            got = at[at.name == f"{name}.output"]["norm"].iloc[0]
            assert np.isclose(got, np.linalg.norm(array), rtol=1e-5), (at_step, name)


class _Flaky(torch.nn.Module):
    """An MLP whose forward or backward raises when told to (an OOM the user catches and skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x):
        out = self.net(x)
        if self.fail_forward:
            raise RuntimeError("out of memory (simulated)")
        if self.fail_backward:
            out = _RaiseInBackward.apply(out)
        return out


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("out of memory in backward (simulated)")


def _raise(*args):
    raise RuntimeError("out of memory in a hook (simulated)")


@pytest.mark.parametrize("failing", [1, 2], ids=["first-micro-step", "second-micro-step"])
@pytest.mark.parametrize("where", ["forward", "backward", "loss-backward", "loss-hook", "root-backward-hook"])
@pytest.mark.parametrize("per_micro_step", [True, False], ids=["per-micro-step", "last-micro-step"])
def test_a_pass_that_raises_leaves_no_rows_and_no_micro_step(tmp_path, where, failing, per_micro_step):
    """The second micro-step's case: the first one's gradients are already rows (one block), which stay.

    ``loss-backward``, ``loss-hook`` and ``root-backward-hook``: the backward raises before it reaches the
    model's output (a custom autograd Function in the loss, a user hook on the loss tensor, a user backward
    pre-hook on the root module): no hook of the model ran in that pass."""
    torch.manual_seed(0)
    model = _Flaky()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = config(tmp_path, activations=ACTIVATIONS, targets={"modules": ["net.fc1", "net.fc2"]},
                 weight_grads={"metrics": METRICS, "unreduced": True, "per_micro_step": per_micro_step})
    monitor = TrainerMonitor(cfg).attach(model, optimizer, grad_acc_steps=2)
    used, accumulated = {}, {}
    counter = _TransferCounter().__enter__()
    for step in range(3):
        done = 0
        attempt = 0
        while done < 2:
            x, y = data(10 * step + attempt)
            attempt += 1
            fail = step == 1 and attempt == failing
            model.fail_forward, model.fail_backward = fail and where == "forward", fail and where == "backward"
            handle = model.register_full_backward_pre_hook(_raise) if fail and where == "root-backward-hook" else None
            try:
                out = model(x)
                if fail and where == "loss-backward":
                    out = _RaiseInBackward.apply(out)
                loss = torch.nn.functional.mse_loss(out, y) / 2
                if fail and where == "loss-hook":
                    loss.register_hook(_raise)
                loss.backward()
            except RuntimeError:
                optimizer.zero_grad()  # the user skips the batch
                continue
            finally:
                if handle is not None:
                    handle.remove()
            accumulated[(step, done)] = grads64(model)
            done += 1
        used[step] = grads64(model)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    counter.__exit__(None, None, None)
    assert counter.calls == ["cpu"] * 3
    actv, reduced = rows(tmp_path, "actv"), rows(tmp_path, "grad_reduced")
    for step in range(3):
        at = actv[(actv.step == step) & (actv.name == "net.fc1.output")]
        assert sorted(at.micro_step) == [0, 1], (step, list(at.micro_step))
        assert_rows_match(reduced, step, used[step])
        unreduced = rows(tmp_path, "grad_unreduced")
        assert sorted(set(unreduced[unreduced.step == step].micro_step)) == ([0, 1] if per_micro_step else [1])
        for micro in (0, 1) if per_micro_step else (1,):
            assert_rows_match(unreduced, step, accumulated[(step, micro)], micro_step=micro)
    assert set(rows(tmp_path, "actv_grad").micro_step) == {0, 1}


def test_step_called_twice_warns_once_and_numbers_stay_dense(tmp_path, caplog):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor(config(tmp_path)).attach(model, optimizer)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(3):
            x, y = data(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
            monitor.step()  # a second call: an empty step, said once
    monitor.close()
    warnings = [r for r in caplog.records if "called twice" in r.getMessage()]
    assert len(warnings) == 1
    assert sorted(set(rows(tmp_path, "grad_reduced").step)) == [0, 2, 4]


class _RaiseBetween(torch.nn.Module):
    """fc1 -> (raises in backward when told) -> fc2: fc2's gradient hooks fire before the backward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.fail_backward:
            h = _RaiseInBackward.apply(h)
        return self.fc2(h)


def test_grad_unreduced_of_a_backward_that_raised_half_way_is_not_written(tmp_path):
    """One process: gradients are noted in their hooks and measured when the pass ends; a pass that
    raised after some hooks fired leaves no row, and the retried pass's gradients are the rows."""
    torch.manual_seed(0)
    model = _RaiseBetween()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor(config(tmp_path)).attach(model, optimizer)
    used = {}
    for step in range(3):
        model.fail_backward = step == 1
        x, y = data(step)
        if step == 1:
            with pytest.raises(RuntimeError, match="simulated"):
                torch.nn.functional.mse_loss(model(x), y).backward()
            assert model.fc2.weight.grad is not None  # fc2's hooks fired before the raise
            optimizer.zero_grad()
            model.fail_backward = False
            x, y = data(100 + step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        used[step] = grads64(model)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    unreduced = rows(tmp_path, "grad_unreduced")
    for step in range(3):
        assert_rows_match(unreduced, step, used[step])


def test_a_gradient_changed_inside_the_backward_is_skipped_then_read_in_its_hook(tmp_path, caplog):
    """A user's gradient hook that rewrites the gradient in place after trainmon's hook noted it: the
    value trainmon would have read is gone, so that row is skipped once (with a warning) and
    gradients are read in their hooks from then on (values equal what the hooks saw)."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor(config(tmp_path)).attach(model, optimizer)
    seen: dict[str, np.ndarray] = {}

    def halve(param: torch.Tensor, name: str) -> None:  # runs after trainmon's hook (registered later)
        seen[name] = param.grad.detach().double().numpy().copy()
        param.grad.mul_(0.5)

    handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: halve(p, n)) for n, p in model.named_parameters()]
    per_step = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(3):
            seen.clear()
            x, y = data(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            per_step[step] = dict(seen)
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    monitor.close()
    for handle in handles:
        handle.remove()
    assert caplog.text.count("changed inside the backward pass") == 1
    unreduced = rows(tmp_path, "grad_unreduced")
    assert (unreduced.step == 0).sum() == 0
    for step in (1, 2):
        assert_rows_match(unreduced, step, per_step[step])


class _WordLanguageModel(torch.nn.Module):
    """pytorch/examples' word_language_model ``RNNModel`` (LSTM, smaller): embedding, LSTM, decoder, dropout."""

    def __init__(self, ntoken: int = 30, ninp: int = 8, nhid: int = 8, nlayers: int = 2) -> None:
        super().__init__()
        self.ntoken, self.nlayers, self.nhid = ntoken, nlayers, nhid
        self.drop = torch.nn.Dropout(0.2)
        self.encoder = torch.nn.Embedding(ntoken, ninp)
        self.rnn = torch.nn.LSTM(ninp, nhid, nlayers, dropout=0.2)
        self.decoder = torch.nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return torch.nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


@pytest.mark.parametrize("interval", [1, 2], ids=["every-step", "every-2nd-step"])
@pytest.mark.parametrize("user_steps", [True, False], ids=["monitor.step", "no-monitor.step"])
def test_word_language_model_without_an_optimizer(tmp_path, user_steps, interval):
    """pytorch/examples' word_language_model: no optimizer object (``p.data.add_(p.grad, alpha=-lr)``),
    ``model.zero_grad()``, the hidden state repackaged, ``clip_grad_norm_``, an evaluation under ``no_grad`` after
    each epoch, ``attach(model)``. One step per batch, with or without ``monitor.step()`` (before, without it, every
    batch of the run was written as a micro-step of step 0); ``grad_unreduced`` is the gradient of the backward
    (before clipping), against the loop's own float64 copies; training is bit-identical to a run without trainmon."""
    def train(monitor):
        torch.manual_seed(1111)
        model = _WordLanguageModel()
        if monitor is not None:
            monitor.attach(model)
        source = torch.randint(0, 30, (4 * 22,), generator=torch.Generator().manual_seed(0)).view(4, -1).t()
        grads, losses, lr = [], [], 20.0
        for _epoch in range(2):
            model.train()
            hidden = model.init_hidden(4)
            for i in range(0, source.size(0) - 1, 7):
                seq_len = min(7, len(source) - 1 - i)
                data, targets = source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)
                model.zero_grad()
                hidden = tuple(h.detach() for h in hidden)
                output, hidden = model(data, hidden)
                loss = torch.nn.functional.nll_loss(output, targets)
                loss.backward()
                grads.append(grads64(model))
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-lr)
                losses.append(loss.item())
                if monitor is not None and user_steps:
                    monitor.step(loss=loss)
            model.eval()
            with torch.no_grad():
                model(source[:5, :2], model.init_hidden(2))
            lr /= 4.0
        if monitor is not None:
            monitor.close()
        return model, grads, losses

    plain, _, plain_losses = train(None)
    cfg = config(tmp_path, activations={"enabled": True}, step_interval=interval)
    model, grads, losses = train(TrainerMonitor(cfg))
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    collected = list(range(0, len(grads), interval))
    unreduced, actv = rows(tmp_path, "grad_unreduced"), rows(tmp_path, "actv")
    assert sorted(set(unreduced.step)) == collected and set(unreduced.micro_step) == {0}
    assert sorted(set(actv.step)) == collected and set(actv.micro_step) == {0}
    for step in collected:
        assert_rows_match(unreduced, step, grads[step], metrics=["norm", "min", "max"])
    if user_steps:
        logged = scalars(tmp_path)["loss"].dropna()
        assert list(logged.index) == list(range(len(grads)))
        assert list(logged) == pytest.approx(losses, rel=1e-6)
