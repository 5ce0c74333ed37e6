"""What the platform has, as data: device kind, compute capability, SM count, packages.

``Platform.detect()`` reads the running machine; tests and ``fusedmoe explain
--platform`` build one by hand (``Platform.simulated("sm100")``) to exercise
backend choices for hardware we do not have. Nothing else in fusedmoe asks
torch.cuda directly what the hardware is.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace

import torch

from .errors import expect

# Optional packages an adapter may need (import name -> what it gives).
OPTIONAL_PACKAGES = {
    "flashinfer": "FlashInfer fused MoE (CUTLASS / TRT-LLM)",
    "deep_gemm": "DeepGEMM fp8 grouped GEMMs",
    "triton_kernels": "OpenAI triton_kernels (MXFP4 matmul_ogs)",
    "aiter": "AMD AITER fused MoE",
    "vllm": "vLLM custom ops (Marlin MoE)",
    "deep_ep": "DeepEP all-to-all",
    "pplx_kernels": "pplx-kernels all-to-all",
    "torch_xla": "PyTorch/XLA (TPU)",
}

_SIMULATED = {
    "cpu": ("cpu", None, "CPU"),
    "sm80": ("cuda", (8, 0), "NVIDIA A100"),
    "sm89": ("cuda", (8, 9), "NVIDIA L40S"),
    "sm90": ("cuda", (9, 0), "NVIDIA H100 80GB HBM3"),
    "sm100": ("cuda", (10, 0), "NVIDIA B200"),
    "gfx942": ("rocm", (9, 4), "AMD Instinct MI300X"),
    "gfx950": ("rocm", (9, 5), "AMD Instinct MI355X"),
    "tpu": ("tpu", None, "TPU"),
    "xpu": ("xpu", None, "Intel GPU"),
}

# ROCm reports gfx9.4.x as capability (9, 4), gfx950 as (9, 5), gfx90a as (9, 0).
_ROCM_ARCH = {(9, 0): "gfx90a", (9, 4): "gfx942", (9, 5): "gfx950"}


@dataclass(frozen=True)
class Platform:
    kind: str  # cpu | cuda | rocm | xpu | tpu
    capability: tuple[int, int] | None = None
    name: str = "CPU"
    sm_count: int = 0
    packages: frozenset[str] = field(default_factory=frozenset)
    is_simulated: bool = False

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("cuda", "rocm", "xpu")

    @property
    def label(self) -> str:
        if self.kind == "cuda" and self.capability:
            return f"sm{self.capability[0]}{self.capability[1]}"
        return self.kind

    @property
    def arch(self) -> str:
        """The architecture as tables key it: 'sm90', 'sm100', 'gfx942', 'gfx950', 'cpu', 'tpu'.

        ``label`` says only 'rocm' for AMD GPUs; MXFP4 kernels exist on gfx950 and not on gfx942.
        """
        if self.kind == "rocm" and self.capability is not None:
            return _ROCM_ARCH.get(self.capability, f"gfx{self.capability[0]}{self.capability[1]}")
        return self.label

    def has(self, package: str) -> bool:
        return package in self.packages

    def why_not_run(
        self, platforms: frozenset[str], packages: tuple[str, ...] = (), min_capability: tuple[int, int] | None = None
    ) -> str | None:
        """None if code declared for ``platforms`` (``kind`` values), cuda ``min_capability`` and
        ``packages`` can run here; else why not. The first checks of every backend and dispatcher."""
        if self.kind not in platforms:
            return f"platform {self.label} not supported (needs {sorted(platforms)})"
        if min_capability and self.kind == "cuda" and (self.capability or (0, 0)) < min_capability:
            need = f"sm{min_capability[0]}{min_capability[1]}"
            return f"needs compute capability {need}+, platform is {self.label}"
        for p in packages:
            if not self.has(p):
                return f"package '{p}' is not installed"
        return None

    def at_least(self, major: int, minor: int = 0) -> bool:
        return self.kind == "cuda" and self.capability is not None and self.capability >= (major, minor)

    @property
    def has_fp8(self) -> bool:
        """Native fp8 tensor cores: sm89+ or MI300-class."""
        return self.at_least(8, 9) or self.kind == "rocm"

    @property
    def has_fp4(self) -> bool:
        """Native FP4 tensor cores (sm100+)."""
        return self.at_least(10, 0)

    @classmethod
    def detect(cls) -> Platform:
        pk = frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            kind = "rocm" if torch.version.hip else "cuda"
            return cls(kind, (props.major, props.minor), props.name, props.multi_processor_count, pk)
        return cls("cpu", None, "CPU", 0, pk)

    @classmethod
    def simulated(cls, label: str, packages: tuple[str, ...] = ()) -> Platform:
        """A platform we may not have: 'cpu', 'sm80', 'sm89', 'sm90', 'sm100', 'gfx942', ..."""
        expect(label in _SIMULATED, "platform", f"one of {list(_SIMULATED)}", label)
        kind, cap, name = _SIMULATED[label]
        return cls(kind, cap, name, 132 if kind != "cpu" else 0, frozenset(packages), is_simulated=True)

    def with_packages(self, *packages: str) -> Platform:
        return replace(self, packages=self.packages | frozenset(packages))


_CURRENT: Platform | None = None


def current_platform() -> Platform:
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Platform.detect()
    return _CURRENT


_HALF_GEMM_CPU: bool | None = None


def cpu_has_half_gemm() -> bool:
    """Whether this CPU multiplies bf16/fp16 matrices in hardware (AVX512-BF16, AMX, or AVX512-FP16
    through AMX). Without them (AVX2 machines such as CI's), PyTorch's bf16 GEMM runs 3.5-4.7x slower
    than converting both operands to fp32 and calling sgemm (measured on a 2-core AVX2 EPYC,
    2026-11-28: [16, 512] x [512, 3584] 4,452 us in bf16, 2,641 us with the conversion)."""
    global _HALF_GEMM_CPU
    if _HALF_GEMM_CPU is None:
        cpu = getattr(torch, "cpu", None)
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        _HALF_GEMM_CPU = any(bool(getattr(cpu, p, lambda: False)()) for p in probes)
    return _HALF_GEMM_CPU


def host_memory_available() -> int | None:
    """Bytes of host memory a new allocation can take now, or None where the OS does not say.

    Linux: ``MemAvailable`` of /proc/meminfo (free pages plus the page cache the kernel can
    drop: what ``free`` reports as available); elsewhere ``os.sysconf``'s free physical
    pages where it has them. Read when it matters (``fusedmoe run`` on a CPU), never cached.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
