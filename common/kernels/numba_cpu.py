"""The CPU backend's compiled loops (numba): RMSNorm and RoPE in float32 and bfloat16, and the
helpers they share. Their public functions, which check every argument before a loop sees an
address, are common/kernels/rmsnorm_numba.py and rope_numba.py.

Every compiled loop and every helper it inlines live in this one file on purpose: numba's
on-disk cache stamps a kernel by its own source file only, so a helper imported from another
file could change while the cached kernel kept its old copy.

numba has no bfloat16, so a bfloat16 tensor reaches a kernel as its uint16 bits, and a kernel
widens each row into a float32 scratch row and rounds results back through the
bits of that row, the way torch converts: widening is exact (the 16 bits are a float32's top
half), narrowing rounds to nearest, ties to even (overflow to inf, -0.0 kept), and a NaN stays a
NaN (its sign and payload bits may differ from torch's).

A tensor reaches a kernel as its address (`address`) and the kernel sees it as an array again
(`u16_at`, `f32_at`): a numpy view per argument (`Tensor.view(...).numpy()` and numba's typing
of it) cost ~2.5 us each, which at decode's batch sizes was more than the loop itself. The
caller keeps the tensor alive for the call and states its shape; the kernels read and write
only within it.

Kernels are compiled on first use and cached (`kernel`): beside this file, else in numba's
per-user cache or NUMBA_CACHE_DIR; where none of them can be written (a read-only image without
a writable home), each process compiles them again instead (a second or two, in the services'
warm-up). No RMSNorm or RoPE loop runs under fastmath: reordering a sum is allowed there only
inside `_sum_squares` (not inlined, so its flags stay its own), so every other operation rounds
as torch's does. Decode attention, which no torch kernel matches bit for bit either (its
reference is held to a tolerance), may reorder and fuse its float32 sums ("reassoc",
"contract": nothing about NaN or inf is assumed).

Invariants: the helpers read and write only the rows they are given; `round_row` leaves the
rounded values in the scratch row as float32 (so a kernel can go on computing in the precision
torch would see after its own rounding) and returns nothing.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.core import cgutils, types
from numba.extending import intrinsic

_SHIFT = np.uint32(16)
_HALF_ULP = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QUIET = np.uint32(0x00400000)
_LOW = np.uint32(0xFFFF0000)


def kernel(**options):
    """numba.njit releasing the GIL (the services' event loop runs beside the engine thread, as
    it does beside torch's ops), with on-disk caching where a cache location exists, else
    without: a read-only install must still run (numba refuses `cache=True` there at decoration
    time)."""
    options.setdefault("nogil", True)

    def compile_it(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            if "no locator available" not in str(exc):
                raise
            return numba.njit(cache=False, **options)(fn)
    return compile_it


def address(t: torch.Tensor) -> int:
    """A CPU tensor -> the address of its first element, for a kernel (the caller has checked
    its device, dtype, shape and strides)."""
    return t.data_ptr()


@intrinsic
def _pointer(typingctx, addr):
    """An integer address -> a void pointer numba.carray accepts."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(addr), codegen


@numba.njit(inline="always")
def u16_at(addr, shape):
    """The uint16 array (bfloat16 bits) of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.uint16)


@numba.njit(inline="always")
def f32_at(addr, shape):
    """The float32 array of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.float32)


