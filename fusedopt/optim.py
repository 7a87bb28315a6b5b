"""``FusedLAMB`` and ``FusedLARS``: thin ``torch.optim.Optimizer`` subclasses.

``step()`` validates and gathers tensors into buckets, then calls
:func:`fusedopt.functional.trust_ratio_step`; it holds no math.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import attrgetter, is_, methodcaller
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from . import _identity
from . import backends as _backends
from ._hyper import (
    LAMB_DEFAULTS,
    LARS_DEFAULTS,
    check_backend_name,
    lamb_hyper,
    lars_hyper,
    validate_lamb_group,
    validate_lars_group,
)
from .flat import _aligned_offsets, _dense_layout
from .functional import Bucket, compute_dtype, trust_ratio_step

_LOW_PRECISION = (torch.float16, torch.bfloat16)


_DEVICE = attrgetter("device")
_DTYPE = attrgetter("dtype")
_LAYOUT = attrgetter("layout")
_SHAPE = attrgetter("shape")
_CONTIGUOUS = methodcaller("is_contiguous")


def _any_dtensor(ts: list[torch.Tensor]) -> bool:
    return any(hasattr(t, "to_local") for t in ts)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _alias(buffer: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """A contiguous tensor of ``shape`` on ``buffer``'s storage from element ``offset`` on: it
    shares the storage but, unlike a view, has a version counter of its own."""
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), offset, shape)


@dataclass
class _GroupCache:
    """What a param group's single bucket was built from, reused while nothing changed.

    Note [plan cache]: gathering thousands of tensors into lists costs Python time on every step.
    A group whose params with grads, state dicts, state tensors, dtypes and options are the same
    objects as at the last step, with contiguous tensors throughout, reuses the lists of the last
    step and only takes the new grads, which its backend checks (``Backend.fits_cached_bucket``:
    dtype, layout). Anything else takes the full path, which validates and rebuilds: a state dict
    or a state tensor replaced or deleted by hand, ``load_state_dict``, another backend option.
    The cached buckets share one ``persistent`` dict, where a backend may keep a native handle of
    the lists (the cpp backend's BucketLists, Note [static lists] in csrc/cpu/ops.h). When the
    cached bucket holds every param of its group, such a backend may also read the grads itself
    (``Backend.take_cached_grads``): the step then builds no Python list of grads at all.
    """

    params: list[torch.Tensor]
    state: Any  # the optimizer's state mapping the lists came from
    states: list[dict[str, Any]]
    options: tuple  # (backend, master_weights) of the group
    p_dtype: torch.dtype
    g_dtype: torch.dtype
    backend: _backends.Backend
    lists: dict[str, list[torch.Tensor]]  # Bucket fields except grads
    persistent: dict  # the buckets' ``persistent`` dict (backend handles of the lists)
    whole_group: bool  # every param of the group is in the bucket (none was without a grad)
    # (state keys, the lists of their tensors): what each param's state dict must still hold
    state_entries: tuple[tuple[str, ...], tuple[list[torch.Tensor], ...]]


class _TrustRatioOptimizer(Optimizer):
    """Shared machinery of LAMB and LARS: validation, state, buckets, dispatch."""

    _kind: str
    _state_keys: tuple[str, ...]

    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        self._plan_cache: dict[int, _GroupCache] = {}
        self._state_seen: tuple | None = None  # see _state_as_seen
        self._state_same = False
        self._workspaces: dict[tuple, dict] = {}  # see _attach

    # ---------------------------------------------------------------- groups
    def _validate_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _hyper(self, group: dict[str, Any]):
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        candidate = dict(self.defaults)
        candidate.update({k: v for k, v in param_group.items() if k != "params"})
        self._validate_group(candidate)
        check_backend_name(candidate["backend"])
        if not isinstance(candidate["capturable"], bool):
            raise ValueError(f"Invalid capturable: {candidate['capturable']!r}; expected True or False")
        mw = candidate["master_weights"]
        if mw is not None and not isinstance(mw, bool):
            raise ValueError(f"Invalid master_weights: {mw!r}; expected None, True or False")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plan_cache = {}
        self._state_seen = None
        self._state_same = False
        self._workspaces = {}
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    # ----------------------------------------------------------------- state
    def _uses_master(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        mw = group["master_weights"]
        return p.dtype in _LOW_PRECISION and (mw is None or mw)

    def _init_states(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        """Create the state of ``ps`` (params of ``group`` without state).

        Note [flat state]: the state of the plain contiguous params of one (device, dtype) among
        ``ps`` lives in one buffer per state key: each param's ``exp_avg`` (``exp_avg_sq``,
        ``momentum_buffer``, ``master_param``) lies in its key's buffer, starting on a 64-byte
        boundary, and its ``step`` in one float32 buffer. The fused backends then
        stream each state list as (nearly) one array, and the step counts of thousands of
        tensors share a few cache lines instead of one allocation each: a cpp LAMB step over
        4000 tensors of 2,500 elements ran ~12% faster than with one allocation per tensor
        (LARS ~8%; BERT-base shapes unchanged). Each is a tensor of its own on the shared storage
        (``set_``, as ``torch.load`` rebuilds tensors), not a view: it has its own version counter,
        so a step bumps each written tensor's version once, as before. ``torch.save`` of the whole
        state dict writes each buffer once and ``torch.load`` restores the sharing;
        torch.distributed.checkpoint writes each tensor's own elements. Saving one state tensor
        alone writes its whole buffer (as for a view).
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
    def _check_group(self, gi: int, ps: list[torch.Tensor], gs: list[torch.Tensor]):
        """Raise on bad input of one group before anything is modified; return the group's
        (devices, param dtypes, grad dtypes). Set-based: cheap for thousands of tensors. Shapes and
        grad devices need no check: torch's ``.grad`` setter and autograd guarantee they match the
        param (the compiled backends check numel and strides again)."""
        name = type(self).__name__
        if any(lay is not torch.strided for lay in set(map(_LAYOUT, gs))):
            raise RuntimeError(f"{name} does not support sparse gradients (param group {gi})")
        p_dtypes, g_dtypes = set(map(_DTYPE, ps)), set(map(_DTYPE, gs))
        dtypes = p_dtypes | g_dtypes
        if any(d.is_complex for d in dtypes):
            raise RuntimeError(f"{name} does not support complex params (param group {gi}: {sorted(map(str, dtypes))})")
        if not all(d.is_floating_point for d in dtypes):
            raise RuntimeError(
                f"{name} needs floating-point params and grads (param group {gi}: {sorted(map(str, dtypes))})"
            )
        devices = set(map(_DEVICE, ps))
        if len(devices) > 1:
            raise RuntimeError(
                f"params of one group must be on one device; param group {gi} has params on "
                f"{sorted(str(d) for d in devices)}"
            )
        return devices, p_dtypes, g_dtypes

    def _cached(self, gi: int, group: dict[str, Any], ps, gs) -> _GroupCache | None:
        """The group's cache entry if it still describes ``ps`` and can take ``gs`` (see Note
        [plan cache])."""
        c = self._unchanged(gi, group, ps)
        if c is None or not c.backend.fits_cached_bucket(c.persistent, ps, gs, c.p_dtype, c.g_dtype):
            return None
        return c

    def _natively_cached(self, gi: int, group: dict[str, Any]) -> _GroupCache | None:
        """The group's cache entry if it holds every param of the group, its backend took the
        grads natively (``Backend.take_cached_grads``: no Python list of grads), and nothing
        changed. The backend is asked first: one that cannot take grads costs nothing here, and the
        identity checks run once per step, in ``_cached`` otherwise. Grads taken for an entry that
        turns out stale go with it when the full path rebuilds the cache."""
        c = self._plan_cache.get(gi)
        if c is None or not c.whole_group or not c.backend.take_cached_grads(c.persistent, c.g_dtype):
            return None
        return self._unchanged(gi, group, group["params"])

    def _unchanged(self, gi: int, group: dict[str, Any], ps) -> _GroupCache | None:
        """The group's cache entry if ``ps``, their state and the group's options are the objects
        it was built from."""
        c = self._plan_cache.get(gi)
        if (c is None or c.state is not self.state
                or c.options != (group["backend"], group["master_weights"])
                or not _identity.items_are(ps, c.params)):
            return None
        # a param's state dict replaced or deleted (opt.state[p] = {...}; del opt.state[p]), then
        # a state tensor replaced or removed inside it
        if not self._state_same and not all(map(is_, map(self.state.__getitem__, ps), c.states)):
            return None
        if not _identity.entries_are(c.states, *c.state_entries):
            return None
        return c

    def _remember(self, gi, group, ps, states, backend, b: Bucket) -> None:
        lists = {k: v for k, v in vars(b).items() if isinstance(v, list) and k not in ("grads", "writeback")}
        # the state keys whose tensors the lists hold, and those lists
        keyed = [(name, lists.get("masters" if name == "master_param" else name + "s"))
                 for name in self._state_keys + ("step", "master_param")]
        keyed = [(name, ts) for name, ts in keyed if ts is not None]
        b.persistent = {}
        self._plan_cache[gi] = _GroupCache(
            params=ps, state=self.state, states=states,
            options=(group["backend"], group["master_weights"]), p_dtype=b.param_dtype,
            g_dtype=b.grad_dtype, backend=backend, lists=lists, persistent=b.persistent,
            whole_group=len(ps) == len(group["params"]),
            state_entries=(tuple(n for n, _ in keyed), tuple(ts for _, ts in keyed)))

    def _state_as_seen(self) -> bool:
        """Whether ``self.state`` holds the same params and state dicts, in the same order, as
        when the last plan was built: then every cache entry's ``states`` still are the state
        dicts of its params (each entry was checked or made by that plan). One identity scan of
        the mapping's items, without hashing the params (a tensor's ``__hash__`` is a Python
        call): ~1 ms to look up every param of 4000, ~0.2 ms for the scan in Python, ~0.04 ms in
        C++ (fusedopt._identity; cold caches, measured)."""
        seen, st = self._state_seen, self.state
        return seen is not None and seen[0] is st and _identity.dict_items_are(st, seen[1], seen[2])

    def _build_plan(self):
        same = self._state_same = self._state_as_seen()
        if not same:
            self._state_seen = None  # until a plan is built from the state as it is now
        try:
            plan = self._plan_groups()
        finally:
            self._state_same = False
        if not same:
            self._state_seen = (self.state, list(self.state.keys()), list(self.state.values()))
        return plan

    def _plan_groups(self):
        staged = []
        for gi, group in enumerate(self.param_groups):
            native = self._natively_cached(gi, group)
            if native is not None:  # grads taken by the backend: grads=None
                staged.append((group, native, None, None, None, None))
                continue
            gs = [p.grad for p in group["params"]]
            if any(map(is_, gs, repeat(None))):  # skip params without grads
                has = [g is not None for g in gs]
                ps, gs = list(compress(group["params"], has)), list(compress(gs, has))
            else:
                ps = list(group["params"])
            hit = self._cached(gi, group, ps, gs) if ps else None
            if hit is not None:
                staged.append((group, hit, None, gs, None, None))
                continue
            self._plan_cache.pop(gi, None)
            lps, lgs = (list(map(_local, ps)), list(map(_local, gs))) if _any_dtensor(ps) else (ps, gs)
            devices, p_dtypes, g_dtypes = self._check_group(gi, lps, lgs)
            if len(p_dtypes) == 1 and len(g_dtypes) == 1:  # the common case: one bucket
                keys = [(*devices, *p_dtypes, *g_dtypes)] * len(ps)
            else:
                keys = list(zip(map(_DEVICE, lps), map(_DTYPE, lps), map(_DTYPE, lgs)))
            staged.append((group, ps, lps, lgs, keys, lps is not ps))
        # Resolve every backend before any state is created, so a refusal changes nothing.
        backends_of = [{k: _backends.resolve(group["backend"], *k) for k in set(keys)}
                       if keys is not None else None for group, _, _, _, keys, _ in staged]
        plan = []
        # id(bucket) -> params of its rows, DTensors kept: what fusedopt.distributed reduces over
        self._bucket_params = {}
        record = any(s[-1] for s in staged)
        for gi, ((group, ps, lps, lgs, keys, sharded), resolved) in enumerate(zip(staged, backends_of)):
            if isinstance(ps, _GroupCache):
                b = self._attach(gi, group, Bucket(grads=lgs, persistent=ps.persistent, **ps.lists),
                                 ps.g_dtype)
                if record:
                    self._bucket_params[id(b)] = ps.params
                plan.append((self._hyper(group), [(ps.backend, b)]))
                continue
            states = [self.state[p] for p in ps]
            fresh = [p for p, st in zip(ps, states) if not st]
            if fresh:
                self._init_states(group, fresh)
            by_key: dict[tuple, list[int]] = {}
            if len(resolved) == 1:
                by_key[keys[0] if keys else None] = range(len(ps))
            else:
                for i, k in enumerate(keys):
                    by_key.setdefault(k, []).append(i)
            entries = [(resolved[k], self._attach(gi, group, self._bucket(
                            group, [lps[i] for i in idx], [lgs[i] for i in idx],
                            [states[i] for i in idx], sharded), k[2]))
                       for k, idx in by_key.items() if k is not None]
            if record:
                for (_, b), idx in zip(entries, [ix for k, ix in by_key.items() if k is not None]):
                    self._bucket_params[id(b)] = [ps[i] for i in idx]
            elif len(entries) == 1 and not entries[0][1].writeback:
                self._remember(gi, group, ps, states, *entries[0])
            plan.append((self._hyper(group), entries))
        return plan

    def _attach(self, gi: int, group, b: Bucket, grad_dtype: torch.dtype) -> Bucket:
        """Give ``b`` its group's backend request and its workspace: one dict per param group and
        (device, param dtype, grad dtype), kept as long as the optimizer (Bucket.workspace)."""
        b.requested_backend = group["backend"]
        b.workspace = self._workspaces.setdefault((gi, b.device, b.param_dtype, grad_dtype), {})
        return b

    def _bucket(self, group, ps, gs, states, sharded: bool) -> Bucket:
        """A Bucket of one (device, param dtype, grad dtype), with contiguous stand-ins (written
        back after the step) for any param whose tensors do not share one dense layout."""
        master = self._uses_master(group, ps[0])
        local = _local if sharded else (lambda t: t)
        lists = {"params": ps, "grads": gs, "steps": [st["step"] for st in states],
                 "masters": [local(st["master_param"]) for st in states] if master else None}
        for k in self._state_keys:
            lists[k + "s"] = [local(st[k]) for st in states]
        b = Bucket(**lists)
        stateful = [lists[k + "s"] for k in self._state_keys] + ([lists["masters"]] if master else [])
        if all(all(map(_CONTIGUOUS, xs)) for xs in [ps, gs, *stateful]):
            return b
        for i, p in enumerate(ps):
            row = [ps, gs, *stateful]
            if all(_dense_layout(x[i]) and x[i].stride() == p.stride() for x in row):
                continue
            for j, xs in enumerate(row):
                stand_in = xs[i].contiguous()
                if j != 1:  # grads are only read
                    b.writeback.append((xs[i], stand_in))
                xs[i] = stand_in
        return b

    def _reducer(self):
        """Cross-rank reducer of norm partial sums; None unless params are sharded (or ZeRO global
        clipping is enabled), see :mod:`fusedopt.distributed`."""
        from .distributed import reducer_for
        return reducer_for(self)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._build_plan()
        trust_ratio_step(
            self._kind,
            plan,
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            reducer=self._reducer(),
        )
        return loss

    # ------------------------------------------------------------ checkpoint
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except that float32 state of low-precision params stays float32 and the
        step count stays a float32 tensor on the param's device (torch would cast both)."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is None:
                continue
            lp = _local(p)
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                if key == "step":
                    self.state[p][key] = value.to(device=lp.device, dtype=torch.float32)
                elif key == "master_param" or key in self._state_keys:
                    self.state[p][key] = value.to(device=p.device, dtype=compute_dtype(lp.dtype))


class FusedLAMB(_TrustRatioOptimizer):
    r"""LAMB (You et al. 2019) in the NVLAMB form, computed exactly as SPEC.md.

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
            be a tensor, and ``step()`` never reads a tensor value on the host.

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
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm, trust_ratio_bounds=trust_ratio_bounds,
            decoupled_weight_decay=decoupled_weight_decay, adapt=adapt,
            backend=backend, master_weights=master_weights, capturable=capturable,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group):
        validate_lamb_group(group)

    def _hyper(self, group):
        return lamb_hyper(group)


class FusedLARS(_TrustRatioOptimizer):
    r"""LARS (You, Gitman, Ginsburg 2017) in the form of Paddle's ``lars_momentum``, as SPEC.md.

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
    ):
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay,
            trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
            dampening=dampening, trust_clip=trust_clip, denominator=denominator,
            lr_in_momentum=lr_in_momentum, max_grad_norm=max_grad_norm, adapt=adapt,
            backend=backend, master_weights=master_weights, capturable=capturable,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group):
        validate_lars_group(group)

    def _hyper(self, group):
        return lars_hyper(group)
