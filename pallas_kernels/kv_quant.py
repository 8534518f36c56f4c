"""KV storage profiles (spec §3.1): how a full-attention layer's K and V pages hold their values.

A profile names one storage format for K and one for V. A format is either plain (the pool holds the values in
a float dtype, `[P, 64, Hkv, D]`) or quantized, whose pool is a `QuantPages`: two planes of one page geometry,

  values [P, 64, Hkv, D]       int8 (INT8-G64) or float8_e4m3fn (FP8-row256), or
         [P, 64, Hkv, D / 2]   uint8, two e2m1 codes a byte (NVFP4-G16): byte j holds value j in its low
                               nibble and value j + D/2 in its high one, so a reader unpacks a row by a
                               gathered load at column c % (D/2) and a shift, with no interleave
  scales [P, 64, Hkv, D / G]   one scale per group of G values of a token and head: float16 (INT8, FP8),
                               float8_e4m3fn (NVFP4)

G is the format's group, at most the head dim (a head of 128 has one FP8 row scale). A page is its planes in
order (values, then scales; K before V), so the Host tier and the cache file move a page's bytes as they lie.

  profile    K            V            bytes per token and head at D = 256 (spec §3.1)
  bfloat16   bf16         bf16         1024
  int8       INT8-G64     INT8-G64      528
  fp8        FP8-row256   FP8-row256    516
  k8v4       FP8-row256   NVFP4-G16     402
  nvfp4      NVFP4-G16    NVFP4-G16     288
  auto       the activations' dtype

Scales are rounded up in their dtype, so every scaled value lies inside the code's range and nothing clips;
`error_bound` gives each format's bound on |x - dequantize(quantize(x))|. NVFP4 has no second-level scale, so
it holds magnitudes up to 6 x 448 = 2688; larger ones saturate there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

_F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
E2M1_MAX = 6.0
# e2m1 magnitudes by code (sign is bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6; rounding thresholds between them
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantized storage format of a K or V pool."""

    name: str
    group: int  # values per scale (capped at the head dim)
    value_dtype: object
    scale_dtype: object
    qmax: float  # the code's largest magnitude: scale = amax / qmax
    packed: bool = False  # two 4-bit codes a byte

    def group_of(self, head_dim: int) -> int:
        return min(self.group, head_dim)

    def value_cols(self, head_dim: int) -> int:
        return head_dim // 2 if self.packed else head_dim

    def bytes_per_row(self, head_dim: int) -> int:
        """Bytes of one token and head: its values and scales."""
        return (self.value_cols(head_dim) * jnp.dtype(self.value_dtype).itemsize
                + head_dim // self.group_of(head_dim) * jnp.dtype(self.scale_dtype).itemsize)


INT8_G64 = Format("int8_g64", 64, jnp.int8, jnp.float16, 127.0)
FP8_ROW256 = Format("fp8_row256", 256, FP8, jnp.float16, 448.0)
NVFP4_G16 = Format("nvfp4_g16", 16, jnp.uint8, FP8, E2M1_MAX, packed=True)
FORMATS = {f.name: f for f in (INT8_G64, FP8_ROW256, NVFP4_G16)}

# profile -> (K format, V format); None: plain, in the profile's dtype
PROFILES: dict[str, tuple[Format | None, Format | None]] = {
    "auto": (None, None),
    "bfloat16": (None, None),
    "int8": (INT8_G64, INT8_G64),
    "fp8": (FP8_ROW256, FP8_ROW256),
    "k8v4": (FP8_ROW256, NVFP4_G16),
    "nvfp4": (NVFP4_G16, NVFP4_G16),
}


def plain_dtype(profile: str, act_dtype):
    """The dtype of a plain profile's pools ("auto": the activations')."""
    return jnp.bfloat16 if profile == "bfloat16" else act_dtype


def check_profile(profile: str, head_dim: int) -> None:
    """Raises ValueError naming kv_dtype when `profile` is unknown or does not fit the head dim."""
    if profile not in PROFILES:
        raise ValueError(f"kv_dtype must be one of {', '.join(PROFILES)}, got {profile!r}")
    if any(PROFILES[profile]) and head_dim % 32:  # whole groups, and whole bytes of the NVFP4 halves' scales
        raise ValueError(f"kv_dtype {profile!r} needs a head dim that is a multiple of 32, got {head_dim}")


def bytes_per_token_head(profile: str, head_dim: int, act_dtype=jnp.bfloat16) -> int:
    """Bytes one token of one KV head takes in a profile's pools: K and V, values and scales."""
    return sum(jnp.dtype(plain_dtype(profile, act_dtype)).itemsize * head_dim if f is None
               else f.bytes_per_row(head_dim) for f in PROFILES[profile])


@struct.dataclass
class QuantPages:
    """A quantized pool: the planes `values` and `scales` (module docstring) and its format's name (static)."""

    values: jax.Array
    scales: jax.Array
    fmt: str = struct.field(pytree_node=False)

    @property
    def format(self) -> Format:
        return FORMATS[self.fmt]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical pool shape [P, 64, Hkv, D]."""
        *lead, cols = self.values.shape
        return (*lead, 2 * cols if self.format.packed else cols)


def empty_pool(fmt: Format | None, shape: tuple[int, ...], dtype) -> jax.Array | QuantPages:
    """A zero-filled pool of logical shape [P, 64, Hkv, D]: plain of `dtype` when fmt is None."""
    if fmt is None:
        return jnp.zeros(shape, dtype)
    d = shape[-1]
    return QuantPages(jnp.zeros((*shape[:-1], fmt.value_cols(d)), fmt.value_dtype),
                      jnp.zeros((*shape[:-1], d // fmt.group_of(d)), fmt.scale_dtype), fmt.name)


def format_of(pool) -> Format | None:
    """A pool's format (None: plain)."""
    return pool.format if isinstance(pool, QuantPages) else None


# --- codec ----------------------------------------------------------------------------------------


def scale_for(fmt: Format, amax):
    """The stored scale of groups whose largest magnitude is amax (f32): amax / qmax rounded up in the scale dtype.

    Rounded up by arithmetic the kernels lower too (no bitcast, no nextafter): the nearest value to
    max(s (1 + 2^-m), s + the dtype's smallest subnormal) is at least s, m the dtype's mantissa bits; it may be
    one value above the least such. Saturates at the dtype's largest finite value."""
    info = jnp.finfo(fmt.scale_dtype)
    s = amax / fmt.qmax
    z = jnp.maximum(s * (1.0 + 2.0 ** -info.nmant), s + float(info.smallest_subnormal))
    return jnp.minimum(z, float(info.max)).astype(fmt.scale_dtype)


def encode(fmt: Format, y):
    """Scaled values y (f32, |y| <= qmax) -> their codes: int8 (round half up), float8_e4m3fn, or e2m1 codes
    (uint8 0..15; `quantize` packs them two a byte)."""
    if fmt is INT8_G64:
        return jnp.clip(jnp.floor(y + 0.5), -127.0, 127.0).astype(jnp.int8)
    if fmt is FP8_ROW256:
        return jnp.clip(y, -448.0, 448.0).astype(FP8)
    return _e2m1_encode(jnp.clip(y, -E2M1_MAX, E2M1_MAX))


def divide(x, s):
    """x / s (f32), 0 where the scale is 0."""
    return jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), 0.0)


