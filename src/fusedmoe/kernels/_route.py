"""Triton kernel of the fused router (see ``route.py`` for the contract and the launch).

One program routes ROWS tokens. A row's E logits sit in a [GP, SP] tile, expert
``g * S + s`` at (g, s): the E / G = S experts of a group along SP, the G groups
along GP (ungrouped routing is G = 1, S = E), both padded to powers of 2 with
-inf. So a group's score is a reduction over the last axis and needs no gather.

Per row, all in float32 registers, one pass over the logits in HBM:

    score  = softmax | sigmoid (logits)
    choice = score + bias
    grouped: group score = max, or the sum of the 2 largest (with a bias), of its
             choices; TG times take the best group (lowest g among equals); the
             choices of the other groups become -inf
    K times: take the largest choice (lowest id among equals), record its id and
             its unbiased score, take it out
    weights: / their sum (clamped to float32 tiny), * scaling

A selection round is one max reduction over int64 keys (``_keys``): the value's float
order in the high 32 bits, E_MAX - id in the low ones, so the maximum names the largest
value and, among equal values, the lowest id. Three dependent reductions a round (the
max, the lowest column holding it, the sum picking its score) made the launch 3.6 us at
Qwen3-30B-A3B T = 1 on an H200 (top-8 of 128), 4.9 us at DeepSeek-V3; the keys 2.9 and
3.3 us (``results/layer_h200_route_keys_2026-11-29.md``). Without a bias the weight
is the chosen value itself, read back from the key; with one, the K unbiased scores are
recomputed after the rounds from the K logits read again (the same fp32 operations on
the same values: the same bits). Taken and padding columns hold ``_NO_KEY``, below every
value's key, so ids are always distinct and in [0, E) whatever the logits hold (a NaN
sorts above +inf, or below -inf with its sign bit set).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._act_quant import act_quant_tile
from ._common import pdl_wait

# larger than any column index (E <= 1024) or group index: a key's low half is _NONE - index
_NONE: tl.constexpr = tl.constexpr(1 << 30)
_NO_KEY: tl.constexpr = tl.constexpr(-(1 << 63))  # below every key ``_keys`` makes (their low half is > 0)
_F32_TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(float32).tiny = 2^-126


@triton.jit
def _max3(x):
    """[R, GP, SP] -> [R] maximum."""
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _keys(v, idx, ok):
    """int64 selection keys of fp32 values ``v`` at indices ``idx`` (module docstring), ``_NO_KEY``
    where not ``ok``. A float's bits read as a signed int order non-negative floats; a negative
    float's magnitude bits are flipped so that they order too. -0 counts as +0 (they are equal
    floats, so the lower index must win between them)."""
    b = v.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)  # -0.0
    b = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    key = (b.to(tl.int64) << 32) | (-idx + _NONE).to(tl.int64)  # tensor first: constexpr - tensor fails interpreted
    return tl.where(ok, key, _NO_KEY)


@triton.jit
def _key_index(key):
    return -(key & 0x7FFFFFFF).to(tl.int32) + _NONE  # the low half is < 2^31


@triton.jit
def _key_value(key):
    """The fp32 value a key was made from (``_keys``; -0 comes back as +0)."""
    b = (key >> 32).to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, G, S, K, TG, stride_t, stride_e, scaling,
    SCORING: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
    GROUP_TOP2: tl.constexpr, ROWS: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    """Program p routes rows p * ROWS + [0, ROWS) (``_route_rows``)."""
    pdl_wait(PDL)
    _route_rows(
        tl.program_id(0), logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, G, S, K, TG, stride_t, stride_e, scaling,
        SCORING, RENORMALIZE, HAS_BIAS, GROUPED, GROUP_TOP2, ROWS, GP, SP, KP,
    )  # fmt: skip


@triton.jit
def _route_quant_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, G, S, K, TG, stride_t, stride_e, scaling,
    n_route,  # the routing programs, first; the others quantize x
    q_cols,  # x's quantization grid is (programs / q_cols, q_cols)
    x_ptr, q_ptr, s_ptr, gs_ptr, amax_ptr, rmask_ptr, M, I, stride_xm, stride_qm, stride_sm, n_amax, alpha, limit,
    SCORING: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
    GROUP_TOP2: tl.constexpr, ROWS: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, QUANT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr,
    ROW_MASK: tl.constexpr, PASS: tl.constexpr, EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """The routing launch with x's quantization beside it: programs [0, n_route) route
    (``_route_rows``), the rest are the programs of x's one-pass ``_act_quant_kernel`` launch
    (``act_quant_tile``; ``route.route_launch(quantize=...)``). The two need nothing of each other:
    the launch lasts as long as its slower program, and the launch that made x's codes between the
    routing and GEMM1 is gone (H200, T = 1, Qwen3-30B-A3B fp8 per tensor 31.9 -> 30.2 us)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if pid < n_route:
        _route_rows(
            pid, logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, G, S, K, TG, stride_t, stride_e, scaling,
            SCORING, RENORMALIZE, HAS_BIAS, GROUPED, GROUP_TOP2, ROWS, GP, SP, KP,
        )  # fmt: skip
    else:
        q = pid - n_route
        act_quant_tile(
            q // q_cols, q % q_cols, x_ptr, q_ptr, s_ptr, gs_ptr, amax_ptr, rmask_ptr, M, I, stride_xm, stride_qm,
            stride_sm, n_amax, alpha, limit, ACT, INTERLEAVED, QUANT, SCALE, GROUP, ROW_MASK, PASS, EXACT_CAST,
            BLOCK_M, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _route_rows(
    pid,  # routes rows pid * ROWS + [0, ROWS)
    logits_ptr,  # [T, E] float (fp32/fp16/bf16), strides stride_t, stride_e
    bias_ptr,  # float [E] (fp32/fp16/bf16); any pointer when not HAS_BIAS
    ids_ptr,  # int32 [T, K] out, contiguous
    weights_ptr,  # float32 [T, K] out, contiguous
    T,
    E,
    G,  # groups (1 when not GROUPED)
    S,  # experts per group, E // G
    K,
    TG,  # groups kept (unused when not GROUPED)
    stride_t,
    stride_e,
    scaling,  # routed_scaling_factor (float32)
    SCORING: tl.constexpr,  # "softmax" | "sigmoid"
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    GROUP_TOP2: tl.constexpr,  # group score = sum of the 2 largest choices (else the largest)
    ROWS: tl.constexpr,
    GP: tl.constexpr,  # next power of 2 >= G
    SP: tl.constexpr,  # next power of 2 >= S
    KP: tl.constexpr,  # next power of 2 >= K
):
    # 103 lines: one routing program: each scoring and grouped top-k variant is a constexpr branch over the same row
    # in registers.
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    g = tl.arange(0, GP)
    s = tl.arange(0, SP)
    col = g[:, None] * S + s[None, :]  # [GP, SP] expert id
    valid = (g[:, None] < G) & (s[None, :] < S)
    col3 = tl.broadcast_to(col[None, :, :], (ROWS, GP, SP))
    valid3 = tl.broadcast_to(valid[None, :, :], (ROWS, GP, SP))

    # rows past T load zeros (not -inf), so nothing below computes inf - inf on them
    offs = rows.to(tl.int64)[:, None, None] * stride_t + col3.to(tl.int64) * stride_e
    x = tl.load(logits_ptr + offs, mask=valid3 & row_ok[:, None, None], other=0.0).to(tl.float32)
    x = tl.where(valid3, x, float("-inf"))

    if SCORING == "softmax":
        m = _max3(x)
        p = tl.where(valid3, tl.exp(x - m[:, None, None]), 0.0)
        den = tl.sum(tl.sum(p, axis=2), axis=1)
        # IEEE division as torch's (Triton's default fp32 '/' is the 2-ulp approximation)
        score = tl.math.div_rn(p, tl.broadcast_to(den[:, None, None], (ROWS, GP, SP)))
    else:
        score = tl.sigmoid(x)
    choice = score
    if HAS_BIAS:
        b = tl.load(bias_ptr + col, mask=valid, other=0.0).to(tl.float32)
        choice = score + b[None, :, :]
    choice = tl.where(valid3, choice, float("-inf"))

    if GROUPED:
        g2 = tl.broadcast_to(g[None, :], (ROWS, GP))
        top1 = tl.max(choice, axis=2)  # [R, GP]
        if GROUP_TOP2:
            # DeepSeek-V3: the sum of the group's two largest choices. Remove one copy of the
            # maximum (its lowest position) and take the maximum of the rest, so a maximum
            # reached twice counts twice, as in the reference's sort.
            s3 = tl.broadcast_to(s[None, None, :], (ROWS, GP, SP))
            first = tl.min(tl.where(valid3 & (choice == top1[:, :, None]), s3, _NONE), axis=2)
            top2 = tl.max(tl.where(valid3 & (s3 != first[:, :, None]), choice, float("-inf")), axis=2)
            group_score = top1 + top2
        else:
            group_score = top1
        gkey = _keys(group_score, g2, g2 < G)
        kept = g2 < 0  # all False, [R, GP]
        for _ in range(TG):
            hit = g2 == _key_index(tl.max(gkey, axis=1))[:, None]
            kept = kept | hit
            gkey = tl.where(hit, _NO_KEY, gkey)
        choice = tl.where(kept[:, :, None], choice, float("-inf"))

    kk = tl.arange(0, KP)
    ids = tl.zeros([ROWS, KP], dtype=tl.int32)
    w = tl.zeros([ROWS, KP], dtype=tl.float32)
    # padding positions (g, s >= S) carry the id of group g + 1's expert s - S: _NO_KEY keeps them out
    key = _keys(choice, col3, valid3)
    for k in range(K):
        best = _max3(key)
        idx = _key_index(best)
        key = tl.where(col3 == idx[:, None, None], _NO_KEY, key)
        ids = tl.where(kk[None, :] == k, idx[:, None], ids)
        if not HAS_BIAS:  # the choice is the unbiased score
            w = tl.where(kk[None, :] == k, _key_value(best)[:, None], w)
    if HAS_BIAS:
        # the chosen experts' unbiased scores, from their logits as above (same operations, same bits)
        chosen = row_ok[:, None] & (kk[None, :] < K)
        xk = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + ids.to(tl.int64) * stride_e,
                     mask=chosen, other=0.0).to(tl.float32)  # fmt: skip
        if SCORING == "softmax":
            pk = tl.exp(xk - m[:, None])
            w = tl.math.div_rn(pk, tl.broadcast_to(den[:, None], (ROWS, KP)))
        else:
            w = tl.sigmoid(xk)
        w = tl.where(chosen, w, 0.0)

    if RENORMALIZE:
        tot = tl.sum(w, axis=1)  # padding columns of w are 0
        # a select, not tl.maximum: the GPU's max would turn a NaN sum into tiny
        tot = tl.where(tot < _F32_TINY, _F32_TINY, tot)
        w = tl.math.div_rn(w, tl.broadcast_to(tot[:, None], (ROWS, KP)))
    w = w * scaling

    out = rows[:, None] * K + kk[None, :]
    mask = row_ok[:, None] & (kk[None, :] < K)
    tl.store(ids_ptr + out, ids, mask=mask)
    tl.store(weights_ptr + out, w, mask=mask)
