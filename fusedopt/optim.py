"""``FusedLAMB`` and ``FusedLARS``: thin ``torch.optim.Optimizer`` subclasses.

``step()`` gathers each param group's lists (``_init_group``, creating state on first use) and
makes one call to :func:`fusedopt.functional.trust_ratio_step`; it holds no math.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import chain, repeat
from operator import is_
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from . import backends as _backends
from ._bucket import compute_dtype
from ._bucket import local as _local
from ._hyper import (
    LAMB_DEFAULTS,
    LARS_DEFAULTS,
    check_backend_name,
    lamb_hyper,
    lars_hyper,
    validate_lamb_group,
    validate_lars_group,
)
from ._state import OptimizerState
from .flat import _aligned_offsets
from .functional import TensorGroup, cached_bucket, trust_ratio_step

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MISSING = object()  # an option deleted from a param group


def _alias(buffer: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """A contiguous tensor of ``shape`` on ``buffer``'s storage from element ``offset`` on: it
    shares the storage but, unlike a view, has a version counter of its own."""
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), offset, shape)


def _guard_on(tensors) -> None:
    """Note [traced flat state]: under dynamo, make the traced step's guards cover ``tensors``
    (reading an attribute realizes each one's lazy variable, and with it the guard on its
    identity) although the graph does not use them (dynamo then drops them as inputs)."""
    for x in tensors:
        if x is not None:
            _ = x.dtype


@dataclass
class _Lists:
    """A param group's lists as the last step gathered them (Note [list cache])."""

    edits: int  # OptimizerState.edits when gathered
    params: list  # group["params"] as it was (the list object) ...
    members: tuple  # ... and its items
    options: tuple  # (backend, master_weights)
    with_grad: tuple[bool, ...] | None  # which params had a grad (None: all)
    group: TensorGroup  # grads left to fill in


