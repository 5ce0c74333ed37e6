"""Fused routing: router logits [T, E] -> ``TopK`` in one kernel launch.

    _route_kernel          one program per ROWS tokens (``_route.py``)
      <- route_launch      allocate (or take ``out``), pick the tile, launch
      <- fusedmoe::route   torch.library op with a fake, for torch.compile / CUDA graphs
      <- fused_route       public: the launcher in eager mode, the op while compiling
    reference: ``RouterConfig.route(..., fused=False)`` (``fusedmoe.routing``)

Same results as the reference (``fusedmoe.routing``'s docstring): ids ordered by
decreasing choice, the lower id first among equal choices (groups too), weights the
unbiased scores of the chosen ids, renormalized with the sum clamped to float32 tiny,
then scaled. Ids are equal to the reference's wherever no two choices lie within a few
float32 ulps of each other (softmax and sigmoid may round differently from PyTorch's by
an ulp or two); weights agree to a few ulps. NaN logits give unspecified choices, but
the ids of a row are always distinct and in [0, E).

The PyTorch reference is 6-25 small kernels (softmax, bias add, the grouped top-k's
sorts, gather, sum, divide, scale); at decode on an H100 each costs 2-4 us even inside
a CUDA graph, against one launch here. Nothing synchronises with the host.

Limits: E <= ``MAX_EXPERTS`` (1024; a row's tile then holds at most 4096 float32 values,
the worst padding of G and E / G to powers of 2), any K <= E, any number of groups.
"""

import torch

from ..errors import expect
from ..metadata import TopK
from ._common import cdiv, interpreting, next_power_of_2
from ._route import _route_kernel, _route_quant_kernel
from .act_quant import ActQuantLaunch
from .launch import launch

__all__ = ["MAX_EXPERTS", "fused_route", "route_launch", "router_args", "unsupported_reason"]

MAX_EXPERTS = 1024
_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCORINGS = ("softmax", "sigmoid")
# route_launch's routing options, named as in RouterConfig, in the order the op takes them
_ROUTER_ARGS = ("top_k", "scoring", "renormalize", "num_expert_group", "topk_group", "routed_scaling_factor")


def unsupported_reason(router, logits: torch.Tensor) -> str | None:
    """Why the fused kernel cannot route ``logits`` with ``router`` (a ``RouterConfig``), or None."""
    if router.custom_fn is not None:
        return "no custom_fn (custom routing functions run in PyTorch)"
    if router.num_experts > MAX_EXPERTS:
        return f"num_experts <= {MAX_EXPERTS} (the fused routing kernel's limit), got {router.num_experts}"
    if logits.device.type != "cuda" and not interpreting():
        return f"router_logits on a CUDA device (or TRITON_INTERPRET=1), got {logits.device}"
    return None


