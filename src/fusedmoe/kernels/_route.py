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

Every selection step picks among columns still *available* (valid and not taken),
and falls back to the lowest available column when no value equals the maximum
(NaN), so ids are always distinct and in [0, E) whatever the logits hold.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import pdl_wait

# larger than any column index (E <= 1024) or group index: "none found" in min-reductions
_NONE: tl.constexpr = tl.constexpr(1 << 30)
_F32_TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(float32).tiny = 2^-126


@triton.jit
def _max3(x):
    """[R, GP, SP] -> [R] maximum."""
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _min3(x):
    return tl.min(tl.min(x, axis=2), axis=1)


@triton.jit
def _route_kernel(
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
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    # 105 lines: one Triton kernel: each scoring and grouped top-k variant is a constexpr branch over the same row in
    # registers.
    pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
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
        g_avail = g2 < G
        kept = g2 < 0  # all False, [R, GP]
        for _ in range(TG):
            cand = tl.where(g_avail, group_score, float("-inf"))
            best = tl.max(cand, axis=1)
            gi = tl.min(tl.where(g_avail & (cand == best[:, None]), g2, _NONE), axis=1)
            gi = tl.where(gi == _NONE, tl.min(tl.where(g_avail, g2, _NONE), axis=1), gi)
            hit = g2 == gi[:, None]
            kept = kept | hit
            g_avail = g_avail & ~hit
        choice = tl.where(kept[:, :, None], choice, float("-inf"))

    kk = tl.arange(0, KP)
    ids = tl.zeros([ROWS, KP], dtype=tl.int32)
    w = tl.zeros([ROWS, KP], dtype=tl.float32)
    avail = valid3
    for k in range(K):
        cand = tl.where(avail, choice, float("-inf"))
        best = _max3(cand)
        idx = _min3(tl.where(avail & (cand == best[:, None, None]), col3, _NONE))
        # NaN: nothing equals the maximum; take the lowest available column, so ids stay valid
        idx = tl.where(idx == _NONE, _min3(tl.where(avail, col3, _NONE)), idx)
        # valid3: a padding position (g, s >= S) has the id of group g + 1's expert s - S
        hit = (col3 == idx[:, None, None]) & valid3
        wk = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=2), axis=1)  # the unbiased score
        avail = avail & ~hit
        ids = tl.where(kk[None, :] == k, idx[:, None], ids)
        w = tl.where(kk[None, :] == k, wk[:, None], w)

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
