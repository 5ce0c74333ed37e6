"""Every ``FUSEDMOE_*`` environment variable, parsed in one place and strictly.

A knob that is set to something it cannot mean is an error naming the variable and what it
takes (``FUSEDMOE_DETERMINISTIC=yes`` once meant "off" without a word). Readers take the
variable at the moment their setting matters: when a kernel is built (chunk size,
determinism, fused activation), when the oracle chooses (backend, skips), when a launch
config is picked. Each read is a dictionary lookup and a parse of a short string: none is
on a per-launch path that runs more than once per call, but FUSEDMOE_FAST_LAUNCH and
FUSEDMOE_PDL, read at each launch that a launch plan does not replay. An eager call at a shape its kernel
(or router) has met twice replays the launches recorded then (``modular.replay``): the variables
read at launch (FUSEDMOE_LAUNCH_CONFIG, FUSEDMOE_W4_PTX, FUSEDMOE_FUSED_ROUTING, FUSEDMOE_PDL)
count as they were when that shape was recorded; with FUSEDMOE_LAUNCH_PLANS=0 every call reads
them again.

| variable | meaning | values |
| --- | --- | --- |
| FUSEDMOE_BACKEND, FUSEDMOE_<FAMILY>_BACKEND | pin the Experts backend (``oracle``) | a backend name or auto |
| FUSEDMOE_SKIP_BACKENDS | backends the oracle must not choose | comma-separated names |
| FUSEDMOE_CHUNK_SIZE | tokens per chunk of ``MoEKernel`` | a positive integer |
| FUSEDMOE_DETERMINISTIC | batch-invariant results | a boolean |
| FUSEDMOE_CHECK_VALUES | data checks (ids, NaN/Inf) at a host sync | a boolean |
| FUSEDMOE_FUSE_ACT | GEMM1 applies the activation in its epilogue | a boolean (default on) |
| FUSEDMOE_FUSED_ROUTING | the one-launch routing kernel on CUDA | a boolean (default on) |
| FUSEDMOE_QUANT_ON_LOAD | GEMM2 quantizes a2 as it loads it: where measured to pay, or up to N pairs | auto or N >= 0 |
| FUSEDMOE_LAUNCH_CONFIG | pin one grouped-GEMM launch config | ``BM,BN,BK,GROUP_M,WARPS,STAGES`` |
| FUSEDMOE_CONFIG_DIR | the folder of tuned configs: searched first, and where ``fusedmoe tune`` writes | a path |
| FUSEDMOE_FAST_LAUNCH | known kernels launched by their binary (``kernels.launch``) | a boolean (default on) |
| FUSEDMOE_LAUNCH_PLANS | eager calls at a known shape replay their launches (``modular.replay``) | a boolean (on) |
| FUSEDMOE_W4_PTX | 4-bit GEMMs unpack weights in PTX (``kernels._w4_unpack``); off: fp32 | a boolean (default on) |
| FUSEDMOE_PDL | programmatic dependent launch of the kernels on sm_90+ (``kernels.launch``) | a boolean (default on) |
| FUSEDMOE_W4_DEQUANT | 4-bit weights written out for the bf16 GEMMs (``experts.triton``) | auto, N rows an expert, 0 |

Booleans accept 1/true/yes/on and 0/false/no/off (any case); an empty value is the default.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import FusedMoEError

BACKEND = "FUSEDMOE_BACKEND"
SKIP_BACKENDS = "FUSEDMOE_SKIP_BACKENDS"
CHUNK_SIZE = "FUSEDMOE_CHUNK_SIZE"
DETERMINISTIC = "FUSEDMOE_DETERMINISTIC"
CHECK_VALUES = "FUSEDMOE_CHECK_VALUES"
FUSE_ACT = "FUSEDMOE_FUSE_ACT"
FUSED_ROUTING = "FUSEDMOE_FUSED_ROUTING"
QUANT_ON_LOAD = "FUSEDMOE_QUANT_ON_LOAD"
LAUNCH_CONFIG = "FUSEDMOE_LAUNCH_CONFIG"
FAST_LAUNCH = "FUSEDMOE_FAST_LAUNCH"
W4_PTX = "FUSEDMOE_W4_PTX"
PDL = "FUSEDMOE_PDL"
W4_DEQUANT = "FUSEDMOE_W4_DEQUANT"
LAUNCH_PLANS = "FUSEDMOE_LAUNCH_PLANS"
CONFIG_DIR = "FUSEDMOE_CONFIG_DIR"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# ``os.environ.get`` encodes the name and decodes the value through three Python frames, ~2 us a
# read on the H200 host (2026-11-28, 10,000 reads in a profile of 500 eager calls). The mapping
# behind it (``os._Environ._data``, which every ``os.environ`` write updates) is read directly,
# with each name encoded once.
_DATA = getattr(os.environ, "_data", None)
_KEYS: dict[str, object] = {}


def _get(name: str) -> str | None:
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)
    v = _DATA.get(key)
    return None if v is None else os.environ.decodevalue(v)


def raw(name: str) -> str | None:
    """The variable's value with surrounding blanks removed; None when unset or empty."""
    v = _get(name)
    if v is None:
        return None
    v = v.strip()
    return v or None


