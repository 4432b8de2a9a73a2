"""Shared test setup: CPU only, one thread (small ops run faster so on 2 shared cores), no network."""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import recorded  # noqa: E402
import torch  # noqa: E402

try:                    # exercises/grade.py's references: the reference checkout only (exercises/INSTRUCTOR.md)
    from course_references import course_references  # noqa: F401
except ImportError:
    pass

torch.set_num_threads(1)

GRADING_SEED = int(os.environ.get("COURSE_GRADING_SEED") or 0)   # exercises/grade.py's official grade
_manual_seed = torch.manual_seed


class _MovedGenerator(torch.Generator):
    """Under the official grade, a test that compares with a recorded value draws its inputs with every seed moved
    by the grade's own seed: inputs no value stored in a student copy was recorded on (tests/recorded.py then
    computes the expected value on them)."""
    offset = 0

    def manual_seed(self, seed):
        return super().manual_seed(seed + _MovedGenerator.offset)


if GRADING_SEED:
    torch.Generator = _MovedGenerator
    torch.manual_seed = lambda seed: _manual_seed(seed + _MovedGenerator.offset)


if os.environ.get("COURSE_GRADING"):             # exercises/grade.py: an input changed in place is named
    import in_place
    in_place.guard()


def pytest_runtest_setup(item):
    """Before the test's fixtures draw anything: move the seeds of a test that calls expected(...), only."""
    import inspect
    fn = getattr(item, "function", None)
    _MovedGenerator.offset = GRADING_SEED if GRADING_SEED and fn and 'expected("' in inspect.getsource(fn) else 0


@pytest.fixture(autouse=True)
def numbered_calls(request):
    """tests/recorded.py numbers each test's calls for its expected values."""
    recorded.begin(request.node.nodeid)