def _e2m1_encode(y):
    """y in [-6, 6] -> e2m1 codes (uint8 0..15): round to the nearest magnitude, sign in bit 3."""
    a = jnp.abs(y)
    code = sum((a > b).astype(jnp.uint8) for b in _E2M1_BOUNDS)
    return code + jnp.where(y < 0, jnp.uint8(8), jnp.uint8(0))


def e2m1_decode(code):
    """e2m1 codes (any int type, 0..15) -> float32: 2-bit exponent e, 1-bit mantissa m; e = 0 is m/2."""
    code = code.astype(jnp.int32)
    e, m = (code >> 1) & 3, (code & 1).astype(_F32)
    pow2 = jnp.left_shift(1, jnp.maximum(e - 1, 0)).astype(_F32)
    mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where(code >= 8, -mag, mag)


def quantize(fmt: Format, x):
    """x [..., D] (any float) -> (values, scales) planes of `fmt` for these rows."""
    d = x.shape[-1]
    g = fmt.group_of(d)
    xg = x.astype(_F32).reshape(*x.shape[:-1], d // g, g)
    scale = scale_for(fmt, jnp.max(jnp.abs(xg), axis=-1))
    values = encode(fmt, divide(xg, scale.astype(_F32)[..., None]).reshape(x.shape))
    if fmt.packed:
        values = values[..., : d // 2] | (values[..., d // 2:] << 4)
    return values, scale


def decode(fmt: Format, raw, scales, cols, d: int):
    """Values of columns `cols` (int, broadcasting against raw) -> float32, from raw values already read at
    `value_col(fmt, cols, d)` and scales read at `cols // group`: the one dequantization the kernels and the
    references share."""
    if fmt.packed:
        raw = (raw.astype(jnp.int32) >> jnp.where(cols >= d // 2, 4, 0)) & 15
    return code_values(fmt, raw) * scales.astype(_F32)


def e2m1_bf16(codes):
    """e2m1 codes (uint8 0..15) -> their values in bfloat16, exact, by integer ops on the bits (no conversion
    instruction): magnitude codes 2..7 are bf16 exponent 126 + code // 2 with the code's low bit as the top mantissa
    bit, code 1 is 0.5 (0x3F00), the sign is bit 3."""
    c = codes.astype(jnp.uint16)
    mag = c & 7
    bits = jnp.where(mag >= 2, (mag << 6) + 0x3F00, (mag & 1) * 0x3F00) | ((c & 8) << 12)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def code_values(fmt: Format, codes):
    """Codes (int8, float8_e4m3fn, or e2m1 codes 0..15 already unpacked) -> their unscaled values, float32."""
    return e2m1_decode(codes) if fmt.packed else codes.astype(_F32)


def value_col(fmt: Format, cols, d: int):
    """The values plane's column holding column `cols` of a row."""
    return cols % (d // 2) if fmt.packed else cols


def dequantize(fmt: Format, values, scales, d: int, dtype=_F32):
    """(values, scales) planes of rows [..., *] -> the rows [..., D] in `dtype`."""
    cols = jnp.arange(d, dtype=jnp.int32)
    raw = jnp.take(values, value_col(fmt, cols, d), axis=-1)
    s = jnp.take(scales, cols // fmt.group_of(d), axis=-1)
    return decode(fmt, raw, s, cols, d).astype(dtype)


def error_bound(fmt: Format, x, scales_of_x):
    """The format's bound on |x - dequantize(quantize(x))| elementwise, given the stored scale of each element.

    INT8: round to nearest integer, |err| <= s/2. FP8 e4m3 (3 mantissa bits): |err| <= 2^-4 |x| for normals,
    2^-10 s for subnormals (|x/s| < 2^-6). e2m1 on |x/s| <= 6: half the gap of the magnitudes around it,
    <= s max(1/4, |x/s| / 4). Plus the float32 arithmetic's rounding."""
    s = scales_of_x.astype(_F32)
    a = jnp.abs(x.astype(_F32))
    if fmt is INT8_G64:
        bound = 0.5 * s
    elif fmt is FP8_ROW256:
        bound = jnp.maximum(2.0**-4 * a, 2.0**-10 * s)
    else:
        bound = s * jnp.maximum(0.25, a / jnp.where(s > 0, s, 1.0) / 4)
    return bound * (1 + 2.0**-20) + 1e-30


# --- pools ----------------------------------------------------------------------------------------


def write(pool, rows, page_ids, offsets):
    """Scatter rows [N, Hkv, D] into the pool at (page_ids, offsets), quantizing for a quantized pool;
    out-of-range page ids are dropped."""
    if not isinstance(pool, QuantPages):
        return pool.at[page_ids, offsets].set(rows.astype(pool.dtype), mode="drop")
    values, scales = quantize(pool.format, rows)
    return QuantPages(pool.values.at[page_ids, offsets].set(values, mode="drop"),
                      pool.scales.at[page_ids, offsets].set(scales, mode="drop"), pool.fmt)


def take(pool, index, dtype=None):
    """pool[index] (an index into its leading axes: pages, or (pages, rows)) as values [..., D], dequantized to
    `dtype` (float32 if None) for a quantized pool: only the rows read are converted, never the pool."""
    if not isinstance(pool, QuantPages):
        return pool[index]
    return dequantize(pool.format, pool.values[index], pool.scales[index], pool.shape[-1], dtype or _F32)


def planes(pool) -> list[jax.Array]:
    """The pool's planes in page order (values, then scales)."""
    return [pool.values, pool.scales] if isinstance(pool, QuantPages) else [pool]


def with_planes(pool, new_planes):
    """A pool like `pool` holding `new_planes` (as `planes` lists them)."""
    return QuantPages(*new_planes, pool.fmt) if isinstance(pool, QuantPages) else new_planes[0]
