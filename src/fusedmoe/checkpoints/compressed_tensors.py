"""compressed-tensors checkpoints: ``"quant_method": "compressed-tensors"`` (llm-compressor).

The quantization_config is parsed with the library's own types
(``compressed_tensors.QuantizationConfig`` -> ``QuantizationScheme`` ->
``QuantizationArgs`` for weights and input activations), as transformers'
``CompressedTensorsHfQuantizer`` and vLLM's ``CompressedTensorsConfig`` do. The
scheme whose ``targets`` match the experts' Linear modules is the layer's;
``input_activations`` quantize the inputs of both GEMMs (the down projection's
input is the activation output, so a1 and a2 share the description).

Tensors of each Linear by ``format`` (read from the installed library 0.20:
``compressors/naive_quantized``, ``pack_quantized``, ``nvfp4``, ``mxfp4``)::

    float-quantized / int-quantized / naive-quantized
        weight            fp8 e4m3 or int8 [N, K]
        weight_scale      [1] (tensor), [N, 1] (channel), [N, G] (group), [ceil(N/bn), ceil(K/bk)] (block)
        input_scale       static activations
    pack-quantized (int4; int8 for W8A16)
        weight_packed     int32 [N, ceil(K/8)]   ``pack_to_int32``: code q + 8, element i at bits 4(i % 8)
                          int32 [N, ceil(K/4)]   8 bits: code q + 128, element i at bits 8(i % 4)
        weight_scale      [N, G];  weight_shape int64 [2] = (N, K)
        weight_zero_point int32 [ceil(N/8), G]   asymmetric: zero + 8 packed along N (dim 0)
        weight_g_idx      int32 [K]              act-order "group" (older library versions)
    nvfp4-pack-quantized
        weight_packed     uint8 [N, K/2]         low nibble = even column
        weight_scale      float8_e4m3fn [N, K/16]
        weight_global_scale / input_global_scale fp32 [1]
    mxfp4-pack-quantized
        weight_packed     uint8 [N, K/2];  weight_scale uint8 [N, K/32] (e8m0 exponent + 127)

compressed-tensors' NVFP4 global scales are *quantization* multipliers:
``generate_gparam`` makes 448 * 6 / amax and dequantization divides,
``x = q * scale / global_scale`` (``_quantize_dequantize``: ``scale = scale /
global_scale``). They are inverted here into fusedmoe's dequantization
convention. Symmetric int zero points are not stored (``_remove_symmetric_zp``);
asymmetric ones are signed (``zero = bit_min - min / scale``) and packed with
the same + 8 offset, which is exactly fusedmoe's unsigned zero code.

Which scheme is a layer's: the config group whose ``targets`` match that
layer's expert Linears (llm-compressor writes one group per distinct scheme,
so a mixed per-layer recipe is several groups with layer-specific regexes).

Refused, naming the scheme (checked on llm-compressor 0.14's presets):
W4AFP8 (int4 weights stored as int8, dynamic fp8 activations), MXFP4 with
MXFP4 activations and MXFP8 (``mxfp8-quantized``): fusedmoe computes int4 and
MXFP4 weights only with model-dtype or MXFP8 activations, and MXFP8 is an
activation format only. Loading them as weight-only would silently drop the
activation quantization the model was calibrated with.

Act-order ``"group"`` (a ``weight_g_idx`` per Linear) was removed from
compressed-tensors (0.20 rejects it in ``QuantizationArgs``); configs that still
say so are read by taking that flag off before parsing and keeping the g_idx.
"""

from __future__ import annotations

import copy

import torch

from ..errors import UnsupportedError, expect
from ..quant import Granularity, QDtype, QuantScheme, TensorQuant, all_schemes
from ..quant.int4 import unpack_compressed_tensors
from .base import CheckpointFormat, CheckpointReader, check_tensor, require, scalar

_EXPERT_PROBE = "model.layers.0.mlp.experts.0.gate_proj"
_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_FORMATS += ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
# (weights, activations) dtypes fusedmoe has a backend for; the reason for the others
_REFUSED = {
    (QDtype.INT4, QDtype.FP8): "int4 weights with fp8 activations (W4AFP8): fusedmoe runs int4 weights "
    "only with activations in the model dtype (W4A16)",
    (QDtype.MXFP4, QDtype.MXFP4): "MXFP4 weights with MXFP4 activations (MXFP4): fusedmoe runs MXFP4 weights "
    "with model-dtype or MXFP8 activations only",
}


def _refuse(w1: TensorQuant, a1: TensorQuant | None, fmt: str) -> None:
    if fmt == "mxfp8-quantized":
        raise UnsupportedError(
            "compressed-tensors scheme MXFP8 (format 'mxfp8-quantized', MXFP8 weights): fusedmoe has MXFP8 "
            "only as an activation format"
        )
    why = _REFUSED.get((w1.dtype, None if a1 is None else a1.dtype))
    if why is not None:
        raise UnsupportedError(f"compressed-tensors scheme {w1.short} x {a1.short}: {why}")


