"""Run Megatron-Core on a machine without CUDA (torch.distributed with gloo).

Megatron-Core assumes CUDA in a few places (docs/architecture.md, "Parallelism and devices"). Each patch
below names what it replaces and why; `apply_cpu_compat()` applies them all, once, and only when
CUDA is absent. Megatron-Core itself is not edited. The patches were verified on
megatron-core `VERIFIED_MEGATRON_CORE`; on another version a loud warning is emitted and
`tests/test_parallel_cpu_compat.py` fails if any patched symbol has gone.

The device mode is entered in the thread that applies the patches (the one that calls
`megatron_rl.parallel.init_distributed`) and stays active for the life of the process: run
Megatron from that thread. It sees every torch call of the process (about 2% overhead measured).

Gotchas of Megatron-Core that are not patched (callers must respect them):
- `RouterReplay.global_router_replay_instances` is class-level: call
  `RouterReplay.clear_global_router_replay_instances()` before building another model
  (`megatron_rl.models.build_model` does).
- Megatron's default distributed-checkpoint writer starts a spawned process that re-imports
  `__main__` (start-up must sit under `if __name__ == "__main__":`); the package's own saves use the
  in-process strategy of `models/torch_dist_io.py` instead. Megatron's loader needs `psutil`.
- MoE with TP needs sequence parallel: the check only runs in training mode, and in eval mode TP
  without SP gives expert gradients exactly 2x too large.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

VERIFIED_MEGATRON_CORE = "0.16.1"

_CPU = torch.device("cpu")
_OPTIMIZER_MODULE = "megatron.core.optimizer"
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@dataclass(frozen=True)
class Patch:
    """One named change: the symbols it replaces (`module:attr`), why, and how."""

    name: str
    reason: str
    targets: tuple[str, ...]
    apply: Callable[[], None]


# ---------------------------------------------------------------------------------------------
# torch.cuda stand-ins


class _NullStream:
    """A CUDA stream that orders nothing: CPU work is already sequential. A class (not a function)
    so that annotations such as `torch.cuda.Stream | None` in other libraries keep working."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


class _NullEvent:
    """A CUDA event that is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


_NULL_STREAM = _NullStream()


def _patch_cuda_device() -> None:
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]


def _patch_cuda_misc() -> None:
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]


def _patch_cuda_stream() -> None:
    torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NullEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]


def _patch_cuda_rng() -> None:
    # The "CUDA" generator IS the CPU default generator: dropout and init on CPU tensors draw from
    # it, so Megatron's per-TP-rank tracker states and the recompute RNG restore keep their meaning.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # Seed the generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_rng_fork_warning() -> None:
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropForkWarning())


# ---------------------------------------------------------------------------------------------
# The device mode: every "cuda" device request becomes the CPU


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a GPU


class _CudaToCpuMode(TorchFunctionMode):
    """`device='cuda'`, `.cuda()` and `.to('cuda')` land on the CPU, `pin_memory=True` is dropped (no
    pinned memory without an accelerator); the optimizer sees CUDA type names."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and result in _CUDA_TYPE_NAMES:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_OPTIMIZER_MODULE):
                return _CUDA_TYPE_NAMES[result]
        return result


_MODE = _CudaToCpuMode()