def flag(name: str, default: bool = False) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off; anything else is an error."""
    v = raw(name)
    if v is None:
        return default
    low = v.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise FusedMoEError(f"{name}: expected one of {_TRUE + _FALSE} (a boolean), got {v!r}")


def positive_int(name: str) -> int | None:
    """A positive integer variable, or None when unset."""
    v = raw(name)
    if v is None:
        return None
    if not v.isdigit() or int(v) <= 0:
        raise FusedMoEError(f"{name}: expected a positive integer, got {v!r}")
    return int(v)


def auto_count(name: str) -> int | None:
    """A variable that takes "auto" (or nothing: None) or an integer >= 0."""
    v = raw(name)
    if v is None or v.lower() == "auto":
        return None
    if not v.isdigit():
        raise FusedMoEError(f"{name}: expected auto or an integer >= 0, got {v!r}")
    return int(v)


def names(name: str) -> list[str]:
    """A comma-separated list of names (empty entries dropped)."""
    v = raw(name)
    return [] if v is None else [s.strip() for s in v.split(",") if s.strip()]


# Variables that change which kernel ``fused_moe`` builds (the oracle's choice or the kernel's
# settings). Per-launch knobs (LAUNCH_CONFIG, CONFIG_DIR) are read where the launch config is picked.
# Scheme families (``QuantScheme.family``), each with its own backend variable.
FAMILIES = ("unquantized", "fp8", "int8", "wna16", "mxfp4", "nvfp4")


def family_backend(family: str) -> str:
    """The variable that pins the backend of one scheme family: FUSEDMOE_<FAMILY>_BACKEND."""
    return f"FUSEDMOE_{family.upper()}_BACKEND"


_CHOICE_VARS = (
    BACKEND, SKIP_BACKENDS, CHUNK_SIZE, DETERMINISTIC, FUSE_ACT, FUSED_ROUTING, QUANT_ON_LOAD, W4_DEQUANT,
) + tuple(family_backend(f) for f in FAMILIES)  # fmt: skip


_CHOICE_KEYS = None if _DATA is None else tuple(os.environ.encodekey(v) for v in _CHOICE_VARS)


def choice_key() -> tuple:
    """The raw values of every variable that changes the kernel ``fused_moe`` builds: part of its
    cache key, so changing one builds (and checks) a new kernel. Read on every ``fused_moe`` call:
    the stored values as they are (not decoded: a key needs only their identity), one C-level
    lookup each, ~0.3 us for the 14 where decoding them through ``_get`` took ~2 us (2-core CPU)."""
    if _CHOICE_KEYS is None:
        return tuple([_get(v) for v in _CHOICE_VARS])
    return tuple(map(_DATA.get, _CHOICE_KEYS))


def deterministic() -> bool:
    """``FUSEDMOE_DETERMINISTIC`` (read when experts and kernels are built)."""
    return flag(DETERMINISTIC)


def check_values(requested: bool = False) -> bool:
    """Whether the data checks run: ``requested``, or ``FUSEDMOE_CHECK_VALUES``."""
    return requested or flag(CHECK_VALUES)


def fuse_act() -> bool:
    """``FUSEDMOE_FUSE_ACT`` (default on; read when the Triton experts are built)."""
    return flag(FUSE_ACT, default=True)


def quant_on_load() -> int | None:
    """``FUSEDMOE_QUANT_ON_LOAD``: None for "auto" or unset (the experts' measured rule, see
    ``experts.triton``), else the number of pairs up to which every call that can does it (0:
    none). Read when the Triton experts are built."""
    return auto_count(QUANT_ON_LOAD)


def w4_dequant() -> int | None:
    """``FUSEDMOE_W4_DEQUANT``: None for "auto" or unset (the measured rule,
    ``experts.thresholds.w4_dequant_from``), else the rows per expert from which 4-bit weights are
    written out in the model dtype for the bf16 GEMMs (0: never). Read when the Triton experts
    are built."""
    return auto_count(W4_DEQUANT)


def fused_routing() -> bool:
    """``FUSEDMOE_FUSED_ROUTING`` (default on)."""
    return flag(FUSED_ROUTING, default=True)


def fast_launch() -> bool:
    """``FUSEDMOE_FAST_LAUNCH`` (default on)."""
    return flag(FAST_LAUNCH, default=True)


def launch_plans() -> bool:
    """``FUSEDMOE_LAUNCH_PLANS`` (default on; read on every eager call, ~1 us)."""
    return flag(LAUNCH_PLANS, default=True)


def w4_ptx() -> bool:
    """``FUSEDMOE_W4_PTX`` (default on; read per 4-bit GEMM launch on the tensor-core path)."""
    return flag(W4_PTX, default=True)


def pdl() -> bool:
    """``FUSEDMOE_PDL`` (default on; read per launch of a kernel that takes it, like
    ``FUSEDMOE_FAST_LAUNCH``)."""
    return flag(PDL, default=True)


def chunk_size() -> int | None:
    """``FUSEDMOE_CHUNK_SIZE``, or None when unset."""
    return positive_int(CHUNK_SIZE)


def check_all() -> None:
    """Parse every variable that changes a kernel, so a bad value is an error when a kernel is
    built even where nothing reads it (``FUSEDMOE_FUSE_ACT=nope`` on a CPU backend)."""
    for name in (DETERMINISTIC, CHECK_VALUES, FUSE_ACT, FUSED_ROUTING, W4_PTX, PDL):
        flag(name)
    chunk_size()
    quant_on_load()
    w4_dequant()


def config_dir() -> Path:
    """The user's folder of tuned launch configs: ``FUSEDMOE_CONFIG_DIR``, else the platform's
    user config folder + ``fusedmoe/configs`` (what platformdirs' user_config_dir gives: Linux
    ``$XDG_CONFIG_HOME`` or ``~/.config``, macOS ``~/Library/Application Support``, Windows
    ``%APPDATA%``). ``fusedmoe tune`` writes there, never into the installed package."""
    v = raw(CONFIG_DIR)
    if v is not None:
        return Path(v).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("APPDATA") or Path.home() / "AppData" / "Roaming")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(raw("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "fusedmoe" / "configs"
