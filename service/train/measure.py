"""What a rank actually holds: model-state bytes from DeepSpeed's own tensors, activation bytes from
autograd's saved tensors, and the peak memory of the process.

Model state (`model_state_bytes`): every tensor reachable from the engine's module (parameters, their
`.grad`, ZeRO-3's `ds_tensor` partitions) and from its optimizer object (ZeRO's flat buffers, fp32
master partitions, the inner optimizer's `state`), counted once per storage (views of one flat buffer
count once, at the storage's full size, padding included). Each storage is put in one class:
- `params`: storages of the module's parameters (ZeRO-3: the `ds_tensor` partitions, and with ZeRO++ hpZ
  the `ds_secondary_tensor` partitions each rank keeps of its node's share),
- `optimizer`: the inner optimizer's `state` tensors (Adam moments, step),
- `master`: fp32 copies of the parameters the optimizer updates (ZeRO's `single_partition_of_fp32_groups`,
  `fp32_partitioned_groups_flat`, the BF16 optimizer's fp32 groups) when they are not the parameters,
- `grads`: gradients (`.grad`, ZeRO's `averaged_gradients`, flat gradient buffers, anything named *grad*),
- `buffers`: every other tensor the optimizer keeps (communication buckets, pinned staging buffers,
  ZeRO's `temp_*` scratch copies).
Model state = params + grads + optimizer + master. It is read just before the optimizer step, when
gradients and optimizer states are both alive. Of it, the routed experts' share (MoE models,
`expert_state_bytes`) is counted apart as well.

Activations (`ActivationMeter`): `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd
saves for backward; storages of parameters are left out (a linear layer saves its weight), the rest
are counted once per storage while alive. The meter reports the peak of live saved bytes, which with
gradient accumulation is one micro-batch (backward frees it before the next forward) and with a
pipeline is every micro-batch in flight; with recompute it includes the recomputed layer during backward.
"""

from __future__ import annotations

import os
import resource
import weakref
from collections.abc import Iterator
from typing import Any

import torch

STATE_CLASSES = ("params", "grads", "optimizer", "master", "buffers")
_MASTER_NAMES = ("fp32", "single_partition", "master")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _tensors_in(value: Any, depth: int) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, is_grad) inside `value` (lists, tuples, dicts, `depth` deep), each tensor's `.grad` too."""
    if isinstance(value, torch.Tensor):
        yield value, False
        if value.grad is not None:
            yield value.grad, True
    elif depth > 0 and isinstance(value, list | tuple | set):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth - 1)


def _classify_attr(name: str) -> str:
    low = name.lower()
    if "norm" in low:  # `_global_grad_norm`: a scalar, not a gradient
        return "buffers"
    if low.startswith("temp_"):
        # Scratch space, not state: ZeRO-1/2 with optimizer offload stages every gradient through
        # `temp_grad_buffer_for_{cpu,gpu}_offload`, two buffers of the *largest parameter's* size
        # (stage_1_and_2.py), whatever Ψ and dp are; counting them as gradients made model state
        # 5 % too large on the tiny proxy (its embedding is 7.6 % of Ψ).
        return "buffers"
    if "grad" in low:
        return "grads"
    if any(key in low for key in _MASTER_NAMES):
        return "master"
    return "buffers"