def pytest_sessionfinish(session):
    if os.environ.get(recorded.RECORD):                 # exercises/make_goldens.py, in the reference checkout
        recorded.save(os.environ[recorded.RECORD])


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state (torch's global generator at seed 0), so that a test run
    alone, in its file or under exercises/grade.py draws the same anchors and inputs and reports the same numbers."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One encoder/feature cache for the whole session: the tiny encoders are pretrained once.

    ALIGN_TEST_CACHE=<dir> reuses a cache across sessions (a developer's quick loop); CI leaves it unset."""
    shared = os.environ.get("ALIGN_TEST_CACHE")
    return Path(shared) if shared else tmp_path_factory.mktemp("cache")


def random_features(B, T, D, grid=None, lengths=None, seed=0):
    """Random Features for tests. lengths: per-row real-token counts (text padding)."""
    from features import Features
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(B, T, D, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    if lengths is not None:
        for b, n in enumerate(lengths):
            mask[b, n:] = False
            tokens[b, n:] = 0
    pooled = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return Features(tokens=tokens, mask=mask, pooled=pooled, grid=grid)


def interrupted(method_cls, at_call):
    """method_cls whose loss raises KeyboardInterrupt (a Ctrl-C) at its at_call-th call, counting across instances."""
    class Stop(method_cls):
        calls = 0

        def loss(self, i, t):
            Stop.calls += 1
            if Stop.calls == at_call:
                raise KeyboardInterrupt
            return super().loss(i, t)
    return Stop


def assert_same(got, want, what, atol=None, rtol=None):
    """torch.testing.assert_close's check (same shape, dtype and tolerances; NaN never equal) with a one-line
    message for exercises/grade.py: what differs, how many entries, by how much and where."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    precise = got.dtype == torch.float64
    atol = (1e-7 if precise else 1e-5) if atol is None else atol
    rtol = (1e-7 if precise else 1.3e-6) if rtol is None else rtol
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (g - w).abs().nan_to_num(nan=float("inf"))
    bad = ~(diff <= atol + rtol * w.abs())
    if bad.any():
        worst = diff.flatten().argmax().item()
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(g.shape))) if g.dim() else ()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} entries differ, by up to "
                             f"{diff.flatten()[worst].item():.3g} (at {list(at)}: {g.flatten()[worst].item():.4g}, "
                             f"expected {w.flatten()[worst].item():.4g})")


def assert_gradient_matches_finite_differences(f, inputs, what, h=1e-2, atol=2e-3, rtol=5e-2, directions=4):
    """The gradient autograd gives of the scalar f(*inputs) agrees with f's own central differences along a few
    random directions, input by input: a function that is trained through must send its gradient back (a
    .detach(), .item() or torch.no_grad inside it sends back none, or part). f may compute in float32 (the step h
    and the tolerances allow for it)."""
    import inspect
    names = list(inspect.signature(f).parameters)
    inputs = [x.detach().double().requires_grad_() for x in inputs]
    out = f(*inputs)
    grads = torch.autograd.grad(out, inputs, allow_unused=True) if out.requires_grad else [None] * len(inputs)
    g = torch.Generator().manual_seed(0)
    for i, (x, grad) in enumerate(zip(inputs, grads)):
        grad = torch.zeros_like(x) if grad is None else grad
        for _ in range(directions):
            v = torch.randn(x.shape, generator=g, dtype=x.dtype)
            moved = lambda s, i=i, v=v: f(*[y.detach() + s * h * v if j == i else y.detach()
                                            for j, y in enumerate(inputs)])
            with torch.no_grad():
                fd = (float(moved(1)) - float(moved(-1))) / (2 * h)
            ad = float((grad * v).sum())
            if not abs(ad - fd) <= atol + rtol * abs(fd):
                none = not grad.abs().sum()
                raise AssertionError(
                    f"{what}: the gradient with respect to {names[i]} {tuple(x.shape)} along a random direction is "
                    f"{ad:.4g} by autograd, {fd:.4g} by finite differences" + (
                        ": no gradient flows back to it (something inside is cut from the graph: .detach(), "
                        ".item(), torch.no_grad, a tensor rebuilt from the values)" if none else ""))


class HostSyncs:
    """Counts the calls that make the host wait for a GPU's queue, on any device (a CPU here).

    Two means, because a CPU tensor reaches the host in two ways:
    - aten ops, seen through a TorchDispatchMode (every op passes it, the autograd backward's too):
      _local_scalar_dense (what .item(), bool(), int() and float() of a tensor and `if tensor:` become),
      and the ops whose output size depends on values (nonzero, masked_select, unique, boolean indexing:
      index / index_put with a bool index), which CUDA computes by copying a count back;
    - Tensor.tolist, Tensor.numpy and Tensor.__array__, which on a CPU read memory without an aten op
      (on CUDA each is a copy to the host), patched for the duration.
    A .cpu() copy is not counted: on a CPU it is no copy, and the code here sends results to the host only
    at the boundaries named in the device rule (a method and its features live on --device; what leaves
    for PIL, numpy or JSON crosses with .cpu()).
    `calls` lists what was counted, in order; `where` the innermost Python frame of each, as "file:line"
    relative to the repository (or torch's own file): a test can leave out tensors that stay on the host
    on a GPU too (the optimiser's step count, a batch's rows indexed in the cache before the copy)."""

    VALUE_SIZED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                   "unique_dim", "argwhere", "repeat_interleave"}

    def __init__(self):
        self.calls, self.where = [], []

    def count(self, name):
        import traceback
        root = str(Path(__file__).resolve().parents[1]) + "/"
        for f in reversed(traceback.extract_stack()[:-1]):
            if f.filename != __file__ and not any(
                    x in f.filename for x in ("_python_dispatch", "torch/_dynamo/", "torch/_compile.py")):
                break
        self.calls.append(name)
        self.where.append(f"{f.filename.removeprefix(root)}:{f.lineno}")

    def __len__(self):
        return len(self.calls)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name == "_local_scalar_dense" or name in HostSyncs.VALUE_SIZED or (
                        name in ("index", "index_put", "index_put_") and any(
                            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())):
                    counter.count(name)
                return func(*args, **(kwargs or {}))

        self.mode, self.saved = Mode(), {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy", "__array__")}
        for n, f in self.saved.items():
            def counted(t, *a, _f=f, _n=n, **kw):
                counter.count(_n)
                return _f(t, *a, **kw)
            setattr(torch.Tensor, n, counted)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def train_with(method, img, txt, args, out, device="cpu", **kw):
    """train.train on the loop flags of args (epochs, batch_size, lr, weight_decay, seed, resume), resolved
    as align.main resolves them on a GPU (the method's defaults where a flag is None; no CPU budget)."""
    import train
    from infra.run import Settings
    loop = train.plan_loop(Settings(args, type(method), {}, device, out).loop_given(method.defaults), method, len(img))
    return train.train(method, img, txt, loop, out, device, getattr(args, "resume", False), **kw)