def _in_device_mode(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _MODE:
            return fn(*args, **kwargs)

    return wrapper


def _patch_device_mode() -> None:
    _MODE.__enter__()  # stays active for the life of the process (this thread)
    # Autograd runs backward without the mode; the recompute paths run forward code inside
    # backward, so they enter it again.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    cpf = random.CheckpointFunction
    cpf.backward = staticmethod(_in_device_mode(cpf.backward))
    cwo = random.CheckpointWithoutOutput
    cwo._recompute = _in_device_mode(cwo._recompute)


# ---------------------------------------------------------------------------------------------
# Megatron functions


def bind_missing_te_gemm() -> None:
    """Also needed on GPUs without Transformer Engine; a no-op when TE is installed."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def unflag_missing_te_mla() -> None:
    """Also needed on GPUs without Transformer Engine; a no-op when TE is installed."""
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not transformer_engine_importable():
        mla.HAVE_TE = False


def transformer_engine_importable() -> bool:
    """Whether the `transformer_engine` package itself imports (Megatron's extensions import without it)."""
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        return False
    return True


def _patch_a2a_splits() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_collectives() -> None:
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    @functools.wraps(gather)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):  # noqa: ANN001,ANN202
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)], dim=0)

    @functools.wraps(reduce_scatter)
    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):  # noqa: ANN001,ANN202
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        summed = input_.contiguous().clone()
        torch.distributed.all_reduce(summed, group=group)
        sizes = [int(s) for s in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return summed[start : start + sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


_TORCH_CUDA = "torch.cuda"
_RANDOM = "megatron.core.tensor_parallel.random"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"

PATCHES: tuple[Patch, ...] = (
    Patch(
        "cuda_device",
        "Megatron asks torch.cuda.current_device() for the device of every weight and buffer "
        "(about 160 call sites): answer the CPU. Without it the model cannot be built.",
        (f"{_TORCH_CUDA}:current_device",),
        _patch_cuda_device,
    ),
    Patch(
        "cuda_misc",
        "device_count/set_device/synchronize/empty_cache stubs: the pipeline p2p path synchronizes.",
        (
            f"{_TORCH_CUDA}:device_count",
            f"{_TORCH_CUDA}:set_device",
            f"{_TORCH_CUDA}:synchronize",
            f"{_TORCH_CUDA}:empty_cache",
        ),
        _patch_cuda_misc,
    ),
    Patch(
        "cuda_stream",
        "no-op Stream/Event/current_stream/default_stream/stream: the alltoall dispatcher creates a "
        "device-to-host stream at init (and DDP overlap uses streams).",
        (
            f"{_TORCH_CUDA}:Stream",
            f"{_TORCH_CUDA}:Event",
            f"{_TORCH_CUDA}:current_stream",
            f"{_TORCH_CUDA}:default_stream",
            f"{_TORCH_CUDA}:stream",
        ),
        _patch_cuda_stream,
    ),
    Patch(
        "cuda_rng",
        "the CUDA RNG (torch.cuda seed/state and Megatron's _get/_set_cuda_rng_state) maps to the CPU "
        "generator: model_parallel_cuda_manual_seed, the RNG tracker and recompute need it.",
        (
            f"{_TORCH_CUDA}:manual_seed",
            f"{_TORCH_CUDA}:manual_seed_all",
            f"{_TORCH_CUDA}:get_rng_state",
            f"{_TORCH_CUDA}:set_rng_state",
            f"{_RANDOM}:_get_cuda_rng_state",
            f"{_RANDOM}:_set_cuda_rng_state",
        ),
        _patch_cuda_rng,
    ),
    Patch(
        "rng_fork_warning",
        "with one generator for CPU and 'CUDA', the tracker's 'CPU RNG state changed within GPU RNG "
        "context' warning fires on every weight init: drop that one message.",
        (f"{_RANDOM}:CudaRNGStatesTracker",),
        _patch_rng_fork_warning,
    ),
    Patch(
        "device_mode",
        "a TorchFunctionMode sends device='cuda', .cuda() and .to('cuda') to the CPU (causal mask, "
        "schedules, optimizer buffers, grad clipping), drops pin_memory=True (RoPE's CP chunk index) and "
        "shows CUDA type names to "
        "megatron.core.optimizer (it checks p.type() == 'torch.cuda.FloatTensor'); re-entered in "
        "the two recompute paths because autograd runs backward without it.",
        (f"{_RANDOM}:CheckpointFunction", f"{_RANDOM}:CheckpointWithoutOutput"),
        _patch_device_mode,
    ),
    Patch(
        "te_gemm",
        "moe_utils reads te_general_gemm, a name bound only when Transformer Engine imports: "
        "NameError in the router GEMM without TE (upstream bug); bind it to None.",
        (f"{_MOE_UTILS}:router_gating_linear",),
        bind_missing_te_gemm,
    ),
    Patch(
        "te_mla",
        "multi_latent_attention sets HAVE_TE when Megatron's TE extensions import, which they do without "
        "Transformer Engine (as mocks): MLA then calls isinstance(x, TELinear) on a mock, a TypeError; "
        "clear the flag when transformer_engine does not import.",
        ("megatron.core.transformer.multi_latent_attention:HAVE_TE",),
        unflag_missing_te_mla,
    ),
    Patch(
        "a2a_splits",
        "the alltoall dispatcher turns split sizes into numpy only for CUDA tensors; gloo's "
        "all_to_all_single takes a sequence of ints, not a tensor: convert CPU tensors too.",
        (
            f"{_MOE_UTILS}:maybe_move_tensor_to_cpu",
            "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        ),
        _patch_a2a_splits,
    ),
    Patch(
        "uneven_coll",
        "gloo has no uneven all_gather and no list-form reduce_scatter (alltoall with ETP>1 and "
        "EP>1): emulate them (pad, gather, trim; all_reduce, slice).",
        (
            "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
            "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",
        ),
        _patch_uneven_collectives,
    ),
)

_applied = False


def _resolve(target: str) -> Any:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def missing_targets() -> list[str]:
    """Every patched symbol that the installed torch / megatron-core no longer has."""
    missing = []
    for patch in PATCHES:
        for target in patch.targets:
            try:
                _resolve(target)
            except (ImportError, AttributeError):
                missing.append(f"{patch.name}: {target}")
    return missing


def check_megatron_version() -> bool:
    """True on the verified megatron-core version; warns loudly otherwise."""
    import megatron.core

    version = megatron.core.__version__
    if version == VERIFIED_MEGATRON_CORE:
        return True
    message = (
        f"megatron-core {version} is installed but the CPU compatibility patches were verified on "
        f"{VERIFIED_MEGATRON_CORE}: rerun tests/test_parallel*.py and tests/test_models*.py before trusting results"
    )
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    logging.getLogger(__name__).warning(message)
    return False


def is_applied() -> bool:
    return _applied


def apply_cpu_compat() -> bool:
    """Apply every patch once when CUDA is absent; returns whether the patches are active."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    check_megatron_version()
    missing = missing_targets()
    if missing:
        raise RuntimeError(
            "megatron_rl CPU support: patched symbols are missing from this torch/megatron-core "
            f"(verified on megatron-core {VERIFIED_MEGATRON_CORE}): {missing}"
        )
    for patch in PATCHES:
        patch.apply()
    _applied = True
    return True
