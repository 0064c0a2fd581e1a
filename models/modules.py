"""Building blocks shared by the layers: norms, SwiGLU MLP, rotary embedding, short conv."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from ttr.kernels.common.index import tuned
from ttr.kernels.conv import causal_conv1d, causal_conv1d_update
from ttr.kernels.norm import gated_rms_norm, l2_norm, residual_rms_norm, rms_norm
from ttr.kernels.norm import norm_linear as fused_norm_linear
from ttr.kernels.swiglu import swiglu, swiglu_linear
from ttr.kernels.utils import bias_grad, weight_bias_grad, weight_grad


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype of x's device type when autocast is on there, else None."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


#: Maps at most this wide are bound by reading their input, not by their products: a 32768 x 2048
#: bf16 x takes about 0.03 ms to read on an H200, 64 outputs per row about 0.012 ms of products.
NARROW_MAP = 64


def _map_groups(params, n: int, joined: int = 0) -> list[list[int]]:
    """The maps of one ``_SharedInputLinear`` call by product: the first ``joined`` maps (when
    there are any) one product whose output is one tensor, the narrow maps (``NARROW_MAP``) of one
    parameter dtype among the rest one product when there are several, each other map its own."""
    rest = range(joined, n)
    first = [list(range(joined))] if joined else []
    narrow = [i for i in rest if params[i].shape[0] <= NARROW_MAP]
    if len(narrow) < 2 or len({params[i].dtype for i in narrow}) > 1:
        return first + [[i] for i in rest]
    return first + [narrow] + [[i] for i in rest if i not in narrow]


class GradColumns:
    """The input gradients of several maps of one input (``linears(x, *maps, into=)``) as the column
    blocks of one ``[..., sum(widths)]`` buffer: the backward of the ops that read the maps' outputs
    write their gradients straight into their blocks (``block``), and the maps' backward reads the
    buffer whole, one input-gradient product of K = sum(widths) and one weight-gradient product,
    where each map's own would read x once more and add into dx once more. A block that no op wrote
    is copied in (or zeroed, where its map's output got no gradient) before the products.

    ``linears`` lays it out in the forward (``ready`` from then on); the buffer is allocated when
    the first block is asked for, in the backward, and let go once the maps' backward has read it."""

    def __init__(self):
        self.ready, self.buffer = False, None

    def _layout(self, x: torch.Tensor, widths: list[int]) -> None:
        self.lead, self.widths, self.dtype, self.device = x.shape[:-1], widths, x.dtype, x.device
        self.starts = [sum(widths[:i]) for i in range(len(widths))]
        self.ready = True

    def block(self, i: int, shape=None) -> torch.Tensor:
        """Map i's column block, ``[..., widths[i]]`` (or viewed as ``shape``, which splits its last
        dim)."""
        if not self.ready:
            raise RuntimeError("GradColumns.block: the buffer is laid out by linears(..., into=) first")
        if self.buffer is None:
            self.buffer = torch.empty(*self.lead, sum(self.widths), dtype=self.dtype, device=self.device)
        b = self.buffer[..., self.starts[i]:self.starts[i] + self.widths[i]]
        return b if shape is None else b.view(shape)

    def take(self, grads) -> torch.Tensor:
        """The whole buffer ``[rows, sum(widths)]`` holding ``grads`` (one per map, each its block,
        another tensor of the block's shape, or None), which it then lets go of."""
        for i, g in enumerate(grads):
            b = self.block(i)
            if g is None:
                b.zero_()
            elif g.data_ptr() != b.data_ptr() or g.stride() != b.stride():
                b.copy_(g)
        whole, self.buffer = self.buffer, None
        return whole.view(-1, whole.shape[-1])


class _SharedInputLinear(torch.autograd.Function):
    """``F.linear(x, w_i, b_i)`` for one or several maps of one input, the weights cast to the
    input's dtype inside (autocast's cast). The backward accumulates the input's gradient in the
    products themselves (``dx += g_i w_i``, a matmul that adds into its output) instead of autograd
    summing one ``[tokens, hidden]`` gradient per map in separate kernels, and returns each weight's
    gradient in the weight's own dtype straight from its product (``weight_grad``).

    Narrow maps (Gated DeltaNet's two 16-wide gates) cost a read of x each way for almost no
    products, so they run as one product of their stacked weights (their outputs are views of its
    columns), and their input gradient is the first product of the backward, the one that writes
    dx without reading it. The first ``joined`` maps run as one product whose output is returned
    whole (the delta rules' q, k and v, whose short convs take it as column blocks and give its
    gradient back as one tensor): one product each way for the three, where three would add into
    dx one after the other. With ``into`` (a ``GradColumns``) every map runs its own product on
    its rows of one stacked cast weight, and the backward takes the maps' gradients from the
    buffer's column blocks as one product each way (``GradColumns``)."""

    @staticmethod
    def forward(ctx, x, n, joined, into, *params):
        biases = [b.to(x.dtype) if b is not None else None for b in params[n:]]
        groups = _map_groups(params, n, joined) if into is None else [[i] for i in range(n)]
        outs, kept = [None] * n, []
        stacked = None
        if into is not None:  # one cast pass into the stack; each map's weight is its rows
            stacked = torch.empty(sum(p.shape[0] for p in params[:n]), x.shape[-1], dtype=x.dtype, device=x.device)
            torch.cat(params[:n], out=stacked)
            into._layout(x, [p.shape[0] for p in params[:n]])
        for group in groups:
            if stacked is not None:
                w = stacked[into.starts[group[0]]:into.starts[group[0]] + into.widths[group[0]]]
            elif len(group) == 1:
                w = params[group[0]].to(x.dtype)
            else:  # cast as it is stacked: one pass over each weight, no cast copies to stack again
                w = torch.empty(sum(params[i].shape[0] for i in group), x.shape[-1], dtype=x.dtype, device=x.device)
                torch.cat([params[i] for i in group], out=w)
            bs = [biases[i] for i in group]
            b = bs[0] if len(group) == 1 else None if all(c is None for c in bs) else torch.cat(
                [c if c is not None else w.new_zeros(params[i].shape[0]) for i, c in zip(group, bs)])
            y = torch.nn.functional.linear(x, w, b)
            if joined and group[0] == 0:
                outs[0] = y
            else:
                for i, yi in zip(group, y.split([params[i].shape[0] for i in group], -1)):
                    outs[i] = yi
            kept.append(w)
        ctx.save_for_backward(x, *kept, *([] if stacked is None else [stacked]))
        ctx.into = into
        ctx.n, ctx.joined, ctx.groups, ctx.widths = n, joined, groups, [w.shape[0] for w in params[:n]]
        ctx.dtypes = [p.dtype if p is not None else None for p in params]
        ctx.set_materialize_grads(False)
        return (outs[0], *outs[joined:]) if joined else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *kept = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        need, n, widths, joined = ctx.needs_input_grad, ctx.n, ctx.widths, ctx.joined
        if ctx.into is not None and ctx.into.buffer is not None:
            present = [g is not None for g in grads]
            return _SharedInputLinear._from_columns(ctx, x, x2, kept[-1], ctx.into.take(grads), present)
        if ctx.into is not None:
            kept = kept[:-1]
        if joined:  # the joined maps' gradient is one tensor: its column blocks are theirs
            whole = grads[0].reshape(-1, sum(widths[:joined])) if grads[0] is not None else None
            parts = whole.split(widths[:joined], -1) if whole is not None else (None,) * joined
            grads = (*parts, *grads[1:])
        dx, dws, dbs = None, [None] * n, [None] * n
        # narrowest product first: it writes dx, each later one reads and adds into it, which a
        # wide product hides behind its own work and a narrow one does not
        for group, w in sorted(zip(ctx.groups, kept), key=lambda gw: gw[1].shape[0]):
            gs = [grads[i].reshape(-1, widths[i]) if grads[i] is not None else None for i in group]
            if all(g is None for g in gs):
                continue
            if joined and group[0] == 0:  # some block has a gradient, so ``whole`` is there
                g2 = whole
            else:
                g2 = gs[0] if len(group) == 1 else torch.cat(
                    [g if g is not None else x2.new_zeros(x2.shape[0], widths[i]) for i, g in zip(group, gs)], -1)
            if need[0]:
                dx = g2 @ w if dx is None else dx.addmm_(g2, w)
            wanted = [need[4 + i] and g is not None for i, g in zip(group, gs)]
            i0 = group[0]
            if len(group) == 1 and wanted[0] and need[4 + n + i0]:  # a map's weight and bias, perhaps one product
                dws[i0], dbs[i0] = weight_bias_grad(g2, x2, ctx.dtypes[i0], ctx.dtypes[n + i0])
                continue
            if any(wanted):
                dw = weight_grad(g2, x2, ctx.dtypes[i0]).split([widths[i] for i in group])
                for i, dwi, want in zip(group, dw, wanted):
                    dws[i] = dwi if want else None
            for i, g in zip(group, gs):
                if need[4 + n + i] and g is not None:
                    dbs[i] = bias_grad(g, ctx.dtypes[n + i])
        return (dx.view(x.shape) if dx is not None else None), None, None, None, *dws, *dbs

    @staticmethod
    def _from_columns(ctx, x, x2, stacked, whole, present):
        """The backward from the maps' gradients as one ``[rows, sum(widths)]`` tensor (``into``);
        a map whose output got no gradient (``present``) gets none for its weight and bias, as the
        module called alone would."""
        need, n, widths = ctx.needs_input_grad, ctx.n, ctx.widths
        dx = (whole @ stacked).view(x.shape) if need[0] else None
        wanted = [need[4 + i] and present[i] for i in range(n)]
        dws = [None] * n
        if any(wanted):
            dws = [dw if want else None for dw, want in zip(weight_grad(whole, x2, ctx.dtypes[0]).split(widths), wanted)]
        blocks = whole.split(widths, -1)
        dbs = [bias_grad(blocks[i], ctx.dtypes[n + i]) if need[4 + n + i] and present[i] else None for i in range(n)]
        return dx, None, None, None, *dws, *dbs


def plain_modules(modules, types=(nn.Linear,)) -> bool:
    """Every module exactly one of ``types`` (a plain ``nn.Linear`` by default) and no forward
    hook watching it: calling a Function in place of the module changes nothing a user can see."""
    return all(
        type(m) in types and not m._forward_hooks and not m._forward_pre_hooks for m in modules
    ) and not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _fusable(proj: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``proj`` may run inside a fused node on ``x`` (``norm_linear``, ``swiglu_linear``):
    a plain ``nn.Linear`` in a pass that records gradients, on x in the dtype it would compute in."""
    return plain_modules([proj]) and torch.is_grad_enabled() and (autocast_dtype(x) or proj.weight.dtype) == x.dtype


def linears(x: torch.Tensor, *modules: nn.Module, into: GradColumns | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in modules)``, with the backward of ``_SharedInputLinear`` when every
    module is a plain ``nn.Linear`` without hooks. Anything else (an adapter or quantised layer
    put in a linear's place, a forward hook) is called as a module, so it keeps its behaviour.
    ``into``: the maps' input gradients as column blocks of one buffer (``GradColumns``), where
    the maps can run as one product (``joinable``); ``into.ready`` tells whether it was taken."""
    if into is not None and not (len(modules) > 1 and joinable(modules)):
        into = None
    return _shared_input(x, modules, 0, into) or tuple(m(x) for m in modules)


def joinable(maps) -> bool:
    """Whether ``maps`` (``nn.Linear``) can run as one product: one weight dtype, and a bias on
    every map or on none."""
    return len({m.weight.dtype for m in maps}) == 1 and len({m.bias is None for m in maps}) == 1


def joined_linears(x: torch.Tensor, joined, *others: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """``(cat([m(x) for m in joined], -1), *(m(x) for m in others))`` by ``_SharedInputLinear``,
    the ``joined`` maps as one product whose output is one tensor (and whose gradient comes back as
    one); None where ``linears`` would call the modules (the caller then takes its own path)."""
    joined = list(joined)
    if len(joined) < 2 or not joinable(joined):
        return None
    return _shared_input(x, [*joined, *others], len(joined))


def _shared_input(x, modules, joined: int, into: GradColumns | None = None):
    """``_SharedInputLinear`` over ``modules`` where ``linears`` may take it, else None."""
    if not plain_modules(modules) or not torch.is_grad_enabled():
        return None
    weights, biases = [m.weight for m in modules], [m.bias for m in modules]
    dtype = autocast_dtype(x)
    if dtype is not None:  # the input's cast autocast would make for F.linear; the weights' is inside
        x = x.to(dtype)
    elif any(w.dtype != x.dtype for w in weights):
        return None  # the modules, called, raise F.linear's own error for mixed dtypes
    return _SharedInputLinear.apply(x, len(modules), joined, into, *weights, *biases)


def linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``module(x)`` by ``linears``: one map, its weight's gradient straight from its product."""
    return linears(x, module)[0]


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) through ``ttr.kernels.norm``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, branch: torch.Tensor | None = None):
        """``norm(x)``; with ``branch``, ``(x + branch, norm(x + branch))`` from one kernel (the
        residual add before a pre-norm)."""
        # Under autocast the output is in the autocast dtype: every consumer of a pre-norm is a
        # projection that would cast it anyway, once per projection (six in Gated DeltaNet).
        if branch is not None:
            return residual_rms_norm(x, branch, self.weight, eps=self.eps, out_dtype=autocast_dtype(x))
        return rms_norm(x, self.weight, eps=self.eps, out_dtype=autocast_dtype(x))


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(z)``: the output gate of GLA / Gated DeltaNet heads."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, eps=self.eps)


def norm_linear(x, z, weight, proj: nn.Module, *, eps: float, norm_before_gate: bool = True, groups: int = 1,
                heads: bool = False, dz_into=None):
    """``linear(norm(x, z), proj)``: a mixer's output norm (``gated_rms_norm``, ``rms_norm`` when
    z is None) and its output projection, x's last two dims (heads) merged for it with ``heads``.
    One autograd node (``kernels.norm.norm_linear``, which does not keep the norm's output for
    the projection's backward) when ``proj`` is a plain ``nn.Linear`` and the norm's output is in
    x's dtype as the projection would compute it; otherwise the norm and then ``linear``.
    ``dz_into``: the fused node's buffer for z's gradient (``kernels.norm.norm_linear``)."""
    if _fusable(proj, x):
        return fused_norm_linear(x, z, weight, proj.weight, proj.bias, eps=eps, norm_before_gate=norm_before_gate,
                                 groups=groups, heads=heads, dz_into=dz_into)
    if z is None:
        y = rms_norm(x, weight, eps=eps, out_dtype=autocast_dtype(x))
    else:
        y = gated_rms_norm(x, z, weight, eps=eps, norm_before_gate=norm_before_gate, groups=groups)
    return linear(y.flatten(-2) if heads else y, proj)


def output_projection(norm: nn.Module, x: torch.Tensor, z: torch.Tensor | None, proj: nn.Module,
                      dz_into=None) -> torch.Tensor:
    """``proj(norm(x[, z]))`` over the merged heads of x ``[..., H, D]``, by ``norm_linear`` when
    ``norm`` is ttr's own ``RMSNorm`` / ``GatedRMSNorm`` without hooks; any other module in its
    place is called."""
    if plain_modules([norm], (RMSNorm, GatedRMSNorm)):
        return norm_linear(x, z, norm.weight, proj, eps=norm.eps, heads=True, dz_into=dz_into)
    y = norm(x) if z is None else norm(x, z)
    return linear(y.flatten(-2), proj)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020, arXiv:2002.05202)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.down_proj._residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        joined = joined_linears(x, [self.gate_proj, self.up_proj]) if tuned("mlp_columns", enabled=True)[
            "enabled"] else None
        if joined is not None:
            # gate and up as one product, which the product and projection below read as its two
            # halves and whose gradient they give back as one tensor: one product each way where
            # two would read x twice forward and add into dx one after the other, and one weight
            # gradient product of twice the rows. ``TUNING["mlp_columns"] = {"enabled": False}``
            # takes the two products (for measurement).
            if _fusable(down, joined[0]):
                return swiglu_linear(joined[0], None, down.weight, down.bias)
            gate, up = joined[0].chunk(2, -1)
        else:
            gate, up = linears(x, self.gate_proj, self.up_proj)
        if _fusable(down, gate):  # the product is not kept for the down projection's backward
            return swiglu_linear(gate, up, down.weight, down.bias)
        return linear(swiglu(gate, up), down)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise the last dim (DeltaNet's q/k normalisation, Yang et al. 2024, arXiv:2406.06484)."""
    return l2_norm(x, eps=eps)


class ShortConv(nn.Module):
    """Depthwise causal convolution of width ``W`` with SiLU, through ``ttr.kernels.conv``.

    The short convolution of Mamba (Gu & Dao 2023, arXiv:2312.00752) that DeltaNet and Gated
    DeltaNet put on q, k and v. ``mask`` ``[B, T]`` zeroes padded inputs so they never enter a
    conv state; ``cu_seqlens`` keeps documents apart.
    """

    def __init__(self, dim: int, width: int, bias: bool = False, l2_group: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        # the delta rules' q and k: every head of the output scaled to unit L2 norm by the conv's
        # own kernels (no separate norm pass, and the output before the norm is never stored)
        self.l2_group = l2_group

    def init_conv_weights(self, init) -> None:
        # nn.Conv1d's default for a depthwise kernel: fan_in = width.
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        decoding: bool = False,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        if decoding:
            if state is None:
                state = x.new_zeros(x.shape[0], x.shape[2], self.weight.shape[1] - 1)
            y, new_state = causal_conv1d_update(x[:, 0], state, self.weight, self.bias, activation="silu",
                                                l2_group=self.l2_group)
            return y[:, None], new_state
        return causal_conv1d(
            x,
            self.weight,
            self.bias,
            activation="silu",
            cu_seqlens=cu_seqlens,
            initial_state=state,
            output_final_state=output_final_state,
            l2_group=self.l2_group,
        )


def mask_tokens(mask: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero every tensor ``[B, T, ...]`` at padded positions (``mask[b, t] == 0``)."""
    if mask is None:
        return tensors
    out = []
    for t in tensors:
        m = mask.view(*mask.shape, *([1] * (t.dim() - 2))).to(t.dtype)
        out.append(t * m)
    return tuple(out)


def run_short_convs(
    convs: list[ShortConv],
    xs: list[torch.Tensor],
    *,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    layer_cache: dict | None,
    decoding: bool,
) -> list[torch.Tensor]:
    """Apply ``convs[i]`` to ``xs[i]``, reading and writing the conv states in ``layer_cache``."""
    states = layer_cache.get("conv") if layer_cache is not None else None
    ys, new_states = [], []
    for i, (conv, x) in enumerate(zip(convs, xs)):
        y, state = conv(
            x,
            mask=mask,
            cu_seqlens=cu_seqlens,
            state=None if states is None else states[i],
            decoding=decoding,
            output_final_state=layer_cache is not None,
        )
        ys.append(y)
        new_states.append(state)
    if layer_cache is not None:
        layer_cache["conv"] = tuple(new_states)
    return ys


def init_time_step_bias(dt_bias: torch.Tensor, dt_min: float, dt_max: float, floor: float, init) -> None:
    """``dt_bias = softplus^-1(dt)`` with ``dt`` log-uniform in [dt_min, dt_max] (Gu & Dao 2023,
    arXiv:2312.00752, Sec. 3.6; reused by Mamba2 and Gated DeltaNet)."""
    u = torch.rand(dt_bias.shape, dtype=torch.float32, device=dt_bias.device)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    init.copy_(dt_bias, dt + torch.log(-torch.expm1(-dt)))
