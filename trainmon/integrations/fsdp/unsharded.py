"""FSDP2 ``grad_unreduced``: post-accumulate-grad hooks on the unsharded parameters FSDP swaps into the modules.

FSDP2 runs the post-accumulate-grad hooks of the *sharded* parameters only after its reduce-scatter
(on the reduced shard), so this rank's own full gradient is read on the *unsharded* parameters, before
FSDP's post-backward reduces and frees it. :class:`UnshardedGradHooks` finds them in two ways:

- an FSDP module whose hooks run eagerly gets a forward pre-hook (after FSDP's own, which it prepends
  and which unshards) that reads the unsharded parameters now set on the modules;
- an FSDP module whose hooks run inside compiled code (``block.compile()``, torchtitan's way, or a
  module inside a compiled wrapper) gets no hook of trainmon's (dynamo would trace it into the graph,
  and a ``fullgraph`` compile raises on it): FSDP2 makes each unsharded parameter once, at its first
  all-gather, and reuses it, so :func:`fsdp_unsharded_params` reads them from FSDP2's records outside
  compiled code, when the step's hooks are installed and after the forward of the model given to
  ``attach`` (before the backward that accumulates into them). Which modules run compiled is asked
  again before the first forward of each collected step (users may compile after ``attach``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch

from trainmon.base.targets import plain_name
from trainmon.collect.hooks import post_accumulate_grad_hook
from trainmon.integrations.torch import traced_modules

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.collect.hooks import HookRegistry

logger = logging.getLogger("trainmon")

GROUP = "fsdp_unsharded_grads"
"""The registry group of every hook installed here (removed when the collector disarms)."""
Owners: TypeAlias = "list[tuple[torch.nn.Module, list[tuple[str, Any, str, int]]]]"
"""``(FSDP module, [(parameter name, owner module, attribute, vpp_stage)])`` (:func:`unsharded_owners`)."""


class UnshardedGradHooks:
    """The ``grad_unreduced`` hooks of an FSDP2 model, in the collector's registry group :data:`GROUP`.

    Args:
        ctx: the monitor's step context.
        model: the model given to ``attach`` (never compiled in place: attach refuses that).
        owners: where each target parameter's unsharded version appears (:func:`unsharded_owners`).
        registry: where the hook handles live.
        grad_hook: ``(name, vpp_stage) -> hook(param)``: the collector's post-accumulate-grad hook.
        wrap: puts each hook registered here under the collector's fail-safe guard
            (:meth:`~trainmon.collect.hooks.HookedCollector.guarded`).
    """

    def __init__(self, ctx: StepContext, model: torch.nn.Module, owners: Owners, registry: HookRegistry,
                 grad_hook: Callable[[str, int], Callable[[torch.Tensor], None]],
                 wrap: Callable[[Any], Any] = lambda hook: hook) -> None:
        self.ctx = ctx
        self.wrap = wrap
        self.model = model
        self.owners = owners
        self.registry = registry
        self.grad_hook = grad_hook
        self._compiled: Owners = []
        """The FSDP modules of :attr:`owners` whose hooks run compiled (found at install)."""
        self._hooked: dict[int, weakref.ref[torch.Tensor]] = {}
        self._pre_hooks: dict[int, Any] = {}
        """``id(FSDP module) -> handle`` of the forward pre-hooks of the modules that run eagerly."""
        self._checked: int | None = None
        """The step whose first forward :meth:`_recheck` saw."""
        self._warned = False

    def compiled_now(self) -> Owners:
        """The FSDP modules of :attr:`owners` whose hooks run inside compiled code now (walks the model)."""
        traced = traced_modules(self.model) if self.owners else {}
        return [(module, entries) for module, entries in self.owners if id(module) in traced]

    def unreadable(self) -> list[str]:
        """Class names of compiled FSDP modules whose records this torch does not keep (checked at attach)."""
        return [type(module).__name__ for module, _ in self.compiled_now() if fsdp_unsharded_params(module) is None]

    def install(self) -> None:
        """A forward pre-hook on each FSDP module that runs eagerly; FSDP2's records for the others; and the
        model's forward hooks that read those records and recheck which modules run compiled."""
        self._compiled = self.compiled_now()
        skip = {id(module) for module, _ in self._compiled}
        self._pre_hooks = {}
        for module, entries in self.owners:
            if id(module) not in skip:
                handle = module.register_forward_pre_hook(self.wrap(self._pre_forward(entries)))
                self._pre_hooks[id(module)] = handle
                self.registry.add(GROUP, handle)
        self._hook_recorded()  # those FSDP made in earlier forwards (none before the first)
        # after the step model's root pre-hook (registered at attach): the step a forward belongs to is known
        self.registry.add(GROUP, self.model.register_forward_pre_hook(self.wrap(self._recheck)))
        self.registry.add(GROUP, self.model.register_forward_hook(self.wrap(self._after_forward)))

    def _recheck(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook of the model: an FSDP module compiled since the hooks went in loses its pre-hook
        before its compiled code first runs (dynamo would trace it) and is read from the records."""
        if not (self.ctx.collecting and torch.is_grad_enabled()) or not self._pre_hooks \
                or self._checked == self.ctx.step:
            return
        self._checked = self.ctx.step  # once per step: compiled_now() walks the model (~2 ms for 1,000 modules)
        compiled = self.compiled_now()
        newly = [id(m) for m, _ in compiled if id(m) in self._pre_hooks]
        if newly:
            for key in newly:
                self._pre_hooks.pop(key).remove()  # removing again (the registry, on disarm) is a no-op
            self._compiled = compiled
            self._hook_recorded()

    def reset(self) -> None:
        """The hooks were removed: every unsharded parameter is hooked again when armed."""
        self._hooked.clear()
        self._pre_hooks = {}

    def _pre_forward(self, entries: list[tuple[str, Any, str, int]]) -> Callable[[torch.nn.Module, Any], None]:
        """Forward pre-hook of an FSDP module, run after FSDP's own (which is prepended and unshards):
        hook the unsharded parameters now set on the modules, once each while armed."""
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not (self.ctx.collecting and torch.is_grad_enabled()):
                return
            for name, owner, attribute, vpp_stage in entries:
                self._hook(name, vpp_stage, getattr(owner, attribute, None))

        return hook

    def _hook(self, name: str, vpp_stage: int, param: torch.Tensor | None) -> None:
        """A post-accumulate-grad hook on an unsharded parameter, once while armed."""
        if param is None or hasattr(param, "to_local") or not param.requires_grad:
            return  # still sharded (not unsharded by FSDP yet), or frozen
        seen = self._hooked.get(id(param))
        if seen is not None and seen() is param:
            return
        self._hooked[id(param)] = weakref.ref(param)
        self.registry.add(GROUP, post_accumulate_grad_hook(param, self.wrap(self.grad_hook(name, vpp_stage))))

    def _hook_recorded(self) -> None:
        """Hook the unsharded parameters of the compiled FSDP modules, from FSDP2's own records (outside
        compiled code, before the backward that accumulates into them)."""
        for module, entries in self._compiled:
            unsharded = fsdp_unsharded_params(module)
            if unsharded is None:  # attach refuses this; here the module was compiled after attach
                if not self._warned:
                    self._warned = True
                    logger.warning("trainmon: grad_unreduced of the parameters of %s, compiled after attach, is not "
                                   "recorded: this torch's FSDP2 keeps no record of its unsharded parameters that "
                                   "trainmon can read outside compiled code", type(module).__name__)
                continue
            for name, owner, attribute, vpp_stage in entries:
                self._hook(name, vpp_stage, unsharded.get((id(owner), attribute)))

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook of the model given to ``attach``: a first forward has made the unsharded parameters."""
        if self.ctx.collecting and torch.is_grad_enabled() and self._compiled:
            self._hook_recorded()