def _qdtype(args, where: str) -> QDtype:
    kind, bits, g = args.type, args.num_bits, args.group_size
    if kind == "float" and bits == 8:
        mx = g == 32 and "uint8" in str(getattr(args, "scale_dtype", ""))  # e8m0 scales stored as uint8
        return QDtype.MXFP8 if mx else QDtype.FP8
    if kind == "int" and bits == 8:
        return QDtype.INT8
    if kind == "int" and bits == 4:
        return QDtype.INT4
    if kind == "float" and bits == 4:
        return {16: QDtype.NVFP4, 32: QDtype.MXFP4}.get(g) or _unsupported(where, args)
    return _unsupported(where, args)


def _unsupported(where: str, args) -> QDtype:
    raise UnsupportedError(f"{where}: {args.type} {args.num_bits}-bit (group {args.group_size}) has no fusedmoe format")


def _granularity(args, k: int, where: str, inter: int = 0) -> Granularity:
    s = args.strategy
    if s == "tensor":
        return Granularity.tensor()
    if s == "channel":
        return Granularity.group(k) if args.num_bits == 4 else Granularity.channel()
    if s == "token":
        return Granularity.token()
    if s in ("group", "tensor_group"):
        if args.type == "int" and args.num_bits == 8:  # W8A16: fusedmoe's int8 weights are per channel
            if args.group_size < k:
                raise UnsupportedError(
                    f"compressed-tensors scheme W8A16 (int8 weights in groups of {args.group_size} over K = {k}): "
                    "fusedmoe's int8 weights take one scale per output channel (groups of K or more load)"
                )
            return Granularity.channel()
        return Granularity.group(args.group_size)
    if s == "block":
        bn, bk = args.block_structure
        # gate and up are separate Linears: one W13 block grid needs I whole blocks of rows; an I
        # smaller than a block is one (partial) block per Linear, which is a block of I rows
        return Granularity.block(inter if 0 < inter < bn else bn, bk)
    raise UnsupportedError(f"{where}.strategy: {s!r} is not supported")


def _tensor_quant(args, k: int, where: str, act_order: bool = False, inter: int = 0) -> TensorQuant:
    dyn = args.dynamic
    return TensorQuant(
        _qdtype(args, where),
        _granularity(args, k, where, inter),
        dynamic=bool(dyn) if not isinstance(dyn, str) else dyn in ("local", "true", "True"),
        symmetric=args.symmetric,
        act_order=act_order,
    )