class _Ledger:
    """Bytes per class, each storage counted once, in the first class that claims it."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.bytes = dict.fromkeys(STATE_CLASSES, 0)
        self.sources: dict[str, int] = {}  # "class:where" -> bytes, to say what DeepSpeed holds

    def add(self, t: torch.Tensor, cls: str, where: str = "") -> None:
        if t.numel() == 0 and _storage_bytes(t) == 0:
            return
        key = _storage_key(t)
        if key not in self.seen:
            self.seen.add(key)
            self.bytes[cls] += _storage_bytes(t)
            label = f"{cls}:{where}:{str(t.dtype).removeprefix('torch.')}"
            self.sources[label] = self.sources.get(label, 0) + _storage_bytes(t)


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def model_state_bytes(
    module: torch.nn.Module, optimizer: Any, detail: dict[str, int] | None = None
) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients, optimizer states, master copies and buffers.

    `detail`, if given, gets bytes per "class:source:dtype" (e.g. `grads:averaged_gradients:float32`).
    """
    ledger = _Ledger()
    params = list(module.parameters())
    for p in params:  # parameters first, so views of ZeRO's flat parameter buffers count as params
        ds_tensor = getattr(p, "ds_tensor", None)
        ledger.add(ds_tensor if ds_tensor is not None else p.data, "params", "module")
        secondary = getattr(p, "ds_secondary_tensor", None)  # ZeRO++ hpZ's intra-node copy
        if secondary is not None:
            ledger.add(secondary, "params", "hpz_secondary")
    inner = _inner_optimizer(optimizer)
    if inner is not None:
        for state in inner.state.values():
            for t, _ in _tensors_in(state, 2):
                ledger.add(t, "optimizer", "state")
        for group in inner.param_groups:
            for p in group["params"]:
                ledger.add(p.data, "master", "param_groups")  # what the optimizer updates, if not the params
                if p.grad is not None:
                    ledger.add(p.grad, "grads", "param_groups.grad")
    for p in params:
        if p.grad is not None:
            ledger.add(p.grad, "grads", "module.grad")
    if optimizer is not None and optimizer is not inner:
        for name, value in vars(optimizer).items():
            if isinstance(value, torch.nn.Module) or name in ("optimizer", "param_groups"):
                continue
            for t, is_grad in _tensors_in(value, 3):
                ledger.add(
                    t, "grads" if is_grad else _classify_attr(name), name + (".grad" if is_grad else "")
                )
    if detail is not None:
        detail.update(ledger.sources)
    result = dict(ledger.bytes)
    result["model_state"] = sum(result[c] for c in ("params", "grads", "optimizer", "master"))
    return result


def _is_expert(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of a routed expert's parameter (moe/experts.py sets `allreduce = False`; moe/utils.py
    `is_moe_param`)."""
    return getattr(param, "allreduce", True) is False


def _expert_tensors(module: torch.nn.Module, optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor of the routed experts' states: their parameters and gradients in the module, the
    optimizer groups DeepSpeed marks `moe` (master copies, their gradients, Adam's state), and ZeRO-1/2's
    gradient partitions of those groups (`averaged_gradients[i]` where `is_moe_param_group[i]`,
    stage_1_and_2.py `_configure_moe_settings`)."""
    for p in module.parameters():
        if _is_expert(p):
            yield p.data
            if p.grad is not None:
                yield p.grad
    inner = _inner_optimizer(optimizer)
    if inner is not None:
        for group in inner.param_groups:
            if group.get("moe"):
                for p in group["params"]:
                    yield p.data
                    if p.grad is not None:
                        yield p.grad
                    for t, _ in _tensors_in(inner.state.get(p, {}), 2):
                        yield t
    flags = getattr(optimizer, "is_moe_param_group", None) or []
    partitions = getattr(optimizer, "averaged_gradients", None) or {}
    for i, flag in enumerate(flags):
        if flag and partitions.get(i) is not None:
            for t, _ in _tensors_in(partitions[i], 2):
                yield t