@numba.njit(inline="always")
def i64_at(addr, shape):
    """The int64 array of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.int64)


@numba.njit(inline="always")
def i32_at(addr, shape):
    """The int32 array of `shape` (a tuple) at addr, C order."""
    return numba.carray(_pointer(addr), shape, np.int32)


@numba.njit(inline="always")
def _nearest_even(u):
    """float32 bits -> the bits of the nearest bfloat16 (in the top half, low half zero)."""
    if (u & _ABS) > _INF:  # NaN: quiet, as torch rounds it
        return (u | _QUIET) & _LOW
    return (u + _HALF_ULP + ((u >> _SHIFT) & _ONE)) & _LOW


@numba.njit(inline="always")
def widen_row(src, scratch_bits):
    """src: [H] uint16 bfloat16 bits -> scratch_bits: [H] uint32, the float32 bits."""
    for i in range(src.shape[0]):
        scratch_bits[i] = np.uint32(src[i]) << _SHIFT


@numba.njit(inline="always")
def round_row(scratch_bits):
    """scratch_bits: [H] uint32 float32 bits, rounded to bfloat16 precision in place."""
    for i in range(scratch_bits.shape[0]):
        scratch_bits[i] = _nearest_even(scratch_bits[i])


@numba.njit(inline="always")
def narrow_row(scratch_bits, dst):
    """scratch_bits: [H] uint32 float32 bits -> dst: [H] uint16, rounded to bfloat16."""
    for i in range(dst.shape[0]):
        dst[i] = np.uint16(_nearest_even(scratch_bits[i]) >> _SHIFT)


@numba.njit(fastmath={"reassoc"})
def _sum_squares(row):
    """row: [H] float32 -> the sum of its squares, in any order (vectorised). Not inlined: the
    reordering stays inside this function."""
    total = np.float32(0.0)
    for i in range(row.shape[0]):
        total += row[i] * row[i]
    return total


# ---- RMSNorm (common/kernels/rmsnorm_numba.py) ----
@kernel()
def rmsnorm_bf16(x_at, residual_at, weight_at, out_at, summed_at, num_rows, width, eps):
    """x, residual, out, summed: [T, H]; weight: [H]; bfloat16 bits; residual_at 0: none."""
    x = u16_at(x_at, (num_rows, width))
    out = u16_at(out_at, (num_rows, width))
    weight = u16_at(weight_at, (width,))
    residual = u16_at(residual_at if residual_at != 0 else x_at, (num_rows, width))
    summed = u16_at(summed_at if summed_at != 0 else out_at, (num_rows, width))
    row = np.empty(width, np.uint32)
    row_f = row.view(np.float32)
    other = np.empty(width, np.uint32)
    other_f = other.view(np.float32)
    w = np.empty(width, np.uint32)
    widen_row(weight, w)
    w_f = w.view(np.float32)
    for t in range(num_rows):
        widen_row(x[t], row)
        if residual_at != 0:
            widen_row(residual[t], other)
            for i in range(width):
                row_f[i] = row_f[i] + other_f[i]
            round_row(row)
            narrow_row(row, summed[t])
        inv = np.float32(1.0) / np.sqrt(_sum_squares(row_f) / np.float32(width)
                                        + np.float32(eps))
        for i in range(width):
            row_f[i] = row_f[i] * inv
        round_row(row)
        for i in range(width):
            row_f[i] = w_f[i] * row_f[i]
        narrow_row(row, out[t])


@kernel()
def rmsnorm_f32(x_at, residual_at, weight_at, out_at, summed_at, num_rows, width, eps):
    """As rmsnorm_bf16, every tensor float32."""
    x = f32_at(x_at, (num_rows, width))
    out = f32_at(out_at, (num_rows, width))
    weight = f32_at(weight_at, (width,))
    residual = f32_at(residual_at if residual_at != 0 else x_at, (num_rows, width))
    summed = f32_at(summed_at if summed_at != 0 else out_at, (num_rows, width))
    for t in range(num_rows):
        src = x[t]
        if residual_at != 0:
            for i in range(width):
                summed[t, i] = x[t, i] + residual[t, i]
            src = summed[t]
        inv = np.float32(1.0) / np.sqrt(_sum_squares(src) / np.float32(width)
                                        + np.float32(eps))
        for i in range(width):
            out[t, i] = weight[i] * (src[i] * inv)


# ---- RoPE (common/kernels/rope_numba.py) ----
@numba.njit(inline="always")
def _rotate_f32(row, cos, sin, half):
    for i in range(half):
        x1 = row[i]
        x2 = row[i + half]
        row[i] = x1 * cos[i] - x2 * sin[i]
        row[i + half] = x2 * cos[i] + x1 * sin[i]


@kernel()
def rope_bf16(q_at, k_at, positions_at, cos_sin_at, num_tokens, q_layout, k_layout,
              num_positions, head_dim):
    """q: [T, Hq, D], k: [T, Hkv, D] bfloat16 bits with layouts (heads, token stride, head
    stride) in elements, D contiguous; positions: [T] int64; cos_sin: [P, D] float32. In
    place; False, with nothing written, when a position is outside [0, P)."""
    half = head_dim // 2
    positions = i64_at(positions_at, (num_tokens,))
    cos_sin = f32_at(cos_sin_at, (num_positions, head_dim))
    for t in range(num_tokens):
        if positions[t] < 0 or positions[t] >= num_positions:
            return False
    row = np.empty(head_dim, np.uint32)
    row_f = row.view(np.float32)
    for x_at, (heads, token_stride, head_stride) in ((q_at, q_layout), (k_at, k_layout)):
        x = u16_at(x_at, ((num_tokens - 1) * token_stride + (heads - 1) * head_stride
                          + head_dim,))
        for t in range(num_tokens):
            cos = cos_sin[positions[t], :half]
            sin = cos_sin[positions[t], half:]
            for h in range(heads):
                at = t * token_stride + h * head_stride
                widen_row(x[at:at + head_dim], row)
                _rotate_f32(row_f, cos, sin, half)
                narrow_row(row, x[at:at + head_dim])
    return True


@kernel()
def rope_f32(q_at, k_at, positions_at, cos_sin_at, num_tokens, q_layout, k_layout,
             num_positions, head_dim):
    """As rope_bf16, q and k float32."""
    half = head_dim // 2
    positions = i64_at(positions_at, (num_tokens,))
    cos_sin = f32_at(cos_sin_at, (num_positions, head_dim))
    for t in range(num_tokens):
        if positions[t] < 0 or positions[t] >= num_positions:
            return False
    for x_at, (heads, token_stride, head_stride) in ((q_at, q_layout), (k_at, k_layout)):
        x = f32_at(x_at, ((num_tokens - 1) * token_stride + (heads - 1) * head_stride
                          + head_dim,))
        for t in range(num_tokens):
            cos = cos_sin[positions[t], :half]
            sin = cos_sin[positions[t], half:]
            for h in range(heads):
                at = t * token_stride + h * head_stride
                _rotate_f32(x[at:at + head_dim], cos, sin, half)
    return True


# ---- paged decode attention (common/kernels/decode_attention_numba.py) ----
@kernel(fastmath={"reassoc", "contract"})
def decode_attention_f32(q_at, q_extent, q_strides, k_at, v_at, num_pages, table_at,
                         table_width, lens_at, out_at, batch, num_q_heads, num_kv_heads,
                         head_dim, page_size, scale):
    """q: float32 elements [0, q_extent) at q_at, row (b, head) at b * q_strides[0] + head *
    q_strides[1], D contiguous; caches: [num_pages, S, Hkv, D] float32 contiguous; table:
    [B, table_width] int32; lens: [B] int32; out: [B, Hq, D] float32 contiguous. Returns 0;
    with nothing written, 1 when a length is < 1 or needs more than table_width pages, 2 when
    a page entry in use is outside [0, num_pages): nothing past a sequence's first lens[b]
    slots, and no entry past its pages, is read.

    Each sequence's slots are listed once, in token order, and walked with every head of a
    slot at once (a slot's K or V is one contiguous run of Hkv * D values), once for the
    scores and once for the values; walking them head by head instead measured 2.9x slower
    at 1088 tokens."""
    table = i32_at(table_at, (batch, table_width))
    lens = i32_at(lens_at, (batch,))
    longest = 1
    for b in range(batch):
        n = lens[b]
        if n < 1 or (n + page_size - 1) // page_size > table_width:
            return 1
        for p in range((n + page_size - 1) // page_size):
            if table[b, p] < 0 or table[b, p] >= num_pages:
                return 2
        longest = max(longest, n)
    q = f32_at(q_at, (q_extent,))
    keys = f32_at(k_at, (num_pages * page_size, num_kv_heads, head_dim))
    values = f32_at(v_at, (num_pages * page_size, num_kv_heads, head_dim))
    out = f32_at(out_at, (batch, num_q_heads, head_dim))
    group = num_q_heads // num_kv_heads
    queries = np.empty((num_q_heads, head_dim), np.float32)
    scores = np.empty((num_q_heads, longest), np.float32)  # scores, then the probabilities
    slots = np.empty(longest, np.int64)  # the sequence's slots in token order, for both walks
    for b in range(batch):
        n = lens[b]
        for head in range(num_q_heads):
            at = b * q_strides[0] + head * q_strides[1]
            queries[head] = q[at:at + head_dim]
        for t in range(n):  # token t of the sequence sits at slot pages[t // S] * S + t % S
            slots[t] = table[b, t // page_size] * page_size + t % page_size
        for t in range(n):
            slot = slots[t]
            for h in range(num_kv_heads):
                for head in range(h * group, (h + 1) * group):
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += queries[head, d] * keys[slot, h, d]
                    scores[head, t] = dot * np.float32(scale)
        for head in range(num_q_heads):
            top = scores[head, 0]
            for i in range(1, n):
                top = max(top, scores[head, i])
            total = np.float32(0.0)
            for i in range(n):
                scores[head, i] = np.exp(scores[head, i] - top)
                total += scores[head, i]
            inv = np.float32(1.0) / total
            for i in range(n):
                scores[head, i] = scores[head, i] * inv
        acc = out[b]
        acc[:] = 0.0
        for t in range(n):
            slot = slots[t]
            for h in range(num_kv_heads):
                for head in range(h * group, (h + 1) * group):
                    weight = scores[head, t]
                    for d in range(head_dim):
                        acc[head, d] += weight * values[slot, h, d]
    return 0
