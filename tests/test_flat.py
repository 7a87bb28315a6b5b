"""fusedopt.flatten_parameters: params and grads moved into flat buffers (Note [flat params])."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedopt

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(
    b not in fusedopt.available_backends(), reason=f"the {b} backend is not built here"))
    for b in ("eager", "cpp")]


class Net(torch.nn.Module):
    """Odd sizes, a channels_last conv weight, a 0-size param, a bf16 param, a frozen param and
    a weight used twice (tied)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 5, 3)
        self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)
        self.lin = torch.nn.Linear(5 * 4 * 4, 7)
        self.out = torch.nn.Linear(7, 7, bias=False)
        self.empty = torch.nn.Parameter(torch.empty(0))
        self.low = torch.nn.Parameter(torch.randn(9, generator=g).to(torch.bfloat16))
        self.frozen = torch.nn.Parameter(torch.randn(4, generator=g), requires_grad=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        h = torch.flatten(torch.tanh(self.conv(x)), 1)
        h = torch.tanh(self.lin(h))
        h = self.out(h) + h @ self.out.weight.T  # out.weight used twice
        return (h.sum() + self.empty.sum() + (self.low.float() ** 2).sum()
                + self.frozen.sum())


def batch(step: int) -> torch.Tensor:
    return torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(100 + step))


def snapshot(model):
    return [(p.detach().clone(), None if p.grad is None else p.grad.clone())
            for p in model.parameters()]


def test_layout_values_and_identity():
    model = Net()
    model(batch(0)).backward()  # existing grads are copied in
    params = list(model.parameters())
    before = snapshot(model)
    strides = [p.stride() for p in params]
    flat = fusedopt.flatten_parameters(model)
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert flat.params == params
    assert set(flat.buffers) == {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.bfloat16)}
    assert set(flat.grad_buffers) == set(flat.buffers)
    for p, (w, g), stride in zip(params, before, strides):
        assert torch.equal(p, w) and p.stride() == stride and p.dtype == w.dtype
        buf = flat.buffers[(p.device, p.dtype)]
        assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert buf.data_ptr() % 64 == 0 and p.storage_offset() * p.element_size() % 64 == 0
        if p.requires_grad:
            gbuf = flat.grad_buffers[(p.device, p.dtype)]
            assert p.grad.untyped_storage().data_ptr() == gbuf.untyped_storage().data_ptr()
            assert p.grad.storage_offset() == p.storage_offset()
            assert p.grad.stride() == stride
            assert torch.equal(p.grad, g)
        else:
            assert p.grad is None and g is None
    # the slots do not overlap: writing every param through its slot leaves each intact
    with torch.no_grad():
        for i, p in enumerate(params):
            p.fill_(i + 1)
    assert all(bool((p == i + 1).all()) for i, p in enumerate(params))