class _TrustRatioOptimizer(Optimizer):
    """Shared machinery of LAMB and LARS: validation, state, gathering, dispatch.

    Note [list cache]: gathering thousands of tensors into lists costs Python time on every step,
    and the cpp backend keeps a native handle of a bucket's lists (Note [static lists] in
    csrc/cpu/ops.h). So a group's lists are kept, with a ``cache`` dict in which the functional
    layer keeps its buckets and the backends their handles, and reused while
    * the state mapping saw no edit (``OptimizerState.edits``: a state dict or state tensor
      replaced or removed, ``load_state_dict``; ``add_param_group`` and ``__setstate__`` clear the
      cache outright),
    * ``group["params"]`` holds the same params, the same ones have grads, and the group's
      ``backend`` and ``master_weights`` are unchanged.
    Each step then gathers only ``[p.grad for p in params]``; the backend checks the grads fit
    (``Backend.accepts_grads``). Under ``torch.compile`` no cache is used: ``_init_group`` runs
    at trace time and the graph's guards play its part.
    """

    _kind: str
    _state_keys: tuple[str, ...]

    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict[str, Any], skip_nonfinite: bool = False):
        if not isinstance(skip_nonfinite, bool):
            raise ValueError(f"Invalid skip_nonfinite: {skip_nonfinite!r}; expected True or False")
        self.skip_nonfinite = skip_nonfinite
        self._reducer = None
        self._option_keys = tuple(defaults)
        super().__init__(params, defaults)
        self.state = OptimizerState(self.state)
        self._fresh()
        # add_param_group checked every group (Note [option checks])
        self._checked = {gi: self._option_values(g) for gi, g in enumerate(self.param_groups)}
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = _local(first).device if first is not None else torch.device("cpu")
        #: steps skipped by ``skip_nonfinite`` since construction (an int64 tensor, never read on
        #: the host by the optimizer)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)

    def _fresh(self) -> None:
        self._lists: dict[int, _Lists] = {}
        self._checked: dict[int, tuple] = {}  # Note [option checks]
        self._pending: tuple[list, list] | None = None  # Note [refused steps]
        self._workspaces: dict[int, dict] = {}
        self._bases: tuple[int, dict] = (-1, {})  # Note [traced flat state]
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- groups
    def _validate_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _hyper(self, group: dict[str, Any]):
        raise NotImplementedError

    def _check_options(self, group: dict[str, Any]) -> None:
        """Every option of a param group (ValueError naming the first invalid one)."""
        self._validate_group(group)
        check_backend_name(group["backend"])
        if not isinstance(group["capturable"], bool):
            raise ValueError(f"Invalid capturable: {group['capturable']!r}; expected True or False")
        mw = group["master_weights"]
        if mw is not None and not isinstance(mw, bool):
            raise ValueError(f"Invalid master_weights: {mw!r}; expected None, True or False")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        candidate = dict(self.defaults)
        candidate.update({k: v for k, v in param_group.items() if k != "params"})
        self._check_options(candidate)
        super().add_param_group(param_group)
        if hasattr(self, "_lists"):
            self._lists.clear()

    def _checked_options(self, gi: int, group: dict[str, Any]) -> None:
        """Note [option checks]: a group's options are checked when the group is added and again
        at the step after any of them was replaced (by a scheduler, by hand, by
        ``load_state_dict``): the values last checked are kept and compared by identity, which
        costs one pass over a dozen keys. A tensor ``lr`` changed in place (as torch's schedulers
        do) is the same object and its value is not read again: a step reads no tensor value on
        the host (on an accelerator that would be a device sync per step)."""
        values = self._option_values(group)
        seen = self._checked.get(gi)
        if seen is not None and all(map(is_, values, seen)):
            return
        missing = [k for k, v in zip(self._option_keys, values) if v is _MISSING]
        if missing:
            key = missing[0]
            raise ValueError(f"{type(self).__name__}: param group {gi} has no option {key!r} "
                           "(deleted after construction?)")
        self._named(gi, self._check_options, group)
        self._checked[gi] = values

    def _option_values(self, group: dict[str, Any]) -> tuple:
        return tuple(group.get(k, _MISSING) for k in self._option_keys)

    def _named(self, gi: int, check, *args) -> None:
        try:
            check(*args)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{type(self).__name__}: param group {gi}: {e}") from None

    def __getstate__(self) -> dict[str, Any]:
        out = super().__getstate__()
        out["state"] = self.state.plain()
        out["skip_nonfinite"] = self.skip_nonfinite
        return out

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["state"] = {k: dict(v) for k, v in out["state"].items()}
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._option_keys = tuple(self.defaults)
        self.state = OptimizerState(self.state)
        self.__dict__.setdefault("skip_nonfinite", False)
        self.__dict__.setdefault("_reducer", None)
        if "skipped_steps" not in self.__dict__:
            self.skipped_steps = torch.zeros((), dtype=torch.int64)
        self._fresh()
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    def set_grad_norm_reducer(self, reducer) -> None:
        """Use ``reducer`` (a :class:`fusedopt.functional.SqSumReducer`, or None) to complete the
        clipping total across ranks at every step, e.g.
        :func:`fusedopt.distributed.enable_zero_global_clipping`."""
        self._reducer = reducer

    # ----------------------------------------------------------------- state
    def _uses_master(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        mw = group["master_weights"]
        return p.dtype in _LOW_PRECISION and (mw is None or mw)

    def _init_states(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        """Create the state of ``ps`` (params of ``group`` without state).

        Note [flat state]: the state of the plain contiguous params of one (device, dtype) among
        ``ps`` lives in one buffer per state key: each param's ``exp_avg`` (``exp_avg_sq``,
        ``momentum_buffer``, ``master_param``) lies in its key's buffer, starting on a 64-byte
        boundary, and its ``step`` in one float32 buffer. The fused backends then stream each
        state list as (nearly) one array, and the step counts of thousands of tensors share a
        few cache lines instead of one allocation each (docs/performance.md measures it). Each
        is a tensor of its own on the shared storage (``set_``, as ``torch.load`` rebuilds
        tensors), not a view: it has its own version counter, so a step bumps each written
        tensor's version once. ``torch.save`` of the whole state dict writes each buffer once and
        ``torch.load`` restores the sharing; torch.distributed.checkpoint writes each tensor's
        own elements. Saving one state tensor alone writes its whole buffer (as for a view).
        DTensor shards (sharded training) and non-contiguous params get tensors of their own.
        """
        flat: dict[tuple, list[torch.Tensor]] = {}
        for p in ps:
            if hasattr(p, "to_local") or not p.is_contiguous():
                self._init_state(group, p)
            else:
                flat.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), members in flat.items():
            cd = compute_dtype(dtype)
            offsets, total = _aligned_offsets([p.numel() for p in members], cd)
            steps = torch.zeros(len(members), dtype=torch.float32, device=device)
            buffers = {key: torch.zeros(total, dtype=cd, device=device) for key in self._state_keys}
            master = self._uses_master(group, members[0])  # one dtype: the same for all
            if master:
                buffers["master_param"] = torch.empty(total, dtype=torch.float32, device=device)
            for i, (p, offset) in enumerate(zip(members, offsets)):
                state = self.state[p]
                state["step"] = _alias(steps, i, ())
                for key, buffer in buffers.items():
                    state[key] = _alias(buffer, offset, p.shape)
                if master:
                    state["master_param"].copy_(p.detach())

    def _init_state(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """The state of one param without state, in tensors of its own (DTensors, non-contiguous
        params; see _init_states)."""
        state = self.state[p]
        lp = _local(p)
        cd = compute_dtype(lp.dtype)
        state["step"] = torch.zeros((), dtype=torch.float32, device=lp.device)
        for key in self._state_keys:
            state[key] = torch.zeros_like(p, dtype=cd, memory_format=torch.preserve_format)
        if self._uses_master(group, lp):
            state["master_param"] = p.detach().to(torch.float32, copy=True)

    # ----------------------------------------------------------------- step
    def _init_group(self, group, params, grads, steps, exp_avgs, exp_avg_sqs, momentum_buffers,
                    masters, sources, bases=None) -> tuple[bool, tuple | None]:
        """Append the group's params that have grads, and their tensors, to the lists (torch's
        ``_init_group`` shape: ``torch.compile`` runs it at trace time); create missing state.
        Params are the local shards of DTensors (``sources`` then holds the DTensors). Raises,
        with nothing changed, on what no backend can step. Returns whether params are sharded,
        and with ``bases`` (a list: a traced step) the state as views of the bases it appends
        there (Note [traced flat state]), None otherwise."""
        from .functional import check_tensors

        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        ps = [p for p in group["params"] if p.grad is not None]
        if not ps:
            return False, None
        sharded = any(hasattr(p, "to_local") for p in ps)
        lps = [_local(p) for p in ps] if sharded else ps
        lgs = [_local(p.grad) for p in ps]
        check_tensors(self._kind, gi, lps, lgs)
        # resolved here, before any state exists, so that a refused backend changes nothing (and
        # loaded here, outside what torch.compile traces)
        chosen = {_backends.resolve(group["backend"], *key).name
                  for key in {(p.device, p.dtype, g.dtype) for p, g in zip(lps, lgs)}}
        if len(set(map(id, ps))) != len(ps):
            raise ValueError(f"{type(self).__name__}: param group {gi} holds the same param twice")
        name = type(self).__name__
        fresh, stale = [], []
        for p, lp in zip(ps, lps):
            st = self.state.get(p)
            if not st:
                fresh.append(p)
                continue
            master = self._uses_master(group, lp)
            missing = [k for k in ("step", *self._state_keys, *(("master_param",) if master else ()))
                       if not isinstance(st.get(k), torch.Tensor)]
            if missing:
                j = next(k for k, q in enumerate(group["params"]) if q is p)
                raise RuntimeError(
                    f"{name}: param {j} of param group {gi} "
                    f"has no state tensor {missing[0]!r} (a state dict of another optimizer, or "
                    f"master weights switched on after steps?)")
            if not master and "master_param" in st:
                stale.append(p)
        if fresh:
            self._init_states(group, fresh)
        # Note [refused steps]: what a step that raises must undo (state it created) and what it
        # does only once it succeeded (dropping stale masters); at once under torch.compile
        pending = self._pending
        if pending is not None:
            pending[0].extend(fresh)
            pending[1].extend(stale)
        else:
            for p in stale:
                del self.state[p]["master_param"]
        layout = (self._state_layout(group, ps, bases)
                  if bases is not None and not sharded and "eager" not in chosen else None)
        for p, lp in zip(ps, lps):
            st = self.state[p]
            params.append(lp)
            grads.append(_local(p.grad))
            steps.append(st["step"])
            master = st.get("master_param") if self._uses_master(group, lp) else None  # not stale
            masters.append(None if master is None else _local(master))
            if self._kind == "lamb":
                exp_avgs.append(_local(st["exp_avg"]))
                exp_avg_sqs.append(_local(st["exp_avg_sq"]))
            else:
                momentum_buffers.append(_local(st["momentum_buffer"]))
            if sharded:
                sources.append(p)
        return sharded, layout

    def _state_layout(self, group, ps, bases: list) -> tuple:
        """Note [traced flat state]: the flat state (Note [flat state]) is tensors that share a
        storage and that a step writes. Given to a traced step as graph inputs, they would alias
        each other, and AOTAutograd would clone their storage once per tensor and copy it back
        around the operators (time that grows with the square of the tensor count). A traced step
        gets instead one tensor per storage (``bases``: each spans its storage, the same object
        for as long as the state is not edited, which the guards on it check) and builds each
        state tensor as a view of it in the graph. Returns, per list (steps, exp_avgs,
        exp_avg_sqs, momentum_buffers, masters), ``(base index, storage offset, shape, stride)``
        of each entry (None: no master), constants of the trace. The state tensors themselves are
        still appended to the lists, which the traced step then replaces by the views: dynamo
        guards on them, so a step after their replacement (``load_state_dict``) compiles again
        instead of writing the old storages. Only for the backends that run as operators:
        inductor fuses the eager backend's foreach operations, clones included, and views of the
        bases made its compile slower without making its step faster (docs/performance.md)."""
        if self._bases[0] != self.state.edits:
            self._bases = (self.state.edits, {})
        cache, index = self._bases[1], {}

        def entry(t):
            if t is None:
                return None
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device, t.dtype)
            if key not in index:
                base = cache.get(key)
                if base is None:
                    base = cache[key] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
                index[key] = len(bases)
                bases.append(base)
            return index[key], t.storage_offset(), tuple(t.shape), tuple(t.stride())

        keys = ("exp_avg", "exp_avg_sq") if self._kind == "lamb" else ("momentum_buffer",)
        states = [self.state[p] for p in ps]
        columns = [tuple(entry(st["step"]) for st in states)]
        columns += [tuple(entry(st[k]) for st in states) if k in keys else None
                    for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")]
        columns.append(tuple(entry(st.get("master_param") if self._uses_master(group, p) else None)
                             for p, st in zip(ps, states)))
        return tuple(columns)

    def _group(self, gi: int, group: dict[str, Any]) -> TensorGroup:
        """The group's TensorGroup, from the list cache when nothing changed (Note [list cache])."""
        self._checked_options(gi, group)
        all_ps = group["params"]
        grads = [p.grad for p in all_ps]
        # not `None in grads`: that calls Tensor.__eq__(None) on every grad, a torch dispatch each
        with_grad = (tuple(g is not None for g in grads)
                     if any(map(is_, grads, repeat(None))) else None)
        options = (group["backend"], group["master_weights"])
        hit = self._lists.get(gi)
        if (hit is not None and hit.edits == self.state.edits and hit.params is all_ps
                and hit.with_grad == with_grad and hit.options == options
                and len(hit.members) == len(all_ps) and all(map(is_, all_ps, hit.members))
                and not hit.group.sources):
            g = hit.group
            g.hyper = self._hyper(group)
            g.grads = grads if with_grad is None else [x for x in grads if x is not None]
            ready = cached_bucket(g)
            if ready is not False:
                if ready:
                    g.cache["ready"] = (g.grads, ready)  # taken by this step's trust_ratio_step
                return g
            # the kept bucket refused (a param changed dtype or shape in place): gather again,
            # which checks everything and names what is wrong
        g = self._gather(group, cache={}, workspaces=self._workspaces.setdefault(gi, {}))
        self._lists[gi] = _Lists(self.state.edits, all_ps, tuple(all_ps), options, with_grad, g)
        return g

    def _traced_groups(self) -> list[TensorGroup]:
        groups = []
        for gi, group in enumerate(self.param_groups):
            self._named(gi, self._check_options, group)
            groups.append(self._gather(group, traced=True))
        return groups

    def _gather(self, group: dict[str, Any], traced: bool = False, **kw) -> TensorGroup:
        """The group's lists from :meth:`_init_group` as a TensorGroup (``kw``: its cache);
        ``traced``: state as views of its storages (Note [traced flat state])."""
        params, grads, steps, exp_avgs, exp_avg_sqs, momentum_buffers, masters, sources = lists = (
            [], [], [], [], [], [], [], [])
        bases = [] if traced else None
        sharded, layout = self._init_group(group, *lists, bases)
        if layout is not None:
            _guard_on(chain(steps, exp_avgs, exp_avg_sqs, momentum_buffers, masters))
            steps, exp_avgs, exp_avg_sqs, momentum_buffers, masters = (
                None if column is None else
                [None if e is None else bases[e[0]].as_strided(e[2], e[3], e[1]) for e in column]
                for column in layout)
        lamb = self._kind == "lamb"
        return TensorGroup(
            params, grads, steps, hyper=self._hyper(group),
            exp_avgs=exp_avgs if lamb else None, exp_avg_sqs=exp_avg_sqs if lamb else None,
            momentum_buffers=None if lamb else momentum_buffers,
            masters=masters if any(m is not None for m in masters) else None,
            backend=group["backend"], sources=sources if sharded else None, **kw)

    def _step_reducer(self, groups: list[TensorGroup]):
        if self._reducer is not None:
            return self._reducer
        if not any(g.sources for g in groups):
            return None
        from .distributed import reducer_for
        return reducer_for(groups, self.param_groups)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            self._step(self._traced_groups())
            return loss
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{type(self).__name__}.step() called while another thread is in step() of the "
                "same optimizer; serialize the calls (one optimizer per thread is fine)")
        self._pending = ([], [])  # Note [refused steps]: (params given state, stale masters)
        try:
            self._step([self._group(gi, g) for gi, g in enumerate(self.param_groups)])
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
            self._let_go()
            self._lock.release()
        return loss

    def _let_go(self) -> None:
        """The list cache keeps no grad past the step, also one that raised (zero_grad frees
        them): the grads lists emptied, and a kept bucket that took grads for a step that never
        ran finishes (Note [taken grads] in csrc/cpu/ops.h)."""
        for entry in self._lists.values():
            g = entry.group
            g.grads = []
            ready = g.cache.pop("ready", None) if g.cache else None
            if ready is not None:
                be, b = ready[1]
                be.finish(b)

    def _step(self, groups: list[TensorGroup]) -> None:
        trust_ratio_step(
            self._kind,
            groups,
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            reducer=self._step_reducer(groups),
            skip_nonfinite=self.skip_nonfinite,
            skipped_steps=self.skipped_steps,
        )

    # ------------------------------------------------------------ checkpoint
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except that float32 state of low-precision params stays float32, the
        step count stays a float32 tensor on the param's device (torch would cast both), and each
        group keeps the ``backend`` it was built with (how this process runs, not state)."""
        backends = [g["backend"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        self._checked.clear()  # Note [option checks]: the loaded options are checked at step()
        for g, be in zip(self.param_groups, backends):
            g["backend"] = be
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is None:
                continue
            lp = _local(p)
            for key, value in saved.items():
                if key == "step" and (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      or isinstance(value, torch.Tensor) and value.numel() == 1):
                    # one rule for every backend: a float32 0-dim tensor on the param's device
                    # (torch's older Python-number format and int64 steps converted)
                    if not (isinstance(value, torch.Tensor) and value.dim() == 0
                            and value.dtype == torch.float32 and value.device == lp.device):
                        self.state[p][key] = torch.as_tensor(value).reshape(()).to(
                            device=lp.device, dtype=torch.float32, copy=True)
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                if key == "step":
                    continue
                elif key == "master_param" or key in self._state_keys:
                    self.state[p][key] = value.to(device=p.device, dtype=compute_dtype(lp.dtype))


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
        capturable: bool = False,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm, trust_ratio_bounds=trust_ratio_bounds,
            decoupled_weight_decay=decoupled_weight_decay, adapt=adapt,
            backend=backend, master_weights=master_weights, capturable=capturable,
        )
        super().__init__(params, defaults, skip_nonfinite)

    def _validate_group(self, group):
        validate_lamb_group(group)

    def _hyper(self, group):
        return lamb_hyper(group)


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
    global norm of all gradients first. See :class:`FusedLAMB` for ``backend``, ``master_weights``
    and per-group options.
    """

    _kind = "lars"
    _state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params,
        lr: float | torch.Tensor,
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
        capturable: bool = False,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay,
            trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
            dampening=dampening, trust_clip=trust_clip, denominator=denominator,
            lr_in_momentum=lr_in_momentum, max_grad_norm=max_grad_norm, adapt=adapt,
            backend=backend, master_weights=master_weights, capturable=capturable,
        )
        super().__init__(params, defaults, skip_nonfinite)

    def _validate_group(self, group):
        validate_lars_group(group)

    def _hyper(self, group):
        return lars_hyper(group)