def fsdp_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from torch.distributed.fsdp import FSDPModule

    # cast: isinstance narrows each module to FSDPModule, which is a mixin of the module's own class.
    modules = [(plain_name(name), module) for name, module in root.named_modules() if isinstance(module, FSDPModule)]
    return cast("list[tuple[str, torch.nn.Module]]", modules)


def unsharded_owners(root: torch.nn.Module, params: Sequence[tuple[str, torch.nn.Parameter, int]],
                     fsdp_modules: list[tuple[str, torch.nn.Module]]
                     ) -> Owners:
    """For each FSDP module, the target parameters it manages: those under it and under no deeper FSDP module.

    FSDP unshards exactly those in that module's forward pre-hook, setting the unsharded
    parameter as the attribute of the module that owns it (``fc1.weight`` on ``fc1``).
    """
    modules = {plain_name(name): module for name, module in root.named_modules()}
    by_module: dict[str, list[tuple[str, Any, str, int]]] = {prefix: [] for prefix, _ in fsdp_modules}
    for name, _, vpp_stage in params:
        owner_name, _, attribute = name.rpartition(".")
        managers = [prefix for prefix, _ in fsdp_modules
                    if prefix == "" or owner_name == prefix or owner_name.startswith(prefix + ".")]
        if managers and owner_name in modules:
            by_module[max(managers, key=len)].append((name, modules[owner_name], attribute, vpp_stage))
    return [(module, by_module[prefix]) for prefix, module in fsdp_modules if by_module[prefix]]


def fsdp_unsharded_params(module: torch.nn.Module) -> dict[tuple[int, str], torch.nn.Parameter] | None:
    """``(id(owner module), attribute) -> unsharded parameter`` that FSDP2 has made for ``module``.

    FSDP2 makes each unsharded parameter at its first all-gather and reuses it (its storage is
    freed and refilled), so one read outside compiled code finds the parameters that later
    forwards swap in and backwards accumulate into. This reads FSDP2's bookkeeping
    (``FSDPModule._get_fsdp_state()``, its parameter groups' ``FSDPParam`` entries), for modules whose
    own hooks run compiled; None when this torch keeps it elsewhere. Parameters not all-gathered
    yet are absent.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    groups = getattr(get_state(), "_fsdp_param_groups", None) if get_state is not None else None
    if groups is None:
        return None
    found: dict[tuple[int, str], torch.nn.Parameter] = {}
    for group in groups:
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            info = getattr(fsdp_param, "_module_info", None)
            if info is None:
                return None
            param = getattr(fsdp_param, "_unsharded_param", None)  # absent before the first all-gather
            if param is not None:
                found[(id(info.module), info.param_name)] = param
                for shared, shared_name in zip(info.shared_modules, info.shared_param_names):
                    found[(id(shared), shared_name)] = param
    return found
