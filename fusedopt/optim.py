"""``FusedLAMB`` and ``FusedLARS``: thin ``torch.optim.Optimizer`` subclasses.

``step()`` gathers each param group's lists (``_init_group``, creating state on first use) and
makes one call to :func:`fusedopt.functional.trust_ratio_step`; it holds no math.
"""
from __future__ import annotations

import dataclasses
import threading
from itertools import chain, repeat
from operator import is_
from typing import Any, Callable

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.optim import Optimizer

from . import _adapters, _checkpoint, _traced
from . import backends as _backends
from ._bucket import StepCache
from ._bucket import grads as grads_of
from ._bucket import local as _local
from ._hyper import (
    LAMB_DEFAULTS,
    LARS_DEFAULTS,
    check_group,
    check_lr_value,
    check_param_dtypes,
    lamb_hyper,
    lars_hyper,
)
from . import _state
from ._sharding import Sharding
from ._plan import GroupPlan
from ._state import OptimizerState
from .functional import TensorGroup, check_new_params, trust_ratio_step

_MISSING = object()  # an option deleted from a param group
# the options that say how this process runs and stores the step, not what was learned: a loaded
# state dict does not replace them (its state is converted to the groups' state_precision)
# (torch's implementation flags among them: a warm start from fused AdamW's checkpoint keeps this
# optimizer's own)
_OWN_OPTIONS = ("backend", "state_precision", "state_min_numel", "fused", "foreach",
                "capturable", "differentiable")


