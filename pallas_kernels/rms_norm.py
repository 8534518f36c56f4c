"""A residual add and the zero-centred RMSNorm that follows it, as one kernel, its rows optionally written as FP8.

    x' = x + h  (rounded to x's dtype, as the model's add);   y = x' rsqrt(mean(x'^2) + eps) (1 + w)

XLA writes an RMSNorm as two kernels: the sum-of-squares reduction (with the add) and the scaling. In a one-lane
decode round each is a launch of one or two microseconds over a single row, twice per layer (79 norms a round at
35B-A3B, 129 at 27B). One program per row does the add, the reduction and the scaling. A row is read whole as
[groups, 128] (a power of two of 128-groups, masked past the hidden size: the 27B's 5120 in 64 groups).

`add_rms_norm_fp8` also writes y quantized per token and 128-group for the FP8 x FP8 products that read it, as
`fp8_matmul.quantize_rows` does (xs = max(|y|, 1e-12) / 448, xq = y / xs in float8_e4m3fn, from y in x's dtype).
XLA fuses the norm into the quantization's passes and computes it again in each; here y is computed once and,
where no product reads the bf16 rows (a projection wholly in FP8), never written.

`add_rms_norm_router` also computes the MoE router's logits against y (a one-lane round's MoE layers, whose
experts' first kernel routes from them: `moe.moe_experts_routed`): E / router_block_e programs a row, each
normalizing the row and reading its experts' rows of the router.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.fp8_matmul import BLOCK, group_scale, quantize_rows, sum_partials
from pallas_kernels.reference import rms_norm

_F32 = jnp.float32


def _kernel(*refs, eps: float, with_residual: bool, groups: int, with_rows: bool, quantize: bool):
    # refs: x [R, H], (h [R', H], R' >= R,) w [H], then the outputs: (x_out [R, H],) (y [R, H],) (xq [R, H] fp8,
    # xs [H / 128, R] f32); program r handles row r as [groups, 128] (the lanes past H read zeros, which add nothing
    # to the sum of squares, and store nothing)
    refs = list(refs)
    x_ref = refs.pop(0)
    h_ref = refs.pop(0) if with_residual else None
    w_ref = refs.pop(0)
    x_out_ref = refs.pop(0) if with_residual else None
    y_ref = refs.pop(0) if with_rows else None
    r, hidden = pl.program_id(0), x_ref.shape[1]
    group, col, valid = _columns(groups, hidden)
    x = _row(x_ref, h_ref, x_out_ref, r, col, valid, x_ref.dtype)
    y = _scaled(x, _inv_rms(x, hidden, eps), w_ref, col, valid, x_ref.dtype)
    if with_rows:
        _compat.store(y_ref.at[r, col], y, mask=valid)
    if quantize:
        xq_ref, xs_ref = refs
        yf = y.astype(_F32)
        scale = group_scale(yf)  # [groups]
        _compat.store(xq_ref.at[r, col], (yf / scale[:, None]).astype(xq_ref.dtype), mask=valid)
        _compat.store(xs_ref.at[group, r], scale, mask=group < hidden // BLOCK)


def _columns(groups: int, hidden: int):
    """A row as [groups, 128]: the group index [groups], each lane's column [groups, 128] and whether it is < H."""
    group = jnp.arange(groups)
    col = group[:, None] * BLOCK + jnp.arange(BLOCK)[None, :]
    return group, col, col < hidden


def _row(x_ref, h_ref, x_out_ref, r, col, valid, dtype):
    """Row r's x (+ h, rounded to x's dtype as the model's add) at columns col; x_out_ref, when given, gets it. h
    [S, R', H] float32: a product's K ranges' partial sums, added in order and rounded to x's dtype first (the
    product's output, as `fp8_gemm`'s own sum)."""
    x = _compat.load(x_ref.at[r, col], mask=valid, other=0)
    if h_ref is not None and len(h_ref.shape) == 3:
        h = _compat.load(h_ref.at[0, r, col], mask=valid, other=0)
        for s in range(1, h_ref.shape[0]):
            h = h + _compat.load(h_ref.at[s, r, col], mask=valid, other=0)
        x = (x.astype(_F32) + h.astype(dtype).astype(_F32)).astype(dtype)
    elif h_ref is not None:
        x = (x.astype(_F32) + _compat.load(h_ref.at[r, col], mask=valid, other=0).astype(_F32)).astype(dtype)
    if x_out_ref is not None:
        _compat.store(x_out_ref.at[r, col], x, mask=valid)
    return x


def _inv_rms(x, hidden: int, eps: float):
    """rsqrt(mean(x^2) + eps) of a row held as [groups, 128] (zeros past H): reference.rms_norm's mean, in two
    steps."""
    xf = x.astype(_F32)
    return lax.rsqrt(jnp.sum(jnp.sum(xf * xf, axis=1), axis=0) / hidden + eps)


