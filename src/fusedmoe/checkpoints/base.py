"""What every checkpoint format shares: reading safetensors, the ``CheckpointFormat`` interface, checks.

A ``CheckpointFormat`` knows how one family of checkpoints stores a Linear (or, for
gpt-oss, all experts fused) and turns those tensors into *pieces* in
fusedmoe's canonical layout, named as ``FusedMoE`` parameters without their
``w13_``/``w2_`` prefix::

    weight               stored values [N, K] (fp8, int8, model dtype) or packed uint8 [N, K/2]
    weight_scale         dequantization multiplier, shape per the scheme's granularity
                         (a scalar for per-tensor scales; e8m0 codes for MXFP4; e4m3 for NVFP4)
    weight_zero_point    uint8 zero codes (int4 with zero points)
    weight_global_scale  NVFP4 second-level dequantization multiplier (a scalar)
    g_idx                int32 [K] act-order groups
    bias                 [N]
    input_scale          static activation scale (dequantization multiplier, a scalar)
    input_global_scale   NVFP4 activation global scale (dequantization multiplier, a scalar)

Each format module documents the facts of its family, where they were
checked, and converts reciprocal conventions (compressed-tensors' NVFP4
global scales) so that every scale is a dequantization multiplier.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterable
from dataclasses import replace
from typing import ClassVar

import torch

from ..errors import FusedMoEError, UnsupportedError, expect
from ..quant import QTensor, QuantScheme, TensorQuant, dequantize

__all__ = ["CheckpointReader", "CheckpointFormat", "check_tensor", "read_config", "require"]

# Optional packages, found once at import (``find_spec`` imports nothing): the extra that brings each
EXTRAS = {"safetensors": "checkpoints", "compressed_tensors": "checkpoints", "transformers": "hf"}
INSTALLED = {name: importlib.util.find_spec(name) is not None for name in EXTRAS}


def require(module: str, what: str) -> None:
    """An error naming the extra to install unless the optional package ``module`` is installed."""
    if not INSTALLED[module]:
        extra = EXTRAS[module]
        raise FusedMoEError(f"{what} needs the package '{module}': pip install 'fusedmoe[{extra}]'")


def read_config(path: str) -> dict:
    """config.json of a checkpoint folder, with a ModelOpt ``hf_quant_config.json`` merged in.

    Older ModelOpt exports keep their quantization settings in
    ``hf_quant_config.json`` ({"producer": {"name": "modelopt"}, "quantization": {...}});
    vLLM reads that file too (``ModelOptQuantConfigBase.get_config_filenames``).
    """
    cfg_path = os.path.join(path, "config.json")
    expect(os.path.isfile(cfg_path), "checkpoint", f"a folder with config.json ({cfg_path} not found)", path)
    config = _read_json(cfg_path)
    extra = os.path.join(path, "hf_quant_config.json")
    if "quantization_config" not in config and os.path.isfile(extra):
        config["quantization_config"] = {"quant_method": "modelopt", **_read_json(extra)}
    return config


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise FusedMoEError(f"{path}: expected a readable JSON file, got {type(err).__name__}: {err}") from None
    expect(isinstance(data, dict), path, "a JSON object", type(data).__name__)
    return data


class CheckpointReader:
    """Lazy access to the tensors of every ``*.safetensors`` file in a folder (one open per file).

    Opening reads each file's header: a truncated or corrupt file (safetensors checks that the
    header's offsets cover the file exactly) is an error naming the file, and a tensor name found
    in two files is an error naming both (one silently won before).
    """

    def __init__(self, path: str, device: str | torch.device = "cpu") -> None:
        require("safetensors", "reading *.safetensors checkpoints")
        from safetensors import safe_open

        expect(os.path.isdir(path), "checkpoint", "a folder with config.json and *.safetensors files", path)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        expect(bool(files), "checkpoint", "at least one *.safetensors file", path)
        self.path = path
        self.device = str(device)
        self._handles = {}
        self._where: dict[str, str] = {}
        for f in files:
            try:
                self._handles[f] = h = safe_open(os.path.join(path, f), framework="pt", device=self.device)
                names = list(h.keys())
            except Exception as err:  # safetensors raises its own SafetensorError (and OSError)
                raise FusedMoEError(f"checkpoint file '{os.path.join(path, f)}': expected a readable safetensors "
                                    f"file, got {type(err).__name__}: {err}") from None  # fmt: skip
            for k in names:
                if k in self._where:
                    raise FusedMoEError(
                        f"checkpoint tensor '{k}': expected in one file, found in both '{self._where[k]}' and "
                        f"'{f}' (in {path})"
                    )
                self._where[k] = f

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, what: str = "") -> torch.Tensor:
        """The tensor ``name``; a missing one is an error naming it (and ``what`` needed it)."""
        if name not in self._where:
            for_what = f" for {what}" if what else ""
            raise FusedMoEError(f"checkpoint tensor '{name}': expected present{for_what} (missing key in {self.path})")
        f = self._where[name]
        try:
            return self._handles[f].get_tensor(name)
        except Exception as err:
            raise FusedMoEError(f"checkpoint tensor '{name}' in '{os.path.join(self.path, f)}': expected readable "
                                f"data, got {type(err).__name__}: {err}") from None  # fmt: skip

    def get_optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._where else None

    def indices(self, prefix: str) -> dict[int, str]:
        """{n: a file holding it} for every integer n with tensors named ``prefix.n.*`` (the experts
        the files hold under ``prefix``, which config.json's expert count must match)."""
        head = prefix + "."
        out: dict[int, str] = {}
        for k, f in self._where.items():
            if k.startswith(head):
                n = k[len(head) :].split(".", 1)[0]
                if n.isdigit():
                    out.setdefault(int(n), f)
        return out

    def check_expert_count(self, prefix: str, num_experts: int) -> None:
        """Raise unless the files hold no numbered experts under ``prefix`` beyond config.json's
        ``num_experts`` (fewer are reported by name when a missing one is read)."""
        extra = sorted(n for n in self.indices(prefix) if n >= num_experts)
        if extra:
            raise FusedMoEError(
                f"config.json: expected its expert count ({num_experts}) to match the checkpoint files, which also "
                f"hold '{prefix}.{extra[0]}.*' ({len(extra)} more experts, e.g. in '{self.indices(prefix)[extra[0]]}'"
                f", {self.path})"
            )

    @contextlib.contextmanager
    def naming(self, key: str):
        """Errors raised inside (a format's conversion, the layer's loader) name the checkpoint
        tensors ``key``.* and their file, not only fusedmoe's internal parameter names."""
        try:
            yield
        except FusedMoEError as err:
            if str(err).startswith(f"checkpoint tensor '{key}"):
                raise
            files = sorted({f for k, f in self._where.items() if k.startswith(key)}) or ["no file"]
            raise type(err)(f"checkpoint tensor '{key}' ({', '.join(files)}): {err}") from None


def check_tensor(
    t: torch.Tensor,
    name: str,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    dims: int | None = None,
) -> torch.Tensor:
    """Raise an error naming the checkpoint tensor unless shape / dtype / rank are as expected."""
    if dims is not None:
        expect(t.dim() == dims, f"checkpoint tensor '{name}'", f"{dims} dims", tuple(t.shape))
    if shape is not None:
        expect(tuple(t.shape) == tuple(shape), f"checkpoint tensor '{name}'", f"shape {tuple(shape)}", tuple(t.shape))
    if dtype is not None:
        ok = t.dtype in dtype if isinstance(dtype, tuple) else t.dtype == dtype
        expect(ok, f"checkpoint tensor '{name}'", f"dtype {dtype}", t.dtype)
    return t


def scalar(t: torch.Tensor, name: str) -> torch.Tensor:
    """A per-tensor scale stored as [], [1] or [1, 1] -> fp32 []."""
    expect(t.numel() == 1, f"checkpoint tensor '{name}'", "a single (per-tensor) value", tuple(t.shape))
    expect(t.is_floating_point(), f"checkpoint tensor '{name}'", "a floating-point scale", t.dtype)
    return t.reshape(()).float()


class CheckpointFormat:
    """One checkpoint family: its QuantScheme and how its tensors become canonical pieces.

    ``linear(reader, path)`` reads the Linear at module ``path`` (its tensors are
    ``{path}.weight``, ``{path}.weight_scale``, ...); ``fused(reader, path, proj)``
    reads all experts of a fused ``*Experts`` module (leading dim E) for
    ``proj`` 'gate_up_proj' or 'down_proj'. ``online`` means the checkpoint is
    in the model dtype and the layer quantizes it after loading.
    """

    name: ClassVar[str] = "format"
    quant_methods: ClassVar[tuple[str, ...]] = ()
    online: bool = False

    def __init__(self, scheme: QuantScheme, quant_config: dict | None = None) -> None:
        self.scheme = scheme
        self.quant_config = quant_config or {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scheme={self.scheme.name!r})"

    @classmethod
    def from_config(cls, quant_config: dict) -> CheckpointFormat:
        raise NotImplementedError

    def layer_scheme(self, hidden: int, intermediate: int) -> QuantScheme:
        """The scheme for a layer of these full sizes (only per-channel int4 depends on them)."""
        return self.scheme

    def for_layer(self, where, hidden: int, intermediate: int) -> CheckpointFormat:
        """The format of one layer (``where``: its ``layout.ExpertLayout``); compressed-tensors
        configs may give each layer its own scheme."""
        return self

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        raise UnsupportedError(f"{self.name} checkpoints: per-expert Linear tensors at '{path}' are not supported")

    def fused(self, reader: CheckpointReader, path: str, proj: str) -> dict[str, torch.Tensor]:
        raise UnsupportedError(
            f"{self.name} checkpoints: experts fused into one tensor per projection ('{path}.{proj}*') "
            "are not a layout this format has"
        )

    def dense(self, reader: CheckpointReader, path: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight [N, K] of a non-expert Linear (a shared expert or the router), dequantized.

        A Linear left unquantized (``ignore`` / ``modules_to_not_convert``) is returned as stored.
        """
        w = reader.get_optional(f"{path}.weight")
        if w is not None and w.is_floating_point() and w.element_size() > 1:
            return w.to(dtype)
        pieces = self.linear(reader, path)
        return dequantize_pieces(pieces, self.scheme.w1, dtype)


def dequantize_pieces(pieces: dict[str, torch.Tensor], tq: TensorQuant | None, dtype: torch.dtype) -> torch.Tensor:
    """Canonical pieces of one Linear -> its real weight [N, K] (for non-expert Linears and tests)."""
    w = pieces["weight"]
    if tq is None:
        return w.to(dtype)
    n = w.shape[0]
    k = w.shape[1] * (2 if w.dtype == torch.uint8 else 1)
    gran = tq.granularity
    if gran.kind == "group" and tq.dtype.fixed_group is None and pieces["weight_scale"].shape[-1] == 1:
        gran = type(gran).group(k)
    scale = pieces["weight_scale"].reshape(1, *gran.scale_shape(n, k))
    zero = pieces.get("weight_zero_point")
    gs = pieces.get("weight_global_scale")
    g_idx = pieces.get("g_idx")
    q = QTensor(
        w.unsqueeze(0),
        (1, n, k),
        scale=scale,
        zero=None if zero is None else zero.reshape(scale.shape),
        global_scale=None if gs is None else gs.reshape(1, 1, 1).float(),
        g_idx=None if g_idx is None else g_idx.reshape(1, k),
    )
    return dequantize(q, replace(tq, granularity=gran), dtype)[0]
