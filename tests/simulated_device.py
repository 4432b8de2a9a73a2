"""A simulated CUDA device on a CPU-only machine: align.py's CUDA paths run, and mixing fails as on a GPU.

A tensor "on the device" is an ordinary CPU tensor carrying a tag (`_on_device`), so every value
is computed for real and the run's metrics come out. A TorchFunctionMode sees every torch call:

- `.to("cuda")`, `.cuda()`, `device="cuda"` in a factory, `.to(tensor_on_device)`: the result is tagged;
  `.cpu()` / `.to("cpu")` untag it; `.device` / `.is_cuda` of a tagged tensor say cuda:0;
- an op whose tensor arguments are tagged and untagged at once raises RuntimeError, as CUDA does,
  except where CUDA allows it: a 0-dim host tensor (a scalar), `copy_` / `to` across, indexing a
  device tensor with host indices;
- `.numpy()` of a tagged tensor raises TypeError, as for a CUDA tensor;
- `.item()`, `bool()`, `.tolist()` of a tagged tensor count as host syncs (`syncs`);
- `.grad` that autograd made for a tagged parameter is tagged.

The CUDA-only calls take their CPU stand-ins: `torch.cuda.is_available()` is True, Stream / Event /
stream() / current_stream() are no-ops that record their use, `pin_memory()` returns the tensor
(pinned use counted), device properties report an H200-sized memory, `torch.autocast("cuda")`
runs its control flow (torch disables it without CUDA; the dtype asked for is recorded).
"""
import contextlib
import threading
import types
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

TAG = "_on_device"
CUDA = torch.device("cuda", 0)


def on_device(t):
    return isinstance(t, torch.Tensor) and getattr(t, TAG, False)


def tag(t):
    """t (a tensor, or tensors nested in tuples / lists / dicts) marked as on the device."""
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, TAG, True)
        except (AttributeError, RuntimeError):
            pass
        return t
    if isinstance(t, (tuple, list)):
        for x in t:
            tag(x)
    if isinstance(t, dict):
        for x in t.values():
            tag(x)
    return t


def untagged_copy(t):
    out = t.detach().clone() if not t.requires_grad else t.clone()
    if hasattr(out, TAG):
        delattr(out, TAG)
    return out


def is_cuda(device):
    if isinstance(device, torch.Tensor):
        return on_device(device)
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def is_host(device):
    return (isinstance(device, torch.device) and device.type == "cpu") or device == "cpu"


def tensors_in(args, kwargs):
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
    walk(args)
    walk(tuple(kwargs.values()))
    return out


G = torch.Tensor
GETTERS = {G.device.__get__: "device", G.is_cuda.__get__: "is_cuda", G.grad.__get__: "grad"}
ACROSS = {G.copy_, torch.Tensor.to, G.cpu, G.cuda, G.pin_memory, G.is_pinned, G.data.__set__,
          G.record_stream, G.share_memory_, G.__setstate__, G.__reduce_ex__, G.__deepcopy__,
          torch._has_compatible_shallow_copy_type, G.set_, G.is_set_to, G.is_same_size}
SYNCS = {G.item, G.__bool__, G.tolist, G.__int__, G.__float__, G.__index__}