def _scaled(x, inv, w_ref, col, valid, dtype):
    """The norm's rows at columns col: x times the row's inverse RMS inv and (1 + w), in `dtype`."""
    w = _compat.load(w_ref.at[col], mask=valid, other=0).astype(_F32)
    return (x.astype(_F32) * inv * (1.0 + w)).astype(dtype)


def _router_kernel(*refs, eps: float, with_residual: bool, groups: int, block_e: int):
    # refs: x [R, H], (h [R', H],) w [H], router [E, H], then the outputs x_out [R, H] (with h), y [R, H], logits
    # [R, E] f32. Program (r, b) normalizes row r (each program of the row alike), program (r, 0) writes x' and y,
    # and each writes the logits of experts [b BE, (b + 1) BE): its [BE, groups, 128] tile of the router read in one
    # load (a loop over the groups ran one latency after another: 10 us)
    refs = list(refs)
    x_ref = refs.pop(0)
    h_ref = refs.pop(0) if with_residual else None
    w_ref, router_ref = refs.pop(0), refs.pop(0)
    x_out_ref = refs.pop(0) if with_residual else None
    y_ref, logits_ref = refs
    r, b, hidden = pl.program_id(0), pl.program_id(1), x_ref.shape[1]
    _, col, valid = _columns(groups, hidden)
    experts = b * block_e + jnp.arange(block_e)
    tile = _compat.load(router_ref.at[experts[:, None, None], col[None]], mask=valid[None], other=0)
    x = _row(x_ref, h_ref, None, r, col, valid, x_ref.dtype)
    y = _scaled(x, _inv_rms(x, hidden, eps), w_ref, col, valid, y_ref.dtype)

    @pl.when(b == 0)
    def _():
        if x_out_ref is not None:
            _compat.store(x_out_ref.at[r, col], x, mask=valid)
        _compat.store(y_ref.at[r, col], y, mask=valid)

    # bf16 x bf16 products are exact in float32
    _compat.store(logits_ref.at[r, experts], jnp.sum(jnp.sum(y.astype(_F32)[None] * tile.astype(_F32), axis=2), axis=1))