def test_grads_false_leaves_grads_alone():
    model = Net()
    model(batch(0)).backward()
    grads = [p.grad for p in model.parameters()]
    flat = fusedopt.flatten_parameters(model, grads=False)
    assert flat.grad_buffers == {}
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_backward_accumulates_in_place():
    twin, model = Net(), Net()
    flat = fusedopt.flatten_parameters(model)
    ptrs = [None if p.grad is None else p.grad.data_ptr() for p in model.parameters()]
    for m in (twin, model):
        m(batch(0)).backward()
        m(batch(1)).backward()  # accumulation
    assert [None if p.grad is None else p.grad.data_ptr() for p in model.parameters()] == ptrs
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    flat.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("flatten_after_first_step", [False, True])
def test_steps_equal_unflattened(kind, backend, flatten_after_first_step, compiled):
    """The optimizer computes the same bits on flattened params, including when the params move
    after it has built (and cached) its plan; so does its compiled step (against the uncompiled
    twin: bit for bit on cpp, while inductor fuses eager's foreach operations)."""
    twin, model = Net(), Net()
    torch._dynamo.reset()

    def make(m):
        ps = [p for p in m.parameters() if p.requires_grad]
        if kind == "lamb":
            return fusedopt.FusedLAMB(ps, lr=1e-2, weight_decay=0.01, backend=backend)
        return fusedopt.FusedLARS(ps, lr=0.5, weight_decay=1e-4, backend=backend)

    opt_twin, opt = make(twin), make(model)
    flat = None if flatten_after_first_step else fusedopt.flatten_parameters(model)
    steps = (opt_twin.step, torch.compile(opt.step) if compiled else opt.step)
    for step in range(4):
        for m, step_of in zip((twin, model), steps):
            m(batch(step)).backward()
            step_of()
        opt_twin.zero_grad(set_to_none=False)
        if flat is None:
            opt.zero_grad(set_to_none=False)
            flat = fusedopt.flatten_parameters(model)
        else:
            flat.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            if compiled and backend == "eager":
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(p, q), (kind, backend, step)
    assert all(p.untyped_storage().data_ptr() == flat.buffers[(p.device, p.dtype)].untyped_storage().data_ptr()
               for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_zero_grad_reattaches_views():
    model = Net()
    flat = fusedopt.flatten_parameters(model)
    views = [p.grad for p in model.parameters()]
    opt = fusedopt.FusedLAMB([p for p in model.parameters() if p.requires_grad])
    model(batch(0)).backward()
    opt.step()
    opt.zero_grad()  # set_to_none=True
    assert all(p.grad is None for p in model.parameters())
    flat.zero_grad()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    # backward(create_graph=True) replaces grads with new tensors
    model(batch(1)).backward(create_graph=True)
    replaced = [p for p, v in zip(model.parameters(), views) if v is not None and p.grad is not v]
    assert replaced
    flat.zero_grad()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    assert all(v is None or not v.any() for v in views)


def test_tied_parameter_flattened_once():
    emb = torch.nn.Embedding(11, 4)
    head = torch.nn.Linear(4, 11, bias=False)
    head.weight = emb.weight  # the usual weight tying: one Parameter object
    flat = fusedopt.flatten_parameters([emb.weight, head.weight])
    assert flat.params == [emb.weight] and head.weight is emb.weight
    assert flat.buffers[(torch.device("cpu"), torch.float32)].numel() == 44


def test_state_dict_round_trip():
    model = Net()
    fusedopt.flatten_parameters(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = Net()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    # deepcopy keeps working (each copied param gets its own storage)
    clone = copy.deepcopy(model)
    assert all(torch.equal(p, q) for p, q in zip(clone.parameters(), model.parameters()))


def _views_of_one():
    base = torch.randn(10)
    return [torch.nn.Parameter(base[:5]), torch.nn.Parameter(base[5:])]


def _with_grad(p, g):
    p.grad_dtype = None  # allow a grad of another dtype
    p.grad = g
    return [p]


def _grad_dtype(p, dtype):
    p.grad_dtype = dtype
    return p


class _Sharded(torch.Tensor):
    """Stands in for a DTensor: flatten_parameters refuses anything with ``to_local``."""

    def to_local(self):
        return self


def _flattened_before():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    fusedopt.flatten_parameters(params)
    return params


BAD = {
    "shared storage": (_views_of_one, ValueError, "share a storage"),
    "flattened before": (_flattened_before, ValueError, "already flattened"),
    "non-leaf": (lambda: [torch.randn(3, requires_grad=True) * 2], ValueError, "not a leaf"),
    "sparse": (lambda: [torch.randn(3, 3).to_sparse()], ValueError, "layout torch.sparse_coo"),
    "overlapping strides": (lambda: [torch.randn(3, 1).expand(3, 4)], ValueError, "overlap or leave gaps"),
    "gaps": (lambda: [torch.randn(4, 6)[:, ::2]], ValueError, "overlap or leave gaps"),
    "meta": (lambda: [torch.nn.Parameter(torch.empty(3, device="meta"))], ValueError, "meta device"),
    "dtensor": (lambda: [torch.randn(3).as_subclass(_Sharded)], ValueError, "DTensor"),
    "grad dtype": (lambda: _with_grad(torch.nn.Parameter(torch.randn(3)), torch.randn(3).double()),
                   ValueError, "grad of shape"),
    "sparse grad": (lambda: _with_grad(torch.nn.Parameter(torch.randn(3)), torch.randn(3).to_sparse()),
                    ValueError, "sparse_coo grad"),
    "grad_dtype": (lambda: [_grad_dtype(torch.nn.Parameter(torch.randn(3)), torch.bfloat16)],
                   ValueError, "grad_dtype torch.bfloat16"),
    "not a tensor": (lambda: [torch.nn.Parameter(torch.randn(3)), 3.0], TypeError, "item 2 is a float"),
    "param group": (lambda: [{"params": [torch.nn.Parameter(torch.randn(3))]}], TypeError, "a dict"),
    "single tensor": (lambda: torch.nn.Parameter(torch.randn(3)), TypeError, "single tensor"),
    "not iterable": (lambda: 3, TypeError, "got int"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_and_changes_nothing(case):
    make, exc, message = BAD[case]
    good = torch.nn.Parameter(torch.randn(5))  # a good param before the bad one
    good.grad = torch.randn(5)
    bad = make()
    params = [good, *bad] if isinstance(bad, list) else bad
    tensors = [good, *(t for t in (bad if isinstance(bad, list) else [bad]) if isinstance(t, torch.Tensor))]
    grad = lambda t: t.grad if t.is_leaf else None  # noqa: E731 (a non-leaf warns on .grad)
    before = [(t.data_ptr() if t.device.type != "meta" and t.layout == torch.strided else None,
               grad(t), t.detach().clone() if t.device.type != "meta" else None) for t in tensors]
    with pytest.raises(exc, match=message):
        fusedopt.flatten_parameters(params)
    for t, (ptr, g, value) in zip(tensors, before):
        assert grad(t) is g
        if ptr is not None:
            assert t.data_ptr() == ptr and torch.equal(t, value)


# ------------------------------------------------------------------------------ properties
_layouts = st.lists(
    st.tuples(st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),  # shape
              st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
              st.randoms(use_true_random=False),  # a permutation of the dims (dense layout)
              st.booleans(),  # has a grad
              st.booleans()),  # requires grad
    min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(_layouts)
def test_property_any_dense_layouts(specs):
    """Random shapes, dtypes, dim orders and grads: every param keeps its values, shape, strides
    and grad; no two slots overlap; each slot starts on a 64-byte boundary."""
    g = torch.Generator().manual_seed(0)
    params = []
    for shape, dtype, rnd, has_grad, requires_grad in specs:
        order = list(range(len(shape)))
        rnd.shuffle(order)
        base = torch.randn([shape[d] for d in order], generator=g).to(dtype)
        inverse = [order.index(d) for d in range(len(shape))]
        p = torch.nn.Parameter(base.permute(inverse), requires_grad=requires_grad)  # dense, any order
        if has_grad and requires_grad:
            p.grad = torch.randn(shape, generator=g).to(dtype)
        params.append(p)
    before = [(p.detach().clone(), p.stride(), None if p.grad is None else p.grad.clone())
              for p in params]
    flat = fusedopt.flatten_parameters(params)
    for p, (w, stride, grad) in zip(params, before):
        assert torch.equal(p, w) and p.stride() == stride
        assert p.storage_offset() * p.element_size() % 64 == 0
        if p.requires_grad:
            assert p.grad.stride() == stride and p.grad.storage_offset() == p.storage_offset()
            assert torch.equal(p.grad, grad) if grad is not None else not p.grad.any()
        else:
            assert p.grad is None
    with torch.no_grad():  # no overlap: each slot filled with its own index survives the others
        for i, p in enumerate(params):
            p.fill_(i + 1)
            if p.grad is not None:
                p.grad.fill_(-(i + 1))
    for i, p in enumerate(params):
        assert bool((p == i + 1).all())
        assert p.grad is None or bool((p.grad == -(i + 1)).all())
    for (device, dtype), buffer in flat.buffers.items():
        members = [p for p in params if p.dtype == dtype]
        assert all(p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                   for p in members)
