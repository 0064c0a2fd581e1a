"""Shared helpers for every op: backend choice, input validation and the device guard.

Backend choice is a run-time setting (``TTR_KERNEL_BACKEND=triton|torch``), never stored in a
model config. Default: Triton on CUDA tensors, torch on CPU tensors. Under the Triton
interpreter (``TRITON_INTERPRET=1``) ``TTR_KERNEL_BACKEND=triton`` runs the Triton kernels on
CPU tensors too, which is how CI checks them.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from ttr.kernels.common.index import Packing, check_cu_seqlens_form, host_cu_seqlens, tuned

BACKENDS = ("triton", "torch")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@contextlib.contextmanager
def env_override(name: str, value: str):
    """The environment variable ``name`` set to ``value`` inside the block, as it was (or unset)
    afterwards: the run-time settings the ops read (``TTR_KERNEL_BACKEND``, ``TTR_CHUNK_STATES``)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def backend_override(backend: str):
    """Inside the block every op runs on ``backend`` (``TTR_KERNEL_BACKEND``, restored afterwards):
    benchmarks timing both backends, and float64 oracles of ops that otherwise refuse float64."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return env_override("TTR_KERNEL_BACKEND", backend)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_backend(x: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for an op whose main input is ``x``."""
    choice = os.environ.get("TTR_KERNEL_BACKEND", "").strip().lower()
    if choice and choice not in BACKENDS:
        raise ValueError(f"TTR_KERNEL_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if not choice:
        return "triton" if x.is_cuda else "torch"
    if choice == "triton" and not x.is_cuda and not interpreter_active():
        raise ValueError(
            "TTR_KERNEL_BACKEND=triton with CPU tensors needs the Triton interpreter "
            "(set TRITON_INTERPRET=1 before importing ttr) or CUDA tensors"
        )
    return choice


def on_input_device(op):
    """Decorate a public op so that it runs with its first argument's GPU as the current device.

    Triton launches on the current CUDA device, not on the device of the tensors, so a model on
    ``cuda:1`` called while ``cuda:0`` is current would otherwise run its forward kernels on the
    wrong GPU (autograd runs the backward on the tensors' device by itself).
    """

    @functools.wraps(op)
    def guarded(*args, **kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return op(*args, **kwargs)
        return op(*args, **kwargs)

    return guarded


def check_dtype(name: str, x: torch.Tensor, allowed=SUPPORTED_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in allowed and x.dtype != torch.float64:
        raise TypeError(f"{name} has unsupported dtype {x.dtype}; expected one of {allowed}")


def check_like(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor, same_dtype: bool = False) -> None:
    """``x`` is a floating tensor of ``ref``'s shape on ``ref``'s device (and dtype, if asked)."""
    check_dtype(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name} must have {ref_name}'s shape {tuple(ref.shape)}, got {tuple(x.shape)}")
    if same_dtype and x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def check_projection(weight_name: str, weight: torch.Tensor, bias_name: str, bias: torch.Tensor | None,
                     width: int, what: str, x: torch.Tensor) -> None:
    """A projection applied to rows of ``width`` values (``what`` says which, for the message):
    ``weight [O, width]`` and ``bias [O]`` or None, floating, on x's device."""
    check_dtype(weight_name, weight)
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"{weight_name} must have shape [O, {width}] ({what}), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{weight_name} is on {weight.device} but the input is on {x.device}")
    if bias is not None:
        check_dtype(bias_name, bias)
        if bias.shape != weight.shape[:1] or bias.device != x.device:
            raise ValueError(f"{bias_name} must have shape [O] = [{weight.shape[0]}] on {x.device}, "
                             f"got {tuple(bias.shape)} on {bias.device}")


def check_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have shape {layout} ({rank} dims), got {tuple(x.shape)}")


def check_cu_seqlens(cu_seqlens, batch: int, seqlen: int) -> int:
    """Validate the FlashAttention packing convention; return the number of sequences N.

    A tensor is checked on the host (a device-to-host copy when it is on a GPU); a ``Packing`` was
    checked when ``prepare_packing`` built it, so only its length is compared here.
    """
    if cu_seqlens is None:
        return batch
    if not isinstance(cu_seqlens, Packing):
        check_cu_seqlens_form(cu_seqlens)
    if batch != 1:
        raise ValueError(f"packed input (cu_seqlens given) needs batch size 1, got B={batch}")
    if isinstance(cu_seqlens, Packing):
        if cu_seqlens.seqlen != seqlen:
            raise ValueError(f"cu_seqlens must end at T={seqlen}, got a Packing of {cu_seqlens.seqlen} tokens")
        return cu_seqlens.num_seqs
    return host_cu_seqlens(cu_seqlens, seqlen).numel() - 1


def check_initial_state(initial_state: torch.Tensor | None, n: int, h: int, k: int, v: int) -> None:
    if initial_state is None:
        return
    check_rank("initial_state", initial_state, 4, "[N, H, K, V]")
    if tuple(initial_state.shape) != (n, h, k, v):
        raise ValueError(f"initial_state must have shape [N, H, K, V] = {(n, h, k, v)}, got {tuple(initial_state.shape)}")


def check_head_dim(name: str, d: int) -> None:
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{name} head dim {d} exceeds the supported maximum {MAX_HEAD_DIM}")


def cast_linear(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``(F.linear(y, w, b), w)`` with ``w`` and ``b`` the weight and bias cast to y's dtype (the
    cast autocast would make): a fused op's projection, which keeps ``w`` for its backward and
    returns the gradients in the parameters' own dtypes (``weight_grad``, ``bias_grad``)."""
    w = weight.to(y.dtype)
    return torch.nn.functional.linear(y, w, None if bias is None else bias.to(y.dtype)), w


def weight_grad(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g^T x`` in the parameter's ``dtype``, from the fp32 accumulator of the product: under
    autocast (bf16 operands, fp32 weights) cuBLAS writes fp32 directly, where ``F.linear``'s
    backward would round the product to bf16 and then cast it up in a kernel of its own, one
    ``[out, in]`` read and write per weight per step. Off CUDA the operands are cast up first,
    which forms the same unrounded product."""
    with torch.autocast(g.device.type, enabled=False):  # a backward inside autocast would cast
        if g.dtype == dtype:
            return g.t() @ x
        if g.is_cuda and dtype == torch.float32:
            return torch.mm(g.t(), x, out_dtype=dtype)
        return g.t().to(dtype) @ x.to(dtype)


def add_weight_grad(acc: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``acc += g^T x`` in ``acc``'s dtype, the product's fp32 accumulator added in without rounding
    it to the operands' dtype first (cuBLAS reads ``acc`` in its epilogue, where ``acc += (g^T
    x).to(dtype)`` would round the product and then read and write ``acc`` in a kernel of its
    own). ``weight_grad`` forms the first term."""
    with torch.autocast(g.device.type, enabled=False):
        if g.dtype == acc.dtype:
            return acc.addmm_(g.t(), x)
        if g.is_cuda and acc.dtype == torch.float32:
            return torch.addmm(acc, g.t(), x, out_dtype=acc.dtype, out=acc)
        return acc.addmm_(g.t().to(acc.dtype), x.to(acc.dtype))


def bias_grad(g: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The bias's gradient, the column sums of ``g [rows, O]`` accumulated in fp32 and returned in
    the bias's ``dtype``; None where there is no bias (``dtype`` None)."""
    return None if dtype is None else g.sum(0, dtype=torch.float32).to(dtype)


def weight_bias_grad(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype,
                     bias_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight_grad(g, x, dtype), bias_grad(g, bias_dtype))``. Where x is narrow beside g (at most
    a quarter of its columns: GLA's rank-16 gate map up to its keys) the bias's gradient is one more
    column of the weight's product, x padded with a column of ones to a width of whole 16 bytes:
    g is read once, where the column sums are a reduction over g of their own (a slow one, across
    rows). ``TUNING["bias_column"] = {"enabled": False}`` takes the two apart (for measurement)."""
    n = x.shape[1]
    width = (n + 8) // 8 * 8  # n + 1 columns, rounded up to whole 16 bytes of bf16 (aligned rows)
    if bias_dtype != dtype or width * 4 > g.shape[1] or not tuned("bias_column", enabled=True)["enabled"]:
        return weight_grad(g, x, dtype), bias_grad(g, bias_dtype)
    padded = torch.nn.functional.pad(x, (0, width - n))
    padded[:, n] = 1
    both = weight_grad(g, padded, dtype)
    return both[:, :n].contiguous(), both[:, n].contiguous()


_RESIDENT: dict[tuple, int] = {}


def resident_programs(kernel, key: tuple, args, **kwargs) -> int:
    """How many programs of ``kernel`` (a ``triton.jit`` function), compiled for these launch
    arguments on the current CUDA device, one SM holds at once: the least of what its registers,
    shared memory and warps leave room for. Compiled without a launch (``warmup``) once per
    ``key``, which must name everything that selects the compiled kernel (constexprs, dtypes,
    launch options); ``args()`` gives the positional arguments and is called only then, so that a
    launcher asking on every call builds nothing once the count is known. For launchers that size
    their grid to whole waves of the GPU."""
    device = torch.cuda.current_device()
    full = (device, *key)
    if full not in _RESIDENT:
        compiled = kernel.warmup(*args(), grid=(1,), **kwargs)
        compiled._init_handles()  # loads the module: the registers are known from here on
        props = torch.cuda.get_device_properties(device)
        warps = compiled.metadata.num_warps
        # registers are given out per warp in units of 256 (8 per thread), and each of an SM's four
        # schedulers holds its warps' registers in its own quarter of the register file: at 138
        # registers a thread an SM holds 4 x 3 one-warp programs, not 65536 // 4608 = 14
        per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
        by_regs = 4 * (getattr(props, "regs_per_multiprocessor", 65536) // 4 // per_warp)
        fits = [by_regs // warps, getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps), 32]
        if compiled.metadata.shared:
            fits.append(getattr(props, "shared_memory_per_multiprocessor", 233472) // compiled.metadata.shared)
        _RESIDENT[full] = max(1, min(fits))
    return _RESIDENT[full]