class DeviceMode(TorchFunctionMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        what = GETTERS.get(func)
        if what == "device":
            return CUDA if on_device(args[0]) else func(*args, **kwargs)
        if what == "is_cuda":
            return on_device(args[0])
        if what == "grad":
            g = func(*args, **kwargs)
            return tag(g) if g is not None and on_device(args[0]) else g
        if func is G.numpy and on_device(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                            "the tensor to host memory first.")
        if func in SYNCS and on_device(args[0]):
            self.counts["sync"] += 1
        if func is G.pin_memory:
            self.counts["pin_memory"] += 1
            return args[0]
        if func is G.is_pinned:
            return True
        if kwargs.pop("pin_memory", False):
            self.counts["pin_memory"] += 1
        if func is G.record_stream:
            self.counts["record_stream"] += 1
            return None
        if func is G.cpu:
            return untagged_copy(args[0]) if on_device(args[0]) else args[0]
        if func is G.cuda:
            return tag(args[0].clone() if not on_device(args[0]) else args[0])
        if func is G.to:
            return self.to(func, args, kwargs)
        device = kwargs.get("device")
        to_device = device is not None and is_cuda(device)
        if to_device:
            kwargs["device"] = "cpu"
        if func is G.new_tensor or func is G.new_zeros or func is G.new_ones or func is G.new_empty \
                or func is G.new_full:
            to_device = to_device or (device is None and on_device(args[0]))
        if func not in ACROSS:
            self.refuse_mixing(func, args, kwargs)
        out = func(*args, **kwargs)
        if func == G.data.__set__:
            if on_device(args[1]):
                tag(args[0])
            elif hasattr(args[0], TAG):
                delattr(args[0], TAG)                   # Module.cpu(): the parameter is a host tensor again
            return out
        if to_device or (device is None and any(on_device(t) for t in tensors_in(args, kwargs))
                         and func is not G.copy_):
            if func is G.copy_:
                return out
            tag(out)
        return out

    def refuse_mixing(self, func, args, kwargs):
        ts = tensors_in(args, kwargs)
        dev = [t for t in ts if on_device(t)]
        if not dev:
            return
        host = [t for t in ts if not on_device(t) and t.dim() > 0 and t.device.type == "cpu"]
        if func in (G.__getitem__, G.__setitem__, G.index_select, torch.index_select) and on_device(args[0]):
            host = [t for t in host if t.dtype.is_floating_point and t is not args[0] and t is args[-1]] \
                if func is G.__setitem__ else []
        if host:
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, cuda:0 and cpu! (in {name}, simulated device)")

    def to(self, func, args, kwargs):
        t = args[0]
        other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get("other")
        if other is not None:                           # .to(other): its device and dtype
            target, dtype = (CUDA if on_device(other) else "cpu"), other.dtype
        else:
            target, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        out = t.to(dtype) if dtype is not None and dtype != t.dtype else t
        if target is None:
            return tag(out) if on_device(t) and out is not t else out
        if is_cuda(target):
            if out is t and not on_device(t):
                out = t.detach().clone().requires_grad_(t.requires_grad) if t.is_leaf else t * 1
            return tag(out)
        if on_device(out):
            return untagged_copy(out)
        return out


class Stream:
    def __init__(self, *a, **k):
        COUNTS["stream"] += 1

    def wait_event(self, event):
        COUNTS["wait_event"] += 1

    def wait_stream(self, other):
        COUNTS["wait_stream"] += 1

    def synchronize(self):
        pass


class Event:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        COUNTS["event"] += 1

    def synchronize(self):
        pass

    def query(self):
        return True


COUNTS = Counter()


@contextlib.contextmanager
def simulated_cuda(monkeypatch, bf16=True, memory=141 * 2 ** 30):
    """Inside: a CUDA device is there (simulated); yields the Counter of CUDA-only uses and host syncs."""
    COUNTS.clear()
    cuda = torch.cuda
    props = types.SimpleNamespace(total_memory=memory, name="simulated H200", major=9, minor=0,
                                  multi_processor_count=132)
    rng = {"state": torch.Generator().manual_seed(0).get_state()}
    patches = dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                   set_device=lambda d: None, get_device_properties=lambda d=None: props,
                   get_device_name=lambda d=None: props.name,
                   is_bf16_supported=lambda including_emulation=True: bf16 or including_emulation,
                   synchronize=lambda d=None: None, Stream=Stream, Event=Event,
                   stream=lambda s: contextlib.nullcontext(), current_stream=lambda d=None: Stream(),
                   empty_cache=lambda: None, manual_seed=lambda s: None, manual_seed_all=lambda s: None,
                   get_rng_state=lambda d="cuda": rng["state"].clone(),
                   set_rng_state=lambda s, d="cuda": rng.update(state=s.clone()),
                   get_rng_state_all=lambda: [rng["state"].clone()],
                   set_rng_state_all=lambda ss: rng.update(state=ss[0].clone()),
                   memory_allocated=lambda d=None: 0, max_memory_allocated=lambda d=None: 0,
                   reset_peak_memory_stats=lambda d=None: None)
    for name, value in patches.items():
        monkeypatch.setattr(cuda, name, value, raising=False)
    real_autocast = torch.autocast

    class autocast(real_autocast):
        def __init__(self, device_type, dtype=None, *a, **k):
            if device_type == "cuda":
                COUNTS[f"autocast {dtype}"] += 1
                device_type, dtype = "cpu", torch.bfloat16 if dtype is None else dtype
                k["enabled"] = False                    # control flow only: the values stay fp32
            super().__init__(device_type, dtype, *a, **k)
    monkeypatch.setattr(torch, "autocast", autocast)
    monkeypatch.setattr(torch.optim.Optimizer, "_accelerator_graph_capture_health_check", lambda self: None)
    real_pin = torch.Tensor.pin_memory

    def pin_memory(self, *a, **k):                      # also in threads the mode does not reach
        COUNTS["pin_memory"] += 1
        return self
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)

    def record_stream(self, stream):
        assert isinstance(stream, Stream), stream
        COUNTS["record_stream"] += 1
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    real_run = threading.Thread.run

    def run(self):                                      # decode, reader and writer threads see the device too
        with DeviceMode(COUNTS):
            real_run(self)
    monkeypatch.setattr(threading.Thread, "run", run)
    try:
        with DeviceMode(COUNTS):
            yield COUNTS
    finally:
        del real_pin