class _TrustRatioOptimizer(Optimizer):
    """Shared machinery of LAMB and LARS: validation, state, gathering, dispatch.

    ``step()`` gathers each group's lists as torch's optimizers do (``_init_group``, creating
    state on first use) and makes one call to :func:`fusedopt.functional.trust_ratio_step`,
    handing it the optimizer's :class:`~fusedopt._bucket.StepCache` (Note [step cache]): the one
    object that keeps anything from one step to the next, replaced by ``add_param_group``,
    ``load_state_dict`` and ``__setstate__``.
    """

    _kind: str
    _state_keys: tuple[str, ...]
    _hyper: Callable[[dict[str, Any]], Any]  # the group's LambHyper / LarsHyper

    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict[str, Any], skip_nonfinite: bool = False):
        if not isinstance(skip_nonfinite, bool):
            raise ValueError(f"Invalid skip_nonfinite: {skip_nonfinite!r}; expected True or False")
        self.skip_nonfinite = skip_nonfinite
        self._sharding = Sharding()  # set by fusedopt.distributed's adapters (set_sharding)
        self._zero_parent = _adapters.zero_parent()  # the ZeroRedundancyOptimizer building this
        self._option_keys = tuple(defaults)
        super().__init__(params, defaults)
        self.state = OptimizerState(self.state)  # Note [group plans]
        self._load = None  # what load_state_dict's pre-hook read, for its post-hook
        self._own()
        self._checked_all()  # add_param_group checked them
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = _local(first).device if first is not None else torch.device("cpu")
        #: steps skipped by ``skip_nonfinite`` since construction (an int64 tensor, never read on
        #: the host by the optimizer)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)

    def _own(self) -> None:
        """What belongs to this process, made at construction and by ``__setstate__`` (after
        unpickling, since torch pickles no hooks, and in torch's ``load_state_dict``)."""
        self._pending: tuple[list, list] | None = None  # Note [refused steps]
        self._stale: list = []  # stale masters a traced step found (Note [refused steps])
        self._lock = threading.Lock()
        self._fresh()
        if _checkpoint.saved_form not in self._optimizer_state_dict_post_hooks.values():
            self.register_state_dict_post_hook(_checkpoint.saved_form, prepend=True)

    def _fresh(self) -> None:
        self._cache = StepCache()  # Note [step cache]
        self._plans: dict[int, GroupPlan] = {}  # Note [group plans]

    # ---------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        candidate = dict(self.defaults)
        candidate.update({k: v for k, v in param_group.items() if k != "params"})
        check_group(self._kind, candidate)
        params = param_group["params"]
        # a list from here on, as torch's add_param_group makes it: a generator read here would
        # leave torch's none
        params = param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        check_param_dtypes(self._hyper(candidate), candidate["state_precision"], params)
        super().add_param_group(param_group)
        self._note_sharded(params)
        _traced.unshare_lrs(self.param_groups)
        if hasattr(self, "_cache"):
            self._fresh()
            self._checked_all()

    def _note_sharded(self, params) -> None:
        """Whether some param is a DTensor, decided outside a trace (dynamo sees an FSDP2 param
        as a plain tensor: ``hasattr(p, "to_local")`` is False there), as groups are added."""
        self._sharded = (self.__dict__.get("_sharded", False)
                         or any(hasattr(p, "to_local") for p in params))

    def _plan(self, gi: int) -> GroupPlan:
        plan = self._plans.get(gi)
        if plan is None:
            plan = self._plans[gi] = GroupPlan()
        return plan

    def _checked_all(self) -> None:
        """Every group's plan: its options as they are now were checked."""
        for gi, group in enumerate(self.param_groups):
            self._plan(gi).checked(self._option_values(group), group["lr"])

    def _checked_options(self, gi: int, group: dict[str, Any]) -> None:
        """The group's options, checked unless its plan vouches for them (Note [group plans] in
        fusedopt/_plan.py)."""
        missing = [k for k in self._option_keys if k not in group]
        if missing:
            raise ValueError(f"{type(self).__name__}: param group {gi} has no option "
                             f"{missing[0]!r} (deleted after construction?)")
        if torch.compiler.is_compiling():
            self._named(gi, check_group, self._kind, group)
            return
        values = self._option_values(group)
        plan = self._plan(gi)
        if not plan.options_fit(values):
            self._named(gi, check_group, self._kind, group)
            plan.checked(values, group["lr"])

    def _option_values(self, group: dict[str, Any]) -> tuple:
        return tuple(group.get(k, _MISSING) for k in self._option_keys)

    def _named(self, gi: int, check, *args) -> None:
        try:
            check(*args)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{type(self).__name__}: param group {gi}: {e}") from None

    def __getstate__(self) -> dict[str, Any]:
        return _checkpoint.pickled(self, super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _checkpoint.unpickled(self)
        self._own()
        self._note_sharded(p for g in self.param_groups for p in g["params"])

    def set_grad_norm_reducer(self, reducer) -> None:
        """Use ``reducer`` (a :class:`fusedopt.functional.SqSumReducer`, or None) to complete the
        clipping total across ranks at every step, e.g.
        :func:`fusedopt.distributed.enable_zero_global_clipping`."""
        self._sharding = dataclasses.replace(self._sharding, reducer=reducer)

    def set_sharding(self, sharding: Sharding) -> None:
        """Step the params as :class:`fusedopt._sharding.Sharding` says they lie across ranks
        (what fusedopt.distributed's adapters call: enable_fsdp1, enable_deepspeed_zero,
        enable_zero_global_clipping)."""
        self._sharding = sharding
        self._fresh()

    # ----------------------------------------------------------------- step
    def _init_group(self, group, params, grads, steps, exp_avgs, exp_avg_sqs, momentum_buffers,
                    masters, sources, keys, bases) -> tuple[bool, tuple | None, tuple | None]:
        """Append the group's params that have grads, and their tensors, to the lists (torch's
        ``_init_group`` shape: torch.compile runs it eagerly at trace time, with the lists as its
        outputs); create missing state. Params are the local shards of DTensors (``sources`` then
        holds the DTensors); masters hold None for params without; ``keys`` gets the key of the
        random bits of each param (its index in the group, and a shard's first element:
        ``lowp.random_key``) when some params have no grad or are sharded and the state may be
        stochastically rounded (docs/math.md, "Random bits"). Returns whether the params are
        sharded; with ``bases`` (a list: a traced step) the state as views of the bases it
        appends there (Note [traced flat state] in fusedopt/_state.py), None otherwise; and the
        error that refuses the step as (type name, message), which the caller raises (under
        torch.compile dynamo would wrap an error raised here into one of its own), None if there
        is none."""
        try:
            return (*self._gather(group, params, grads, steps, exp_avgs, exp_avg_sqs,
                                  momentum_buffers, masters, sources, keys, bases), None)
        except (ValueError, TypeError, RuntimeError) as e:
            return False, None, (type(e).__name__, str(e))

    def _gather(self, group, params, grads, steps, exp_avgs, exp_avg_sqs, momentum_buffers,
                masters, sources, keys, bases) -> tuple[bool, tuple | None]:
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        lr, plan = group["lr"], self._plan(gi)
        if isinstance(lr, torch.Tensor) and lr is not plan.lr:
            self._named(gi, check_lr_value, lr)  # Note [group plans]: once per new tensor lr
            plan.lr = lr
        # what this does for every param at every step is written as C-level loops over the
        # params (map, list comprehensions, set, and Note [native scans] in
        # csrc/cpu/register.cpp): with thousands of tensors, each Python-level operation per
        # param costs a measurable part of the step
        all_ps = group["params"]
        if not all_ps:  # a group emptied (DeepSpeed ZeRO-3 fills each group only for its step)
            return False, None
        all_grads = grads_of(all_ps)
        if any(map(is_, all_grads, repeat(None))):
            ps = [p for p, g in zip(all_ps, all_grads) if g is not None]
            if not ps:
                return False, None
            gs = [g for g in all_grads if g is not None]
        else:
            ps, gs = all_ps, all_grads
        sharding = self._sharding
        sharding.check_registered(type(self).__name__, gi, ps)
        _adapters.check_params(self, gi, ps)  # settings that need an adapter not enabled
        sharded = any(hasattr(t, "to_local") for t in set(map(type, ps)))
        if sharded and bases is not None and not self._sharded:
            self._sharded = True  # from the next step on they run eagerly (step())
            raise RuntimeError(f"{type(self).__name__}: param group {gi} holds DTensor params put "
                               "into its list in place, which a traced step cannot take (steps "
                               "run eagerly from now on); add them with add_param_group")
        lps = [_local(p) for p in ps] if sharded else ps
        lgs = [_local(g) for g in gs] if sharded else gs
        rows = (sharding.random_keys(ps, all_ps, all_grads, lps, sharded)
                if group["state_precision"] != "full" else None)
        state = self.state
        states = list(map(state.get, ps))
        if max(map(len, filter(None, states)), default=0) > len(self._state_keys) + 1:
            # more keys than a count and the moments: masters, or saved 8-bit state that a loader
            # put straight into the state (fusedopt/_checkpoint.py)
            for p, st in zip(ps, states):
                if st and _checkpoint.needs_adopting(self, st):
                    _checkpoint.adopt(self, gi, group, p, st)
        fresh = [] if all(states) else [p for p, st in zip(ps, states) if not st]
        if fresh:
            # Note [refused steps]: what would refuse the step is checked before state is made
            # (a traced step makes it at trace time, where nothing can take it back)
            chosen = check_new_params(self._kind, gi, lps, lgs, self._hyper(group),
                                      group["backend"])
            _state.create(type(self).__name__, state, self._state_keys, group, fresh,
                          sharding.wholes)
            if self._pending is not None:
                self._pending[0].extend(fresh)
            states = list(map(state.get, ps))
        columns, master, stale = _state.columns(type(self).__name__, gi, group, states,
                                                self._state_keys, ps, all_ps, lps)
        if stale:  # dropped once the step has succeeded (Note [refused steps])
            (self._pending[1] if self._pending is not None else self._stale).extend(stale)
        if sharded:
            columns = [[x if x is None else _local(x) for x in xs] for xs in columns]
        elif sharding.holds_partitions(ps):
            ps, lps, lgs, columns, rows = sharding.pieces(type(self).__name__, gi, group, state,
                                                          self._state_keys, ps, lps, lgs, columns,
                                                          rows)
            sharded = True  # rows that stand for pieces of their sources
        params.extend(lps)
        grads.extend(lgs)
        steps.extend(columns[0])
        (exp_avgs if self._kind == "lamb" else momentum_buffers).extend(columns[1])
        if self._kind == "lamb":
            exp_avg_sqs.extend(columns[2])
        if master:
            masters.extend(columns[-1])
        if sharded:
            sources.extend(ps)
        if rows is not None:
            keys.extend(rows)
        if bases is None or sharded:
            return sharded, None
        if not fresh:
            chosen = {_backends.resolve(group["backend"], *key).name
                      for key in {(p.device, p.dtype, g.dtype) for p, g in zip(lps, lgs)}}
        if "eager" in chosen:
            return sharded, None
        return sharded, _state.traced_layout(
            [columns[0], *(columns[1:3] if self._kind == "lamb" else (columns[1],)),
             columns[-1] if master else [None] * len(ps)], bases, self._cache.bases)

    def _group(self, group: dict[str, Any]) -> TensorGroup:
        """The group's lists from :meth:`_init_group` as a TensorGroup; under torch.compile the
        state as views of its storages (Note [traced flat state] in fusedopt/_state.py)."""
        (params, grads, steps, exp_avgs, exp_avg_sqs, momentum_buffers, masters, sources,
         keys) = lists = ([], [], [], [], [], [], [], [], [])
        bases = [] if torch.compiler.is_compiling() else None
        sharded, layout, error = self._init_group(group, *lists, bases)
        if error is not None:
            raise {"ValueError": ValueError, "TypeError": TypeError}.get(error[0], RuntimeError)(
                error[1]) from None
        lamb = self._kind == "lamb"
        state = [exp_avgs, exp_avg_sqs] if lamb else [momentum_buffers]
        if layout is not None:
            _traced.guard_on(chain(steps, *state, masters))
            steps, *state, masters = ([None if e is None else bases[e[0]].as_strided(e[2], e[3], e[1])
                                       for e in column] for column in layout)
        return TensorGroup(
            params, grads, steps, hyper=self._hyper(group),
            exp_avgs=state[0] if lamb else None, exp_avg_sqs=state[1] if lamb else None,
            momentum_buffers=None if lamb else state[0],
            masters=None if all(map(is_, masters, repeat(None))) else masters,
            backend=group["backend"], sources=sources if sharded else None,
            keys=torch.tensor(keys, dtype=torch.int64) if keys else None,
            maximize=group["maximize"])

    # Note [refused steps]: a step that raises has changed nothing. Everything that can refuse
    # it is checked before the first write (fusedopt.functional's phase 0); the state that a step
    # creates for params without state is created only after their own checks
    # (check_new_params) and removed again if the step raises later; masters left over from
    # before master_weights was turned off are dropped only once the step succeeded (under
    # torch.compile, after its graph ran: _traced.drop_stale).
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        # Note [fallen back]: a frame of the step that dynamo gave up on (it refused a value, hit
        # what it cannot trace, or reached its recompile limit, which counts every optimizer's
        # compiles of the same code) runs eagerly while dynamo would compile each frame it calls
        # on its own; none of them may be (they hand each other views of the flat state, and
        # Note [refused steps] needs the eager step's bookkeeping), so the step is run again
        # outside dynamo. The test is written out in each frame: a helper would be a frame
        # that dynamo compiles.
        if not torch.compiler.is_compiling() and get_eval_frame_callback() is not None:
            return _traced.step_outside_dynamo(_TrustRatioOptimizer.step, self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            # rows made per step (Note [flat partitions] in fusedopt/_sharding.py) and the local
            # shards of DTensors (fresh tensor objects at every step, which dynamo cannot give
            # sources) run eagerly
            if self._sharding.partitions or self._sharded:
                _traced.step_outside_dynamo(_TrustRatioOptimizer.step, self, None)
            else:
                self._step()
            return loss
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{type(self).__name__}.step() called while another thread is in step() of the "
                "same optimizer; serialize the calls (one optimizer per thread is fine)")
        self._pending = ([], [])  # Note [refused steps]: (params given state, stale masters)
        self._stale.clear()  # left by a traced step that raised
        try:
            self._step()
        except BaseException:
            for p in self._pending[0]:
                self.state.pop(p, None)
            raise
        else:
            for p in self._pending[1]:
                # stale: the param itself has been the weight since master weights were turned
                # off; a master kept would restore old weights when they are turned on again
                self.state[p].pop("master_param", None)
        finally:
            self._pending = None
            self._lock.release()
        return loss

    def _step(self) -> None:
        if not torch.compiler.is_compiling() and get_eval_frame_callback() is not None:
            # Note [fallen back]: dynamo traced step() up to this call and gave up on this frame
            _traced.step_outside_dynamo(_TrustRatioOptimizer.step, self, None)
            return
        traced = torch.compiler.is_compiling()
        if not traced and type(self.state) is not OptimizerState:
            # replaced (`opt.state = defaultdict(dict)`, as some trainers reset an optimizer):
            # counted again from a new counter, so nothing kept can match it (Note [group plans])
            self.state = OptimizerState(self.state)
            self._fresh()
        lrs = [g["lr"] for g in self.param_groups if isinstance(g["lr"], torch.Tensor)]
        if len(set(map(id, lrs))) < len(lrs):  # one object in several groups
            if traced:  # before anything is traced: a graph break here costs nothing
                _traced.unshare_lrs_outside_graph(self)
            else:
                _traced.unshare_lrs(self.param_groups)
        for gi, group in enumerate(self.param_groups):
            self._checked_options(gi, group)
        if not traced:
            _adapters.check_step(self)  # settings that need an adapter not enabled
        groups = [self._group(group) if traced
                  else self._plan(gi).group(self.state, group, self._group, self._hyper)
                  for gi, group in enumerate(self.param_groups)]
        if traced:
            for gi, group in enumerate(self.param_groups):
                lr = group["lr"]
                # Note [group plans]: the guard (on identity) that traces again, and so reads, a
                # tensor lr that is new to its group
                if isinstance(lr, torch.Tensor) and id(lr) != id(self._plans[gi].lr):
                    raise AssertionError("unreachable: _init_group checked every tensor lr")
        reducer = self._sharding.reducer
        if reducer is None and any(g.sources for g in groups):
            from .distributed import reducer_for  # imported by the first step over DTensors
            reducer = reducer_for(groups, self.param_groups, self._cache)
        trust_ratio_step(
            self._kind,
            groups,
            cache=self._cache,
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            reducer=reducer,
            skip_nonfinite=self.skip_nonfinite,
            skipped_steps=self.skipped_steps,
        )
        if traced and self._stale:
            _traced.drop_stale(self)

    # ------------------------------------------------------------ checkpoint
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except that float32 state of low-precision params stays float32, the
        step count stays a float32 tensor on the param's device (torch would cast both), each
        group keeps the options of ``_OWN_OPTIONS`` it has (how this process runs and stores the
        step, not what was learned), and moments saved in another format than the group's
        ``state_precision`` gives them are converted (one warning). 8-bit moments are read as
        saved (codes and scales, Note [saved 8-bit state] in lowp.py), before anything changes.
        torch's hooks see what they see of torch's optimizers: the pre-hooks the state dict given
        (they may return another, as one that maps params by name does, which is then the one
        loaded), the post-hooks the state as loaded.

        Checkpoints of the optimizers fusedopt replaces resume (Note [foreign step counts] in
        fusedopt/_checkpoint.py): apex's ``FusedLAMB`` and timm's ``Lamb`` keep the step count in
        the param group, torch's ``SGD`` and timm's ``Lars`` keep none."""
        pre = self.register_load_state_dict_pre_hook(_TrustRatioOptimizer._loading)  # the last
        post = self.register_load_state_dict_post_hook(_TrustRatioOptimizer._loaded, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()
            self._load = None

    def _loading(self, state_dict: dict[str, Any]) -> None:
        """The last pre-hook of ``load_state_dict`` (fusedopt/_checkpoint.py)."""
        self._load = _checkpoint.read(self, state_dict, _OWN_OPTIONS)

    def _loaded(self) -> None:
        """The first post-hook of ``load_state_dict``: the state as this optimizer keeps it."""
        _traced.unshare_lrs(self.param_groups)
        self._fresh()  # Note [step cache]; the loaded options are checked at step()
        _checkpoint.finish(self, self._load)


# the constructors' arguments that are not param-group options: every other argument is one, in
# the order of the signature (the order of the keys of each param group)
_NOT_OPTIONS = ("self", "params", "skip_nonfinite", "__class__")


class FusedLAMB(_TrustRatioOptimizer):
    r"""LAMB (You et al. 2019) in the NVLAMB form, computed exactly as docs/math.md.

    Per tensor, with ``t`` its step count and ``λ`` the group's ``weight_decay``::

        m ← β1·m + β3·g            (β3 = 1-β1 if grad_averaging else 1)
        v ← β2·v + (1-β2)·g²
        m̂ = m / (1-β1^t),  v̂ = v / (1-β2^t)        (no correction if bias_correction=False)
        u = m̂ / (sqrt(v̂) + eps) + λ·w
        φ = ‖w‖ / ‖u‖   (1 if either norm is 0; clamped to trust_ratio_bounds; 1 if not adapt)
        w ← w − lr·φ·u

    With ``decoupled_weight_decay=True``, ``λ·w`` is left out of ``u`` and
    ``w ← w·(1 − lr·λ) − lr·φ·u`` (``φ`` from the weight before decay).
    ``max_grad_norm`` clips by the global norm of all gradients first.

    Args:
        params: iterable of parameters or param-group dicts (each group may override any option,
            and may set ``adapt=False`` to skip the trust ratio, see :func:`fusedopt.param_groups`).
        lr, betas, eps, weight_decay, bias_correction, grad_averaging, max_grad_norm,
        trust_ratio_bounds, decoupled_weight_decay: as in the formulas above.
        backend: ``"auto"`` (fastest usable, falling back to eager), ``"eager"``, ``"cpp"``,
            ``"triton"`` or ``"cuda"``; an explicit backend that cannot run raises at ``step()``.
        master_weights: keep an fp32 copy of bf16/fp16 params in ``state["master_param"]``
            (None = yes for bf16/fp16 params). The step updates the master and writes the param
            back rounded to nearest even; trust-ratio norms use the master.
        state_precision: how the moments are stored (docs/math.md, "Low-precision state"):
            ``"full"`` (the compute dtype), ``"bf16"`` (m rounded to nearest, v stochastically)
            or ``"8bit"`` (blocks of 256 with one scale each: about 1 byte per element and
            moment). The step reads the moments as stored, so the trust ratio is that of the
            update applied. Chosen when a param's state is created; ``load_state_dict`` converts
            state saved in another format (with a warning).
        state_min_numel: params with fewer elements keep full state (default 4096); a param
            can also be put in a group of its own with ``state_precision="full"``
            (:func:`fusedopt.param_groups`' ``full_state`` does it by name).
        maximize: step against the gradient's sign, as torch.optim's (the grads are read times
            -1: bit for bit the step on negated grads).
        foreach, fused: accepted as torch.optim accepts them; they change nothing (every
            backend is multi-tensor; ``backend`` chooses the kernels). ``fused=True`` with
            ``backend="eager"`` is refused.
        differentiable: only False (a step runs without autograd, in place).
        capturable: accepted for drop-in compatibility with torch optimizers. fusedopt steps are
            always capturable in a CUDA graph: step counts live on the param's device, ``lr`` may
            be a tensor, and ``step()`` reads no tensor value on the host (a tensor ``lr`` is
            read once when it is new to its group: at construction, or at the first step after
            it was assigned; take that step before capturing).
        skip_nonfinite: a step whose gradients hold inf or nan changes nothing (params, every
            state tensor, step counts), decided on the device without a host read, from the
            clipping total when ``max_grad_norm`` is set and from one fused read of the grads
            otherwise; ``opt.skipped_steps`` (an int64 tensor) counts such steps. Off by
            default, as in torch.optim, where one NaN gradient makes every parameter NaN.

    GradScaler: ``torch.amp.GradScaler`` hands its scale and ``found_inf`` to ``step()``; the
    gradients are unscaled as they are read (``p.grad`` untouched) and a step with an inf/NaN
    gradient is a no-op on the device, without a host sync.
    """

    _kind = "lamb"
    _state_keys = ("exp_avg", "exp_avg_sq")
    _hyper = staticmethod(lamb_hyper)

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = LAMB_DEFAULTS["lr"],
        betas: tuple[float, float] = LAMB_DEFAULTS["betas"],
        eps: float = LAMB_DEFAULTS["eps"],
        weight_decay: float = LAMB_DEFAULTS["weight_decay"],
        *,
        bias_correction: bool = LAMB_DEFAULTS["bias_correction"],
        grad_averaging: bool = LAMB_DEFAULTS["grad_averaging"],
        max_grad_norm: float | None = LAMB_DEFAULTS["max_grad_norm"],
        trust_ratio_bounds: tuple[float, float] | None = LAMB_DEFAULTS["trust_ratio_bounds"],
        decoupled_weight_decay: bool = LAMB_DEFAULTS["decoupled_weight_decay"],
        adapt: bool = LAMB_DEFAULTS["adapt"],
        backend: str = "auto",
        master_weights: bool | None = None,
        state_precision: str = "full",
        state_min_numel: int = 4096,
        capturable: bool = False,
        skip_nonfinite: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ):
        defaults = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        super().__init__(params, defaults, skip_nonfinite)


class FusedLARS(_TrustRatioOptimizer):
    r"""LARS (You, Gitman, Ginsburg 2017) in the form of Paddle's ``lars_momentum``, as docs/math.md.

    Per tensor, with ``κ = trust_coefficient`` and ``λ = weight_decay``::

        ratio = κ‖w‖ / (‖g‖ + λ‖w‖ + eps)      denominator="sum"
        ratio = κ‖w‖ / (‖g + λw‖ + eps)        denominator="combined"
        (1 if ‖w‖ or the gradient norm is 0; min(ratio, 1) if trust_clip; 1 if not adapt)
        d = ratio·(g + λw)
        lr_in_momentum=True:  v ← μ·v + lr·d;                    step = v   (nesterov: lr·d + μ·v)
        lr_in_momentum=False: v ← μ·v + (1-dampening)·d, v = d at t=1;  step = lr·v
                                                                 (nesterov: lr·(d + μ·v))
        w ← w − step

    The buffer is ``state["momentum_buffer"]`` (torch SGD's name). ``max_grad_norm`` clips by the
    global norm of all gradients first. ``lr`` defaults to torch SGD's 1e-3 so that the class
    constructs as SGD does; it means little for LARS, whose useful learning rate grows with the
    batch size and depends on ``trust_coefficient`` (docs/large-batch.md): give one (e.g.
    ``lr=0.1 * batch_size / 256`` with the default trust coefficient). See :class:`FusedLAMB` for ``backend``, ``master_weights``,
    ``state_precision`` (here for the momentum buffer, rounded to nearest), ``state_min_numel``
    and per-group options.
    """

    _kind = "lars"
    _state_keys = ("momentum_buffer",)
    _hyper = staticmethod(lars_hyper)

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = LARS_DEFAULTS["lr"],
        momentum: float = LARS_DEFAULTS["momentum"],
        weight_decay: float = LARS_DEFAULTS["weight_decay"],
        *,
        trust_coefficient: float = LARS_DEFAULTS["trust_coefficient"],
        eps: float = LARS_DEFAULTS["eps"],
        nesterov: bool = LARS_DEFAULTS["nesterov"],
        dampening: float = LARS_DEFAULTS["dampening"],
        trust_clip: bool = LARS_DEFAULTS["trust_clip"],
        denominator: str = LARS_DEFAULTS["denominator"],
        lr_in_momentum: bool = LARS_DEFAULTS["lr_in_momentum"],
        max_grad_norm: float | None = LARS_DEFAULTS["max_grad_norm"],
        adapt: bool = LARS_DEFAULTS["adapt"],
        backend: str = "auto",
        master_weights: bool | None = None,
        state_precision: str = "full",
        state_min_numel: int = 4096,
        capturable: bool = False,
        skip_nonfinite: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ):
        defaults = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        super().__init__(params, defaults, skip_nonfinite)