@dataclasses.dataclass(frozen=True)
class AddNormConfig:
    """Tuning knobs (hashable)."""

    num_warps: int = 4
    max_hidden: int = 8192  # the widest row a program holds (its block, a power of two)
    # `add_rms_norm_router`: experts a program and its warps. 4 on 8 warps gave the shortest one-lane 35B-A3B MoE layer
    # on an H100 (32.0 us against 32.1 for 8 experts on 8 warps, 32.7 on 4; 16 experts 33.8: the norm, then XLA's
    # router matmul, 34.0)
    router_block_e: int = 4
    router_num_warps: int = 8

    def warps(self, block: int) -> int:
        """Warps for a row block: 4 up to 4096 values, one more warp a 1024 past it (registers per thread)."""
        return max(self.num_warps, block // 1024)


DEFAULT_CONFIG = AddNormConfig()


def supported(x: jax.Array) -> bool:
    """Whether `add_rms_norm` takes x [R, H]: 16 <= H <= max_hidden."""
    return x.ndim == 2 and 16 <= x.shape[-1] <= DEFAULT_CONFIG.max_hidden


def fp8_supported(x: jax.Array) -> bool:
    """Whether `add_rms_norm_fp8` takes x [R, H]: whole 128-groups as well."""
    return supported(x) and x.shape[-1] % BLOCK == 0


def _fits(x, h, w) -> bool:
    """Whether h (None, [R' >= R, H], or float32 partial sums [S, R' >= R, H]) and w [H] go with x [R, H]."""
    return w.shape == x.shape[1:] and (h is None or (
        (h.ndim == 2 or (h.ndim == 3 and h.dtype == _F32)) and h.shape[-1] == x.shape[1]
        and h.shape[-2] >= x.shape[0]))


def _call(x, h, w, eps: float, with_rows: bool, quantize: bool, interpret: bool) -> list:
    if not supported(x) or not _fits(x, h, w) or (quantize and not fp8_supported(x)):
        raise ValueError(f"add_rms_norm: x {x.shape} must be [R, H] with 16 <= H <= {DEFAULT_CONFIG.max_hidden} "
                         f"({'a multiple of 128, ' if quantize else ''}h {None if h is None else h.shape} [R' >= R, "
                         f"H], w {w.shape} [H]")
    (rows, hidden), with_residual = x.shape, h is not None
    row = jax.ShapeDtypeStruct(x.shape, x.dtype)
    inputs = (x, h, w) if with_residual else (x, w)
    outputs = [row] * (with_residual + with_rows)
    if quantize:
        outputs += [jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((hidden // BLOCK, rows), _F32)]
    groups = pl.next_power_of_2(pl.cdiv(hidden, BLOCK))
    return list(pl.pallas_call(
        functools.partial(_kernel, eps=eps, with_residual=with_residual, groups=groups, with_rows=with_rows,
                          quantize=quantize),
        grid=(rows,),
        out_shape=outputs,
        in_specs=[_compat.full_spec()] * len(inputs),
        out_specs=[_compat.full_spec()] * len(outputs),
        compiler_params=_compat.triton_params(DEFAULT_CONFIG.warps(groups * BLOCK), 1),
        interpret=interpret,
        name="add_rms_norm_fp8" if quantize else "add_rms_norm",
    )(*inputs))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, h, w, *, eps: float, interpret: bool = False):
    """(x + h, rms_norm(x + h) * (1 + w)) for x, h [R, H] (h may be None: then x itself and its norm).

    h may have more rows than x; those are not read. h may be a product's K ranges' float32 partial sums [S, R', H]
    (`fp8_gemm.fp8_gemm_rows`' partial_sums), added here as `fp8_matmul.sum_partials` adds them, in place of XLA's
    reduction kernel before this one (any kernel here takes them). A one-row projection computed as a two-row matmul
    (see `qwen3_5.dot`) comes here whole: cutting its duplicate row off first would be a copy kernel, since XLA
    copies a custom call's sliced operand. The sum is rounded to x's dtype before the norm, as the model's residual
    add; the norm is computed in float32 and returned in x's dtype. w: [H] (any float dtype).
    """
    out = _call(x, h, w, eps, True, False, interpret)
    return tuple(out) if h is not None else (x, out[0])


@functools.partial(jax.jit, static_argnames=("eps", "with_rows", "interpret"))
def add_rms_norm_fp8(x, h, w, *, eps: float, with_rows: bool = True, interpret: bool = False):
    """`add_rms_norm` with the norm's rows also quantized per token and 128-group (H a multiple of 128): (x + h, y
    [R, H] or None without with_rows, xq [R, H] float8_e4m3fn, xs [H / 128, R] float32), as `reference` computes
    it."""
    out = _call(x, h, w, eps, with_rows, True, interpret)
    x_new = out.pop(0) if h is not None else x
    y = out.pop(0) if with_rows else None
    return x_new, y, *out


def router_supported(x: jax.Array, router_w: jax.Array) -> bool:
    """Whether `add_rms_norm_router` takes x [R, H] and a router [E, H]: what `add_rms_norm` takes, E a multiple
    of the config's router_block_e."""
    return (supported(x) and router_w.ndim == 2 and router_w.shape[1] == x.shape[1]
            and router_w.shape[0] % DEFAULT_CONFIG.router_block_e == 0)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm_router(x, h, w, router_w, *, eps: float, interpret: bool = False):
    """`add_rms_norm` and the MoE router's logits after it in one kernel: (x + h, y, y @ router_w.T [R, E] float32,
    the bf16 products accumulated in float32 as `reference.moe_router_logits`, in another order). In a one-lane
    round the router's matmul is a launch of about 2.5 us a layer of its own; here E / router_block_e programs a row
    read the router beside the norm (each normalizing the row again: it is 4 KB)."""
    if not router_supported(x, router_w) or not _fits(x, h, w):
        raise ValueError(f"add_rms_norm_router: x {x.shape} must be [R, H] with 16 <= H <= "
                         f"{DEFAULT_CONFIG.max_hidden}, h {None if h is None else h.shape} [R' >= R, H], w {w.shape} "
                         f"[H] and the router {router_w.shape} [E, H] with E a multiple of "
                         f"{DEFAULT_CONFIG.router_block_e}")
    (rows, hidden), with_residual = x.shape, h is not None
    row = jax.ShapeDtypeStruct(x.shape, x.dtype)
    inputs = (x, h, w, router_w) if with_residual else (x, w, router_w)
    outputs = [row] * (1 + with_residual) + [jax.ShapeDtypeStruct((rows, router_w.shape[0]), _F32)]
    groups, block_e = pl.next_power_of_2(pl.cdiv(hidden, BLOCK)), DEFAULT_CONFIG.router_block_e
    out = pl.pallas_call(
        functools.partial(_router_kernel, eps=eps, with_residual=with_residual, groups=groups, block_e=block_e),
        grid=(rows, router_w.shape[0] // block_e),
        out_shape=outputs,
        in_specs=[_compat.full_spec()] * len(inputs),
        out_specs=[_compat.full_spec()] * len(outputs),
        compiler_params=_compat.triton_params(DEFAULT_CONFIG.router_num_warps, 1),
        interpret=interpret,
        name="add_rms_norm_router",
    )(*inputs)
    return tuple(out) if with_residual else (x, *out)


def reference(x, h, w, eps: float):
    """What `add_rms_norm_fp8` computes, composed in jnp: the model's add and norm, then `quantize_rows`."""
    if h is not None and h.ndim == 3:
        h = sum_partials(h, x.dtype)
    x = x if h is None else (x.astype(_F32) + h[: x.shape[0]].astype(_F32)).astype(x.dtype)
    y = rms_norm(x, w, eps)
    return x, y, *quantize_rows(y)