def _tile(t: int, gp: int, sp: int) -> tuple[int, int]:
    """(ROWS, num_warps). On a GPU one token per program: decode has T <= 64 programs for
    132 SMs, and a small program finishes its K selection rounds sooner; one warp per 256
    values keeps E = 256 inside one warp (shuffle reductions, no shared memory). Not yet
    measured. The interpreter pays ~5 ms per program, so it takes up to 16 rows at once."""
    per_row = gp * sp
    if interpreting():
        rows = min(16, next_power_of_2(max(t, 1)), max(1, 8192 // per_row))
        return rows, 4
    return 1, min(8, max(1, per_row // 256))


def route_launch(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    rows: int | None = None,
    out: TopK | None = None,
    quantize: ActQuantLaunch | None = None,
) -> TopK:
    """Launch ``_route_kernel`` on ``logits`` [T, E]; ``correction_bias`` [E] or None.

    The routing arguments are ``RouterConfig``'s (checked there, and again here for what
    would make the kernel read or write out of bounds). ``rows``: tokens per program (a
    power of 2; tests use it to cover both one and several rows per program). ``out``:
    the ids int32 [T, K] and weights float32 [T, K] to write (contiguous). ``quantize``: a one-pass
    quantization of x (``act_quant.plan_act_quant``) whose programs run in this launch beside the
    routing's (``_route_quant_kernel``); it is launched on its own where there is nothing to route.
    """
    # 102 lines: maps the router's inputs and every routing option to the kernel's arguments in their order; split,
    # that order would be spread over several functions.
    expect(logits.dim() == 2 and logits.is_floating_point(), "logits", "a floating tensor [T, E]", logits.shape)
    t, e = logits.shape
    k = top_k
    expect(0 < e <= MAX_EXPERTS, "logits", f"1 <= E <= {MAX_EXPERTS} columns", tuple(logits.shape))
    expect(0 < k <= e, "top_k", f"in [1, E = {e}]", k)
    expect(scoring in _SCORINGS, "scoring", f"one of {_SCORINGS}", scoring)
    grouped = num_expert_group is not None
    g, tg = (num_expert_group, topk_group) if grouped else (1, 1)
    expect(g > 0 and e % g == 0, "num_expert_group", f"a positive divisor of E = {e}", g)
    expect(tg is not None and 0 < tg <= g, "topk_group", f"in [1, num_expert_group = {g}]", tg)
    expect(k <= tg * (e // g), "top_k", f"<= topk_group * E / num_expert_group = {tg * (e // g)}", k)
    if logits.dtype not in _NATIVE_DTYPES:
        logits = logits.float()  # float64: the reference rounds to float32 first too
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    has_bias = correction_bias is not None
    if has_bias:
        expect(tuple(correction_bias.shape) == (e,), "correction_bias", f"shape ({e},)", correction_bias.shape)
        bias = correction_bias.to(device=logits.device)
        bias = (bias if bias.dtype in _NATIVE_DTYPES else bias.float()).contiguous()
    if out is None:
        ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
        weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    else:
        ids, weights = out.ids, out.weights
        for name, buf, dt in (("out.ids", ids, torch.int32), ("out.weights", weights, torch.float32)):
            expect(
                tuple(buf.shape) == (t, k) and buf.dtype == dt and buf.is_contiguous(),
                name,
                f"a contiguous {dt} tensor of shape {(t, k)}",
                (tuple(buf.shape), buf.dtype),
            )
    if quantize is not None:
        expect(
            len(quantize.passes) <= 1, "quantize", "a one-pass quantization (a per-tensor dynamic scale of one tile)"
        )
    if t == 0:
        if quantize is not None:
            quantize.launch()
        return TopK(ids=ids, weights=weights)
    s = e // g
    gp, sp = next_power_of_2(g), next_power_of_2(s)
    r, num_warps = _tile(t, gp, sp)
    if rows is not None:
        expect(rows > 0 and rows & (rows - 1) == 0, "rows", "a power of 2", rows)
        r = rows
    n_route, kernel, extra = cdiv(t, r), _route_kernel, {}
    if quantize is not None and quantize.passes:
        kernel = _route_quant_kernel
        gm, gk = quantize.grid
        meta = {k: v for k, v in quantize.meta.items() if k != "num_warps"}
        extra = dict(args=(n_route, gk, *quantize.args), meta={**meta, "PASS": quantize.passes[0]})
        # the routing's program keeps its warps where x's tile fits them at <= 64 values a thread: a routing
        # row reduced across warps goes through shared memory, and its latency is the launch's
        num_warps = max(num_warps, quantize.warps_for(64))
    launch(
        kernel,
        (n_route + (gm * gk if extra else 0),),
        logits,
        bias if has_bias else logits,  # any pointer; never read
        ids,
        weights,
        t,
        e,
        g,
        s,
        k,
        tg,
        logits.stride(0),
        logits.stride(1),
        float(routed_scaling_factor),
        *extra.get("args", ()),
        SCORING=scoring,
        RENORMALIZE=bool(renormalize),
        HAS_BIAS=has_bias,
        GROUPED=grouped,
        # with a bias, the sum of a group's 2 largest choices; a group of 1 has only its largest
        GROUP_TOP2=grouped and has_bias and s >= 2,
        ROWS=r,
        GP=gp,
        SP=sp,
        KP=next_power_of_2(k),
        num_warps=num_warps,
        **extra.get("meta", {}),
    )
    return TopK(ids=ids, weights=weights)


@torch.library.custom_op("fusedmoe::route", mutates_args=())
def route_op(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_launch`` as an op: (ids int32 [T, K], weights float32 [T, K])."""
    options = (top_k, scoring, renormalize, num_expert_group, topk_group, routed_scaling_factor)
    r = route_launch(logits, correction_bias, **dict(zip(_ROUTER_ARGS, options, strict=True)))
    return r.ids, r.weights


@route_op.register_fake
def _route_op_fake(logits, correction_bias, top_k, *args):
    t = logits.shape[0]
    ids = logits.new_empty((t, top_k), dtype=torch.int32)
    return ids, logits.new_empty((t, top_k), dtype=torch.float32)


def router_args(router) -> dict:
    """``route_launch``'s routing arguments from a ``RouterConfig``, in the op's order."""
    return {name: getattr(router, name) for name in _ROUTER_ARGS}


def fused_route(
    router_logits: torch.Tensor,
    router,
    correction_bias: torch.Tensor | None = None,
    quantize: ActQuantLaunch | None = None,
) -> TopK:
    """Route ``router_logits`` [T, E] as ``router`` (a ``RouterConfig`` without custom_fn) says,
    in one kernel launch. ``RouterConfig.route(..., fused=True)`` checks the inputs, then calls this.

    Eager mode calls the launcher directly (the dispatcher costs tens of microseconds, more
    than the kernel); while ``torch.compile`` traces, the ``fusedmoe::route`` op goes in the
    graph, so ``fullgraph=True`` and CUDA graphs work. ``quantize``: eager only (``route_launch``).
    """
    args = router_args(router)
    if torch.compiler.is_compiling():
        expect(quantize is None, "quantize", "None while compiling (the op routes only)")
        ids, weights = torch.ops.fusedmoe.route(router_logits, correction_bias, *args.values())
        return TopK(ids=ids, weights=weights)
    return route_launch(router_logits, correction_bias, **args, quantize=quantize)
