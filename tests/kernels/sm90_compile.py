"""Compile the persistent grouped GEMM, the 4-bit weight GEMM and the decode launches for sm_90 on a
machine without a GPU.

    PYTHONPATH=src python3 tests/kernels/sm90_compile.py [--json] [--loops [LABEL ...]]

Every launch ``persistent_gemm_launch`` makes is compiled, not run: Triton's own binder turns
the arguments into the signature and specialisation a GPU launch would compile (CPU tensors
carry the same dtypes, and fresh allocations the same 16-byte alignment), then the whole
pipeline runs for sm_90 down to a cubin (ptxas ships with Triton), and the cubin's resource
usage and SASS say what the GPU would run: registers, spilled bytes, shared memory, warps,
and counts of wgmma (``[HQI]GMMA``), TMA loads (``UTMALDG``) and cp.async (``LDGSTS``).

``--loops``: per case (those whose label contains one of the LABELs, or all), the instruction
mix of the kernel's longest loop (``loop_mix``: the SASS between a backward branch and its
target, usually the K loop): its length and the count of each opcode, as the fifteenth
session's PERF_LOG entries read them (16-bit against 64-bit shared loads, byte permutes, ...).

The interpreter cannot show any of this (``TRITON_INTERPRET`` must be unset: CI sets it before
Python starts, so ``test_kernels_gemm_persistent.py`` runs this file in a subprocess). The
cases are the configs ``scripts/kbench_prefill.py`` builds on, one per code path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

SMEM_LIMIT = 232448  # bytes of shared memory an H100 block may use (227 KiB)
SM_SMEM, SM_REGS = 233472, 65536  # what two programs of one SM share (two per SM: ``programs_per_sm``)


@dataclasses.dataclass
class Case:
    label: str
    scheme: str  # a QuantScheme name
    gemm: str  # gemm1 (A = x, gated act) | gemm2
    cfg: dict  # LaunchConfig fields
    act: str | None = None  # "silu" | "swigluoai_il" (interleaved, bias) | None
    out: str | None = None  # None | "g128" (dynamic fp8 groups) | "int8" (static)
    sorted_a: bool = False
    batched: bool = False
    no_spill: bool = True  # spilled bytes must be 0


def _p(bm, bn, bk, warps, stages, **kw) -> dict:
    return dict(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=warps, num_stages=stages, persistent=True,
                flatten=kw.get("flatten", True), epilogue_subtile=kw.get("sub", 1),
                programs_per_sm=kw.get("per_sm", 1))  # fmt: skip


CASES = [
    Case("bf16 gemm2 128x256", "bf16", "gemm2", _p(128, 256, 64, 8, 3)),
    Case("bf16 gemm1 silu 128x(2x128)", "bf16", "gemm1", _p(128, 128, 64, 8, 3), act="silu"),
    Case("bf16 gemm1 swigluoai il+bias", "bf16", "gemm1", _p(128, 128, 64, 8, 3), act="swigluoai_il"),
    Case("bf16 gemm2 subtile 2", "bf16", "gemm2", _p(128, 256, 64, 8, 3, sub=2)),
    Case("bf16 batched gemm2 64x128", "bf16", "gemm2", _p(64, 128, 64, 4, 3), batched=True),
    Case("fp8_tensor gemm2 128x256", "fp8_tensor", "gemm2", _p(128, 256, 128, 8, 3)),
    Case("fp8_block gemm2 128x128", "fp8_block", "gemm2", _p(128, 128, 128, 8, 4)),
    # two halves (``halves``): 255 registers, 32-40 bytes spilled outside the K loop (none in it)
    Case("fp8_block gemm2 128x256 halves", "fp8_block", "gemm2", _p(128, 256, 128, 8, 3), no_spill=False),
    Case("fp8_block gemm1 plain 128x256 halves", "fp8_block", "gemm1", _p(128, 256, 128, 8, 3), no_spill=False),
    Case("fp8_block gemm1 g128 out", "fp8_block", "gemm1", _p(64, 128, 128, 8, 4), act="silu", out="g128"),
    # two programs per SM (the H200 tables' fp8-block entries): 226 registers, 90 KiB each
    Case("fp8_block gemm2 64x128 two per SM", "fp8_block", "gemm2", _p(64, 128, 128, 4, 4, per_sm=2)),
    # the layer's GEMM1 of a 64 x 128 entry with the activation fused: BN 64 outputs, 128 W rows
    Case("bf16 gemm1 silu 64x(2x64) two per SM", "bf16", "gemm1", _p(64, 64, 64, 4, 4, per_sm=2), act="silu"),
    Case("int8 channel gemm2 (int32 acc)", "int8_w8a8_channel", "gemm2", _p(128, 256, 128, 8, 3)),
    Case("int8 w8a16 gemm2", "int8_w8a16", "gemm2", _p(128, 128, 64, 8, 3)),
    Case(
        "fp8_tensor gemm1 int8 static out", "int8_w8a8_tensor", "gemm1", _p(128, 128, 128, 8, 3), act="silu", out="int8"
    ),  # fmt: skip
]


class _Compiler:
    """A launch interceptor (``kernels.launch.intercept_launches``): compiles each launch for sm_90
    instead of running it, and keeps what it found."""

    def __init__(self) -> None:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = CUDABackend(self.target)
        self.bin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        self.found: dict = {}

    def __call__(self, k, grid, args, kwargs) -> None:
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        kwargs = {"debug": False, **kwargs}
        binder = create_function_from_signature(k.signature, k.params, self.backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, sig, consts, attrs = k._pack_args(self.backend, kwargs, bound, spec, opts)
        compiled = triton.compile(ASTSource(k, sig, consts, attrs), target=self.target, options=options.__dict__)
        self.found = self.inspect(compiled)

    def inspect(self, compiled) -> dict:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([self.bin, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([self.bin, "-sass", f.name], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        return {
            "regs": int(regs.group(1)) if regs else -1,
            "spill_bytes": int(stack.group(1)) if stack else -1,
            "smem": compiled.metadata.shared,
            "warps": compiled.metadata.num_warps,
            "wgmma": len(re.findall(r"[HQI]GMMA", sass)),
            "tma_loads": len(re.findall(r"UTMALDG", sass)),
            "cp_async": len(re.findall(r"LDGSTS", sass)),
            "paired_16bit": len(re.findall(r"\bH(?:FMA2|MUL2|ADD2)\b", sass)),
            "hmma": len(re.findall(r"HMMA", sass)),
            "wgmma_serialised": self.serialised(compiled.asm["ptx"]),
            "loop": loop_mix(sass),
            # launched with programmatic dependent launch, and waiting for the kernel before it
            "pdl": bool(getattr(compiled.metadata, "launch_pdl", False))
            and "griddepcontrol.wait" in compiled.asm["ptx"],
        }

    def serialised(self, ptx: str) -> bool:
        """Whether ptxas serialises the wgmma (its C7514 or C7515 note: a wait after every wgmma; C7514:
        an instruction reads the accumulator registers of a wgmma in flight)."""
        ptxas = os.path.join(os.path.dirname(self.bin), "ptxas")
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            run = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.o")],
                                 capture_output=True, text=True)  # fmt: skip
        return any(c in run.stdout + run.stderr for c in ("C7514", "C7515"))


def _operands(case: Case):
    """Small operands of the case's formats (shapes do not change the specialisation: every
    dimension here is a multiple of 16, as every preset's is)."""
    import torch

    from fusedmoe.config import Activation
    from fusedmoe.kernels.align import moe_align_ref
    from fusedmoe.kernels.gemm_format import GemmFormat
    from fusedmoe.kernels.grouped_gemm_persistent import GroupQuantEpilogue
    from fusedmoe.kernels.launch_config import LaunchConfig, fit_launch_config
    from fusedmoe.quant import Granularity, Operand, QDtype, QTensor, QuantScheme, TensorQuant, quantize
    from fusedmoe.testing import random_topk

    gen = torch.Generator().manual_seed(0)
    sch = QuantScheme.by_name(case.scheme)
    e, t, k, h, i = 4, 64, 2, 256, 256
    n_w, kd = (2 * i, h) if case.gemm == "gemm1" else (h, i)
    rows = t if case.gemm == "gemm1" else t * k
    x = torch.randn(4, 32, kd) if case.batched else torch.randn(rows, kd)
    w = torch.randn(e, n_w, kd, generator=gen) * 0.05
    wq = QTensor(w.bfloat16(), (e, n_w, kd)) if sch.w1 is None else quantize(w, sch.w1)
    a, a_scale = x.bfloat16(), None
    if sch.a1 is not None:
        q = quantize(x, sch.a1)
        a, a_scale = q.data, q.scale
    fmt = GemmFormat.of(sch.w1, sch.a1, n_w, kd)
    cfg = fit_launch_config(LaunchConfig(**case.cfg), fmt.k_group, strict=fmt.native)
    act = None
    if case.act is not None:
        quant = {"g128": TensorQuant(QDtype.FP8, Granularity.group(128), dynamic=True),
                 "int8": TensorQuant(QDtype.INT8, Granularity.tensor())}.get(case.out)  # fmt: skip
        il = case.act == "swigluoai_il"
        act = GroupQuantEpilogue(Activation.SWIGLUOAI if il else Activation.SILU, gate_up_interleaved=il, quant=quant)
    n = n_w if act is None else act.out_cols(n_w)
    kw = dict(act=act)
    if case.act == "swigluoai_il":
        kw["bias"] = torch.randn(e, n_w).bfloat16()
    if case.batched:
        kw["counts"] = torch.tensor([5, 0, 32, 7], dtype=torch.int32)
        c = torch.empty(4, 32, n, dtype=torch.bfloat16)
    else:
        ids, tw = random_topk(t, e, k, gen)
        r = moe_align_ref(ids, e, cfg.block_m)
        a_div = k if case.gemm == "gemm1" else 1
        if case.sorted_a:
            src = (r.sorted_ids.long() // a_div).clamp(max=a.shape[0] - 1)
            a = a[src].contiguous()
            a_scale = a_scale if a_scale is None or a_scale.shape[0] == 1 else a_scale[src].contiguous()
        kw.update(routing=r, a_div=a_div, route_weights=None if case.gemm == "gemm1" else tw.reshape(-1))
        out_dtype = {"g128": torch.float8_e4m3fn, "int8": torch.int8}.get(case.out, torch.bfloat16)
        c = torch.empty(t * k, n, dtype=out_dtype)
        if case.out == "g128":
            kw["act_scale"] = torch.empty(t * k, -(-n // 128))
        elif case.out == "int8":
            kw["act_scale"] = torch.ones(1)
    qa = QTensor(a, (*a.shape[:-1], kd), scale=a_scale)
    return Operand(qa, sch.a1), Operand(wq, sch.w1), c, fmt, cfg, kw


_COMPILER: dict = {}


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def sass_loops(sass: str) -> list[list[str]]:
    """The loops of a ``cuobjdump -sass`` listing: for each branch to an earlier address, the
    instructions from its target to it (predicates dropped: "@P0 LDS.U16 R1, [R2]" is "LDS.U16 R1, [R2]")."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    loops = []
    for addr, ins in code:
        b = _BRANCH.search(ins)
        if b and int(b.group(1), 16) < addr:
            start = int(b.group(1), 16)
            loops.append([re.sub(r"^@!?U?P\w+\s+", "", i) for a, i in code if start <= a <= addr])
    return loops


def loop_mix(sass: str) -> dict:
    """{"length": instructions, "ops": {opcode: count}} of the longest loop (``sass_loops``), or
    length 0 without a loop."""
    loops = sass_loops(sass)
    if not loops:
        return {"length": 0, "ops": {}}
    body = max(loops, key=len)
    ops: dict[str, int] = {}
    for ins in body:
        op = ins.split()[0]
        ops[op] = ops.get(op, 0) + 1
    return {"length": len(body), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def _compiled(launches) -> dict:
    """Run ``launches()`` (which builds its operands and launches) with every launch compiled for
    sm_90 instead of run: what the last compiled kernel shows, or the error, and the seconds taken."""
    import fusedmoe.kernels.launch as launch_mod
    from fusedmoe.kernels.launch import intercept_launches

    # as on an sm_90 GPU: kernels that take PDL get it (FUSEDMOE_PDL as set), found at the first launch
    launch_mod._PDL_HW[:] = [True]
    comp = _COMPILER.get("c") or _COMPILER.setdefault("c", _Compiler())
    t0 = time.time()
    try:
        comp.found = {}
        with intercept_launches(comp):
            launches()
        res = {"ok": bool(comp.found), **comp.found}
    except Exception as exc:
        res = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    res["seconds"] = round(time.time() - t0, 2)
    return res


def compile_case(case: Case) -> dict:
    import fusedmoe.kernels.grouped_gemm_persistent as gp
    from fusedmoe.kernels.gemm_format import GemmCall
    from fusedmoe.platform import Platform

    gp.current_platform = lambda: Platform.simulated("sm90")  # supports() asks for sm90+ (no GPU here)

    def launches() -> None:
        a, w, c, fmt, cfg, kw = _operands(case)
        gp.persistent_gemm_launch(a, w, c, fmt, cfg, GemmCall(**kw))

    return _compiled(launches)


@dataclasses.dataclass
class W4Case:
    """A 4-bit weight GEMM (``grouped_gemm_w4``) on the tensor cores: its PTX unpack must
    assemble for sm_90 (ptxas) and show paired 16-bit math in the SASS."""

    label: str
    scheme: str  # a key of W4_SCHEMES
    gemm: str
    cfg: tuple  # LaunchConfig fields: BM, BN, BK, GROUP_M, warps, stages, split_k, w_major
    dtype: str = "bf16"  # activations
    scale_dtype: str | None = None  # stored scales cast to this (int4: None keeps fp32)
    batched: bool = False
    fma: bool = False  # BM < 16: the FMA path (e2m1 weights unpacked to fp32 by PTX), no MMA
    loads: int = 0  # LaunchConfig.scale_loads: 1 the step's scale codes loaded a step before, 2 at its start


W4_CASES = [
    W4Case("int4 g128 swap gemm1 silu (split scale)", "int4_g128", "gemm1", (64, 64, 128, 8, 4, 3, 1, 1)),
    W4Case("int4 g128 swap gemm2 bf16 scale", "int4_g128", "gemm2", (128, 128, 128, 8, 8, 3, 1, 1), scale_dtype="bf16"),
    W4Case("int4 g64 zp dot gemm2", "int4_g64_zp", "gemm2", (16, 64, 128, 1, 4, 4, 1, 0)),
    W4Case("int4 g32 act-order swap gemm1", "int4_g32_actorder", "gemm1", (64, 64, 128, 8, 4, 3, 1, 1)),
    W4Case(
        "int4 g128 fp16 swap gemm2", "int4_g128", "gemm2", (64, 128, 128, 8, 8, 3, 1, 1), dtype="f16", scale_dtype="f16"
    ),  # fmt: skip
    W4Case("mxfp4 swap gemm1 silu", "mxfp4", "gemm1", (64, 64, 128, 8, 4, 3, 1, 1)),
    W4Case("mxfp4 swap BM 32, one dot a K step", "mxfp4", "gemm1", (32, 128, 128, 1, 4, 3, 1, 1)),
    W4Case("mxfp4 dot gemm2 batched", "mxfp4", "gemm2", (16, 64, 128, 1, 4, 4, 1, 0), batched=True),
    W4Case("nvfp4 swap gemm2", "nvfp4", "gemm2", (128, 128, 128, 8, 8, 3, 1, 1)),
    W4Case("mxfp4 fma1 gemm2 split 2", "mxfp4", "gemm2", (1, 32, 64, 1, 4, 4, 2, 1), fma=True),
    W4Case("mxfp4 fma1 gemm1 silu, two blocks a step", "mxfp4", "gemm1", (1, 32, 128, 1, 4, 4, 1, 1), fma=True),
    W4Case("nvfp4 fma1 gemm2, halves of two groups", "nvfp4", "gemm2", (1, 64, 128, 1, 4, 4, 1, 1), fma=True),
    # scale codes a K step ahead or at its start (``LaunchConfig.scale_loads``): one group a half,
    # two runs of a dot (BM 16 "dot"), zero points, halves of two groups (NVFP4), a gated GEMM1
    W4Case("mxfp4 swap gemm2 BM 16, scales ahead", "mxfp4", "gemm2", (16, 64, 128, 1, 4, 3, 1, 1), loads=1),
    W4Case("mxfp4 dot gemm2 two runs, scales ahead", "mxfp4", "gemm2", (16, 128, 128, 1, 4, 3, 1, 0), loads=1),
    W4Case("int4 g64 zp dot gemm2, scales ahead", "int4_g64_zp", "gemm2", (16, 64, 128, 1, 4, 4, 1, 0), loads=1),
    W4Case("nvfp4 swap gemm2, scales ahead", "nvfp4", "gemm2", (128, 128, 128, 8, 8, 3, 1, 1), loads=1),
    W4Case("mxfp4 swap gemm1 silu, scales at step start", "mxfp4", "gemm1", (16, 64, 128, 1, 4, 3, 1, 1), loads=2),
    W4Case("nvfp4 swap gemm2, scales at the step's start", "nvfp4", "gemm2", (128, 128, 128, 8, 8, 3, 1, 1), loads=2),
]


def compile_w4_case(case: W4Case) -> dict:
    import torch

    from fusedmoe.config import Activation
    from fusedmoe.kernels.align import moe_align_ref
    from fusedmoe.kernels.gemm_format import ActEpilogue, GemmCall, GemmFormat
    from fusedmoe.kernels.grouped_gemm_w4 import w4_gemm_launch
    from fusedmoe.kernels.launch_config import LaunchConfig
    from fusedmoe.quant import Operand, QuantScheme, quantize
    from fusedmoe.quant.w4_layout import to_w4
    from fusedmoe.testing import random_topk
    from fusedmoe.weights import random_g_idx

    schemes = {"int4_g128": QuantScheme.int4_w4a16(128), "int4_g64_zp": QuantScheme.int4_w4a16(64, zero_points=True),
               "int4_g32_actorder": QuantScheme.int4_w4a16(32, act_order=True), "mxfp4": QuantScheme.mxfp4_w4a16(),
               "nvfp4": QuantScheme.nvfp4_w4a16()}  # fmt: skip
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}

    def launches() -> None:
        gen = torch.Generator().manual_seed(0)
        tq = schemes[case.scheme].w1
        e, t, k, h, i = 4, 64, 2, 256, 256
        n_w, kd = (2 * i, h) if case.gemm == "gemm1" else (h, i)
        g_idx = random_g_idx(e, kd, tq.granularity.group_size) if tq.act_order else None
        q = quantize(torch.randn(e, n_w, kd, generator=gen) * 0.05, tq, g_idx=g_idx)
        if case.scale_dtype is not None:
            q.scale = q.scale.to(dt[case.scale_dtype])
        w = Operand(to_w4(q, tq), tq)
        cfg = LaunchConfig(*case.cfg[:6], split_k=case.cfg[6], w_major=case.cfg[7], scale_loads=case.loads)
        act = ActEpilogue(Activation.SILU) if case.gemm == "gemm1" else None
        n = n_w // 2 if act is not None else n_w
        fmt = GemmFormat.of(tq, None, n_w, kd, q.zero is not None)
        if case.batched:
            a = torch.randn(e, 32, kd).to(dt[case.dtype])
            c = torch.empty(e, 32, n, dtype=dt[case.dtype])
            kw = dict(counts=torch.tensor([5, 0, 32, 7], dtype=torch.int32))
        else:
            ids, tw = random_topk(t, e, k, gen)
            a = torch.randn(t if act is not None else t * k, kd).to(dt[case.dtype])
            c = torch.empty(t * k, n, dtype=dt[case.dtype])
            kw = dict(routing=moe_align_ref(ids, e, cfg.block_m), a_div=k if act is not None else 1,
                      route_weights=None if act is not None else tw.reshape(-1))  # fmt: skip
        # split-K: the partials are the result (reduce=False), so the GEMM is the last launch compiled
        w4_gemm_launch(Operand.of(a), w, c, fmt, cfg, GemmCall(act=act, **kw), reduce=cfg.split_k == 1)

    return _compiled(launches)


def w4_problems(case: W4Case, res: dict) -> list[str]:
    if not res["ok"]:
        return [res.get("error", "not compiled")]
    bad = _pdl_problems(res)
    if res["wgmma"] + res["hmma"] == 0 and not case.fma:
        bad.append("no tensor-core MMA")
    if res["wgmma_serialised"]:
        bad.append("ptxas serialises the wgmma (C7514/C7515)")
    if res["paired_16bit"] == 0:
        bad.append("no paired 16-bit math (the PTX unpack is not in the kernel)")
    if res["spill_bytes"] != 0:
        bad.append(f"{res['spill_bytes']} bytes spilled")
    return bad


def problems(case: Case, res: dict) -> list[str]:
    """What is wrong with a compiled case (empty: nothing)."""
    if not res["ok"]:
        return [res.get("error", "not compiled")]
    bad = _pdl_problems(res)
    if res["wgmma"] == 0:
        bad.append("no wgmma")
    if res["tma_loads"] == 0:
        bad.append("no TMA load")
    if res["smem"] > SMEM_LIMIT:
        bad.append(f"shared memory {res['smem']} > {SMEM_LIMIT}")
    if case.no_spill and res["spill_bytes"] != 0:
        bad.append(f"{res['spill_bytes']} bytes spilled")
    if res["wgmma_serialised"]:  # e.g. a product carried across K steps: PERF_LOG, eleventh session
        bad.append("ptxas serialises the wgmma (C7514/C7515)")
    per_sm = case.cfg.get("programs_per_sm", 1)
    regs = max(res["regs"], 0) * 32 * res["warps"]
    if per_sm > 1 and (per_sm * res["smem"] > SM_SMEM or per_sm * regs > SM_REGS):
        bad.append(f"{per_sm} programs do not fit one SM ({res['smem']} B shared memory, {regs} registers each)")
    return bad


@dataclasses.dataclass
class DecodeCase:
    """A decode launch that the interpreter runs but cannot compile: pair blocks (no moe_align)
    in the grouped GEMM and the 4-bit GEMM, and the one-program per-tensor activation scale.
    It must compile for sm_90 without spilling."""

    label: str
    scheme: str
    block_m: int = 1  # pair blocks: 1 (FMA path) or 16 (dot)
    quant_rows: int = 0  # > 0: ``act_quant_launch`` of [rows, 768] instead of a GEMM


DECODE_CASES = [
    DecodeCase("act quant fp8 tensor, one program", "fp8_tensor", quant_rows=8),
    DecodeCase("pair blocks bf16 fma", "bf16"),
    DecodeCase("pair blocks bf16 dot", "bf16", 16),
    DecodeCase("pair blocks fp8 block fma", "fp8_block"),
    DecodeCase("pair blocks fp8 tensor dot", "fp8_tensor", 16),
    DecodeCase("pair blocks int4 w4 fma", "int4_g128"),
    DecodeCase("pair blocks mxfp4 w4 dot", "mxfp4", 16),
]


def compile_decode_case(case: DecodeCase) -> dict:
    import torch

    from fusedmoe.kernels.act_quant import act_quant_launch
    from fusedmoe.kernels.align import pair_blocks
    from fusedmoe.kernels.gemm_format import GemmCall, GemmFormat
    from fusedmoe.kernels.grouped_gemm import grouped_gemm_launch
    from fusedmoe.kernels.launch_config import LaunchConfig
    from fusedmoe.quant import Operand, QTensor, QuantScheme, quantize
    from fusedmoe.quant.w4_layout import to_w4

    sch = QuantScheme.by_name(case.scheme)

    def launches() -> None:
        if case.quant_rows:
            act_quant_launch(torch.randn(case.quant_rows, 768).to(torch.bfloat16), sch.a2)
            return
        e, n, k, bm = 8, 256, 512, case.block_m
        w = torch.randn(e, n, k) * 0.05
        wq = QTensor(w.to(torch.bfloat16), (e, n, k)) if sch.w1 is None else quantize(w, sch.w1)
        wq = to_w4(wq, sch.w1) if sch.w1 is not None and sch.a1 is None else wq
        x = torch.randn(1, k).to(torch.bfloat16)
        a = QTensor(x, (1, k)) if sch.a1 is None else quantize(x.float(), sch.a1)
        cfg = LaunchConfig(bm, 32 if bm == 1 else 64, 128 if bm == 1 else 64, 1, 4, 2)
        routing = pair_blocks(torch.randint(0, e, (1, 4), dtype=torch.int64), bm)
        call = GemmCall(routing, a_div=4, route_weights=torch.rand(4).to(torch.bfloat16))
        c = torch.empty(4, n, dtype=torch.bfloat16)
        grouped_gemm_launch(Operand(a, sch.a1), Operand(wq, sch.w1), c, GemmFormat.of(sch.w1, sch.a1, n, k), cfg, call)

    return _compiled(launches)


def decode_problems(case: DecodeCase, res: dict) -> list[str]:
    if not res["ok"]:
        return [res.get("error", "not compiled")]
    return _pdl_problems(res) + ([f"{res['spill_bytes']} bytes spilled"] if res["spill_bytes"] != 0 else [])


def _pdl_problems(res: dict) -> list[str]:
    """Every kernel here takes PDL (``kernels.launch``); FUSEDMOE_PDL=0 compiles them without it."""
    from fusedmoe import env

    want = env.pdl()
    return [f"launched with PDL: {res['pdl']}, expected {want}"] if res["pdl"] != want else []


def main(argv: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "unset TRITON_INTERPRET: this compiles for the GPU"
    out, failed = [], 0
    todo = [(c, compile_case, problems) for c in CASES] + [(c, compile_w4_case, w4_problems) for c in W4_CASES]
    todo += [(c, compile_decode_case, decode_problems) for c in DECODE_CASES]
    loops = argv[argv.index("--loops") + 1 :] if "--loops" in argv else None
    if loops is not None:
        todo = [t for t in todo if not loops or any(w in t[0].label for w in loops)]
    for case, compile_, problems_ in todo:
        res = compile_(case)
        bad = problems_(case, res)
        failed += bool(bad)
        out.append({"case": case.label, **res, "problems": bad})
        if "--json" in argv:
            continue
        mix = res.pop("loop", {"length": 0, "ops": {}})
        if loops is not None:
            ops = " ".join(f"{k}={v}" for k, v in list(mix["ops"].items())[:16])
            print(f"{case.label}: regs {res.get('regs')}, loop {mix['length']} | {ops}", flush=True)
        else:
            shown = {k: v for k, v in res.items() if k not in ("ok", "error")}
            print(f"{case.label:34s} {'FAIL ' + '; '.join(bad) if bad else 'ok'} {shown}", flush=True)
    if "--json" in argv:
        print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
