"""Tuned launch configs as data: JSON files per GPU, GEMM shape and scheme.

One file per (GPU, scheme key, E, N, K), written by ``fusedmoe tune``::

    <dir>/<gpu>/<scheme>/E=<E>,N=<N>,K=<K>.json
    {"gpu": "NVIDIA H200", "scheme": "bf16", "E": 128, "N": 1536, "K": 2048,
     "triton": "3.6.0", "torch": "2.11.0+cu130", "date": "2026-11-21",
     "configs": {"1": {"block_m": 16, "block_n": 64, ...}, "64": {...}, ...}}

The keys of ``configs`` are numbers of (token, expert) pairs (T*K for GEMM1 and GEMM2 alike);
a lookup takes the entry whose key is nearest to the call's pair count, so a file
tuned at 1, 16, ..., 16384 serves every T. Directories searched, first hit wins: the
user's folder (``env.config_dir``: ``FUSEDMOE_CONFIG_DIR``, else ~/.config/fusedmoe/configs
or the platform's equivalent; where ``fusedmoe tune`` writes) and then the package's
``configs/`` (shipped files, never written at run time). A file tuned
with another triton version is still used (tile choices carry over between versions far
better than the heuristic guesses); its version is recorded for whoever re-tunes.
Token count never enters the file key (STYLE point 6); it only picks the entry.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from .. import env

PACKAGE_DIR = Path(__file__).resolve().parent / "configs"


def gpu_key(name: str) -> str:
    """A folder name for a device name: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")


def config_path(root: Path | str, gpu: str, scheme: str, e: int, n: int, k: int) -> Path:
    return Path(root) / gpu_key(gpu) / scheme / f"E={e},N={n},K={k}.json"


@functools.lru_cache(maxsize=1)
def current_gpu() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


@functools.lru_cache(maxsize=256)
def _load(path: str) -> dict[int, dict] | None:
    p = Path(path)
    if not p.is_file():
        return None
    with open(p) as f:
        data = json.load(f)
    return {int(m): dict(cfg) for m, cfg in data["configs"].items()}


def search_dirs() -> list[Path]:
    return [env.config_dir(), PACKAGE_DIR]


def lookup(m_pairs: int, e: int, n: int, k: int, scheme: str, gpu: str | None = None) -> dict | None:
    """The fields of the tuned config nearest to ``m_pairs`` for this GEMM on this GPU, or None
    (``launch_config.pick_launch_config`` makes the ``LaunchConfig``)."""
    gpu = gpu or current_gpu()
    if gpu is None:
        return None
    for root in search_dirs():
        table = _load(str(config_path(root, gpu, scheme, e, n, k)))
        if table:
            best = min(table, key=lambda m: (abs(m - m_pairs), m))
            return table[best]
    return None


def clear_cache() -> None:
    """Forget loaded files (after the tuner writes new ones)."""
    _load.cache_clear()