def _unpack_int8(packed: torch.Tensor, k: int) -> torch.Tensor:
    """``pack_to_int32`` with 8 bits: int32 [N, ceil(K/4)], element i at bits 8(i % 4), code q + 128."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=packed.device)
    codes = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF
    return (codes.flatten(-2)[:, :k] - 128).to(torch.int8)


class CompressedTensorsFormat(CheckpointFormat):
    name = "compressed-tensors"
    quant_methods = ("compressed-tensors",)

    @classmethod
    def from_config(cls, qc: dict) -> CompressedTensorsFormat:
        require("compressed_tensors", "a compressed-tensors checkpoint (quant_method 'compressed-tensors')")
        from compressed_tensors.quantization import QuantizationConfig

        qc = copy.deepcopy(qc)
        act_order = False
        for group in qc.get("config_groups", {}).values():
            w = group.get("weights") if isinstance(group, dict) else None
            if isinstance(w, dict) and w.get("actorder") in ("group", "dynamic", True):
                act_order = True
                w.pop("actorder")
        fields = set(QuantizationConfig.model_fields)
        config = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in fields})
        fmt = cls(QuantScheme.unquantized(), qc)
        fmt.ct_config, fmt.act_order = config, act_order
        return fmt.for_module(_EXPERT_PROBE)

    def for_module(self, path: str, hidden: int = 0, intermediate: int = 0) -> CompressedTensorsFormat:
        """This format with the config group whose targets match the expert Linear at ``path``."""
        from compressed_tensors.utils.match import match_name

        schemes = list(self.ct_config.config_groups.values())
        hits = [s for s in schemes if any(t == "Linear" or match_name(path, t) for t in s.targets)]
        expect(len(hits) >= 1, "quantization_config.config_groups", f"a scheme whose targets match '{path}'")
        narrow = [s for s in hits if any(t != "Linear" for t in s.targets)]
        scheme = (narrow or hits)[0]
        expect(scheme.weights is not None, "quantization_config config_groups weights", "quantized expert weights")
        fmt = copy.copy(self)
        fmt.ct_scheme, fmt.format = scheme, scheme.format or self.ct_config.format
        expect(
            fmt.format in _FORMATS + ("mxfp8-quantized",),
            "quantization_config.format",
            f"one of {_FORMATS}",
            fmt.format,
        )
        fmt.scheme = fmt.layer_scheme(hidden, intermediate)
        return fmt

    def for_layer(self, where, hidden: int, intermediate: int) -> CompressedTensorsFormat:
        first = next(iter(where.linears.values()))[0][1] if where.linears else where.experts_path
        return self.for_module(first, hidden, intermediate)

    def layer_scheme(self, hidden: int, intermediate: int) -> QuantScheme:
        """fusedmoe's scheme for the expert scheme; a named one where it is the same."""
        w, a = self.ct_scheme.weights, self.ct_scheme.input_activations
        where = "compressed-tensors weights"
        w1 = _tensor_quant(w, hidden or 128, where, self.act_order, intermediate)
        w2 = _tensor_quant(w, intermediate or 128, where, self.act_order, intermediate)
        a1 = a2 = None if a is None else _tensor_quant(a, 0, "compressed-tensors input_activations")
        _refuse(w1, a1, self.format)
        for s in all_schemes():
            if (s.a1, s.w1, s.a2, s.w2) == (a1, w1, a2, w2):
                return s
        return QuantScheme(name=f"ct_{w1.short}" + (f"_{a1.short}" if a1 else ""), a1=a1, w1=w1, a2=a2, w2=w2)

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        w1 = self.scheme.w1
        if self.format == "pack-quantized":
            out = self._packed_int(reader, path)
        elif self.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            out = self._fp4(reader, path)
        else:
            wname, sname = f"{path}.weight", f"{path}.weight_scale"
            want = torch.float8_e4m3fn if w1.dtype is QDtype.FP8 else torch.int8
            w = check_tensor(reader.get(wname), wname, dims=2, dtype=want)
            s = reader.get(sname, f"the scale of {wname}")
            if w1.granularity.kind == "tensor":
                s = scalar(s, sname)
            else:
                n, k = w.shape
                shape = w1.granularity.scale_shape(n, k)
                s = check_tensor(s.reshape(shape) if s.numel() == shape[0] * shape[1] else s, sname, shape=shape)
            expect(w1.symmetric, f"checkpoint tensor '{path}.weight_zero_point'", "absent (symmetric int8/fp8 only)")
            out = {"weight": w, "weight_scale": s.float()}
        a = self.scheme.a1
        if a is not None and not a.dynamic:
            iname = f"{path}.input_scale"
            out["input_scale"] = scalar(reader.get(iname, f"the static input scale of {path}"), iname)
        return out

    def _packed_int(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        pname, sname, shname = f"{path}.weight_packed", f"{path}.weight_scale", f"{path}.weight_shape"
        packed = check_tensor(reader.get(pname), pname, dims=2, dtype=torch.int32)
        shape = reader.get(shname, f"the logical shape of {pname}")
        expect(shape.numel() == 2, f"checkpoint tensor '{shname}'", "2 values (N, K)", tuple(shape.shape))
        n, k = (int(v) for v in shape.tolist())
        w1 = self.scheme.w1
        per_word = 32 // w1.dtype.bits
        check_tensor(packed, pname, shape=(n, -(-k // per_word)))
        g = w1.granularity.group_size if w1.granularity.kind == "group" else k
        if w1.dtype is QDtype.INT8:
            s = reader.get(sname, f"the scales of {pname}")
            s = check_tensor(s, sname, shape=w1.granularity.scale_shape(n, k))
            expect(w1.symmetric, f"checkpoint tensor '{path}.weight_zero_point'", "absent (symmetric 8-bit only)")
            return {"weight": _unpack_int8(packed, k), "weight_scale": s.float()}
        scale = check_tensor(reader.get(sname, f"the scales of {pname}"), sname, shape=(n, -(-k // g)))
        zname, gname = f"{path}.weight_zero_point", f"{path}.weight_g_idx"
        zero = None
        if not w1.symmetric:
            zero = check_tensor(reader.get(zname, "asymmetric int4"), zname, shape=(-(-n // 8), scale.shape[1]))
        g_idx = reader.get_optional(gname)
        if g_idx is not None:
            check_tensor(g_idx, gname, shape=(k,))
        q = unpack_compressed_tensors(packed, scale, (n, k), zero, g_idx)
        out = {"weight": q.data, "weight_scale": q.scale}
        if q.zero is not None:
            out["weight_zero_point"] = q.zero
        if q.g_idx is not None:
            expect(self.act_order, gname, "the identity k // group_size (the config has no act-order)")
            out["g_idx"] = q.g_idx
        return out

    def _fp4(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        pname, sname = f"{path}.weight_packed", f"{path}.weight_scale"
        packed = check_tensor(reader.get(pname), pname, dims=2, dtype=torch.uint8)
        n, k = packed.shape[0], 2 * packed.shape[1]
        g = self.scheme.w1.granularity.group_size
        s = check_tensor(reader.get(sname, f"the scales of {pname}"), sname, shape=(n, k // g))
        out = {"weight": packed}
        if self.scheme.w1.dtype is QDtype.MXFP4:
            out["weight_scale"] = check_tensor(s, sname, dtype=torch.uint8)
            return out
        out["weight_scale"] = check_tensor(s, sname, dtype=torch.float8_e4m3fn)
        gname = f"{path}.weight_global_scale"
        out["weight_global_scale"] = 1.0 / scalar(reader.get(gname, f"the global scale of {pname}"), gname)
        if self.scheme.a1 is not None:
            iname = f"{path}.input_global_scale"
            out["input_global_scale"] = 1.0 / scalar(reader.get(iname, f"the input global scale of {path}"), iname)
        return out