def expert_state_bytes(module: torch.nn.Module, optimizer: Any) -> int:
    """Bytes of the routed experts' states on this rank (parameters, gradients, optimizer states, master
    copies), each tensor once at its own size: ZeRO-2 keeps the gradient partitions of every group in one
    flat buffer (stage_1_and_2.py `grads_in_partition`), whose storage the experts share with the rest
    of the model, so a storage is not the unit here as it is in `model_state_bytes`."""
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for t in _expert_tensors(module, optimizer):
        key = (str(t.device), t.data_ptr(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class _Packed:
    """What autograd keeps instead of a saved tensor: the tensor, and a hook on our own lifetime."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _generic_name(name: str) -> str:
    """`model.layers.3.mlp.down_proj` -> `layers.*.mlp.down_proj` (one row per kind of module)."""
    parts = ["*" if p.isdigit() else p for p in name.split(".")]
    return ".".join(p for p in parts if p not in ("model", "module")) or "(top)"


class ActivationMeter:
    """Peak bytes of tensors saved for backward, per storage, parameters excluded.

    Use as a context manager around forward *and* backward (recompute saves tensors during backward).
    A saved tensor is a parameter (not counted) when it is one, or shares the storage of a parameter of
    a module now running (a view such as `weight.t()`). Those storages are read at each save, because
    ZeRO-3 swaps a parameter's storage when it gathers it; reading only the running modules' own
    parameters keeps a save O(nesting depth). Reading every parameter of the model at each save, as this
    did before, cost O(layers²) host time a step: 66 ms at 8 tiny layers and 0.9 s at 32 on this CPU, and
    on an H200 it made an 8-layer 13B-width proxy step 1.5x slower than 2x its 4-layer step
    (benchmarks/results/gpu_proxy_depth.json). While `tally` is on, new saved bytes are also added up
    by the module that saved them (`by_module`, layer indices folded into `*`), to say which tensors
    dominate.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.live: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, references]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.tally = False
        self.by_module: dict[str, int] = {}
        self._stack: list[tuple[str, torch.nn.Module]] = []  # the modules now running, outermost first
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        for name, sub in module.named_modules():
            sub.register_forward_pre_hook(self._enter_hook(name))
            sub.register_forward_hook(self._exit_hook)

    def _enter_hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, _args: Any) -> None:
            self._stack.append((name, module))

        return hook

    def _exit_hook(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _is_running_parameter(self, key: tuple[str, int]) -> bool:
        """Whether `key` is the storage of a parameter of a module now running (innermost first), or of
        a direct child of the innermost one: a module may use its child's weight without calling the
        child (DeepSpeed's MoE gate runs `F.linear(x, self.wg.weight)`, moe/sharded_moe.py `TopKGate`),
        and under ZeRO-1/2 that weight's storage is the whole flat parameter buffer, which was counted
        as saved activations (+16 % on the tiny MoE proxy)."""
        for _, running in reversed(self._stack):
            for p in running.parameters(recurse=False):
                if p.numel() > 0 and _storage_key(p) == key:
                    return True
        if self._stack:
            for child in self._stack[-1][1].children():
                for p in child.parameters(recurse=False):
                    if p.numel() > 0 and _storage_key(p) == key:
                        return True
        return False

    def _release(self, key: tuple[str, int]) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self.live[key]

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.numel() == 0 or isinstance(tensor, torch.nn.Parameter):
            return tensor
        key = _storage_key(tensor)
        if self._is_running_parameter(key):
            return tensor
        entry = self.live.setdefault(key, [_storage_bytes(tensor), 0])
        if entry[1] == 0:
            self.live_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if self.tally:
                where = _generic_name(self._stack[-1][0]) if self._stack else "(outside modules)"
                self.by_module[where] = self.by_module.get(where, 0) + entry[0]
        entry[1] += 1
        packed = _Packed(tensor)
        weakref.finalize(packed, self._release, key)
        return packed

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


PEAK_MEMORY_NOTE = {
    "cuda": "torch.cuda.max_memory_allocated since the model was built (tensors only, no CUDA context)",
    "cpu": "peak resident set size (VmHWM) of the worker process since the model was built: every page the "
    "process touched, tensors plus the Python runtime, libraries, allocator slack and communication buffers",
}


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak: CUDA's allocator counter, or the kernel's VmHWM (writing 5 to clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # without clear_refs the peak covers the whole process lifetime (ru_maxrss)


def peak_memory_bytes(device: torch.device) -> int:
    """See PEAK_MEMORY_NOTE for what each device's number counts."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
