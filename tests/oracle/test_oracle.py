"""The backend oracle: every family on every simulated platform, with and without the optional
packages; explicit requests; the activation precision a backend implies; padding and weight
conversions that round-trip; the error when nothing fits; ``fusedmoe explain``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusedmoe.cli import main as cli_main
from fusedmoe.config import MoEConfig
from fusedmoe.contract import TokenLayout
from fusedmoe.env import BACKEND as ENV_BACKEND
from fusedmoe.env import FAMILIES
from fusedmoe.env import SKIP_BACKENDS as ENV_SKIP
from fusedmoe.env import family_backend as family_env
from fusedmoe.errors import FusedMoEError, UnsupportedError
from fusedmoe.experts import external, thresholds
from fusedmoe.experts.grouped_mm import GroupedMMExperts
from fusedmoe.modular.validation import check_weights
from fusedmoe.oracle import registry, select_experts
from fusedmoe.oracle.padding import pad_hidden, pad_weights, padded_config, padded_sizes, unpad_weights
from fusedmoe.oracle.priorities import BATCHED, STANDARD, family_variant, platform_class
from fusedmoe.platform import OPTIONAL_PACKAGES, Platform
from fusedmoe.quant import QuantScheme, all_schemes, dequantize
from fusedmoe.quant.scheme import shape_supported
from fusedmoe.testing import make_problem, rel_error

STD, BAT = TokenLayout.STANDARD, TokenLayout.BATCHED
PLATFORMS = ("sm80", "sm89", "sm90", "sm100", "gfx942", "gfx950", "cpu")
ALL_PACKAGES = tuple(OPTIONAL_PACKAGES)
SCHEMES = {s.name: s for s in all_schemes()}
# one scheme per table row (family variant)
VARIANTS = {
    "unquantized": "bf16",
    "fp8": "fp8_channel",
    "fp8_block": "fp8_block",
    "int8": "int8_w8a8_channel",
    "wna16": "int4_g128",
    "mxfp4": "mxfp4",
    "nvfp4": "nvfp4",
}
CUDA = ("sm80", "sm89", "sm90", "sm100")
# The choice per (variant, platform): the adapters are declared only, so packages do not change
# it; None = nothing fits. Our triton has no ROCm declaration (not yet run on an AMD GPU).
_ROCM_NONE = {"gfx942": None, "gfx950": None, "cpu": "cpu"}
EXPECTED = {
    "unquantized": dict.fromkeys(CUDA, "triton") | _ROCM_NONE,
    "fp8": {"sm80": None, "sm89": "triton", "sm90": "triton", "sm100": "triton"} | _ROCM_NONE,
    "fp8_block": {"sm80": None, "sm89": "triton", "sm90": "triton", "sm100": "triton"} | _ROCM_NONE,
    "int8": dict.fromkeys(CUDA, "triton") | _ROCM_NONE,
    "wna16": dict.fromkeys(CUDA, "triton") | _ROCM_NONE,
    "mxfp4": dict.fromkeys(CUDA, "triton") | _ROCM_NONE,
    "nvfp4": dict.fromkeys(CUDA, "triton") | _ROCM_NONE,
}

# Key words of the reason each candidate gives: (variant, platform) -> backend -> (no packages, all packages)
PKG = "package '{}' is not installed"
DECL = "declared only"
REASONS = {
    ("mxfp4", "sm100"): {
        "trtllm": (PKG.format("flashinfer"), DECL),
        "flashinfer_cutlass": (PKG.format("flashinfer"), DECL),
        "oai_triton": (PKG.format("triton_kernels"), DECL),
        "marlin": (PKG.format("vllm"), DECL),
        "aiter": ("platform sm100 not supported",) * 2,
        "grouped_mm": ("scheme mxfp4 not supported",) * 2,
        "reference": ("not taken automatically on sm100",) * 2,
    },
    ("mxfp4", "sm90"): {
        "trtllm": ("compute capability sm100+",) * 2,
        "flashinfer_cutlass": (PKG.format("flashinfer"), DECL),
        "oai_triton": (PKG.format("triton_kernels"), DECL),
    },
    ("mxfp4", "gfx942"): {"aiter": ("needs gfx950",) * 2, "triton": ("platform rocm not supported",) * 2},
    ("mxfp4", "gfx950"): {"aiter": (PKG.format("aiter"), DECL)},
    ("mxfp4", "cpu"): {"marlin": ("platform cpu not supported",) * 2, "loop": ("not taken automatically",) * 2},
    ("fp8_block", "sm90"): {
        "deep_gemm": (PKG.format("deep_gemm"), DECL),
        "flashinfer_cutlass": (PKG.format("flashinfer"), DECL),
        "grouped_mm": ("scheme fp8_block not supported",) * 2,
        "cutlass_fp8": ("scheme fp8_block not supported",) * 2,
    },
    ("fp8_block", "sm100"): {"trtllm": (PKG.format("flashinfer"), DECL), "deep_gemm": (PKG.format("deep_gemm"), DECL)},
    ("fp8_block", "sm80"): {"triton": ("fp8 tensor cores (sm89+)",) * 2, "deep_gemm": ("sm90+",) * 2},
    ("fp8", "sm90"): {
        "cutlass_fp8": (PKG.format("vllm"), DECL),
        "deep_gemm": ("scheme fp8_channel not supported",) * 2,
        "flashinfer_cutlass": ("scheme fp8_channel not supported",) * 2,
    },
    ("fp8", "sm100"): {"grouped_mm": ("sm90 only",) * 2, "trtllm": ("scheme fp8_channel not supported",) * 2},
    ("fp8", "sm80"): {"triton": ("fp8 tensor cores (sm89+)",) * 2, "marlin": ("scheme fp8_channel",) * 2},
    ("fp8", "cpu"): {"grouped_mm": ("CUDA only",) * 2},
    ("nvfp4", "sm90"): {
        "marlin": (PKG.format("vllm"), DECL),
        "flashinfer_cutlass": ("FP4 tensor cores (sm100+)",) * 2,
        "cutlass_fp4": ("sm100+",) * 2,
    },
    ("nvfp4", "sm100"): {"cutlass_fp4": (PKG.format("vllm"), DECL), "trtllm": (PKG.format("flashinfer"), DECL)},
    ("wna16", "sm90"): {"marlin": (PKG.format("vllm"), DECL), "grouped_mm": ("scheme int4_g128 not supported",) * 2},
    ("wna16", "gfx942"): {"marlin": ("platform rocm not supported",) * 2},
    ("unquantized", "sm90"): {
        "grouped_mm": (None, None),
        "flashinfer_cutlass": (PKG.format("flashinfer"), DECL),
        "oai_triton": ("activation silu not supported",) * 2,
        "reference": ("not taken automatically on sm90",) * 2,
        "loop": ("not taken automatically on sm90",) * 2,
    },
    ("unquantized", "sm80"): {"grouped_mm": ("sm90+",) * 2},
    ("unquantized", "gfx942"): {"aiter": (PKG.format("aiter"), DECL), "triton": ("platform rocm",) * 2},
    ("unquantized", "cpu"): {"grouped_mm": (None, None), "reference": (None, None)},
    ("int8", "sm90"): {"grouped_mm": ("scheme int8_w8a8_channel not supported",) * 2},
}


def _config(variant: str) -> MoEConfig:
    if variant == "mxfp4":  # gpt-oss-like, so the MXFP4 adapters' activation fits
        return MoEConfig(8, 2, 1024, 512, activation="swigluoai", has_bias=True, gate_up_interleaved=True)
    return MoEConfig(8, 2, 1024, 512)


def _arch_rule(monkeypatch, family: str, rule) -> None:
    """Make the sm90 row apply to the simulated sm90 platform (an H100 by name, whose own row
    would win over its arch's)."""
    monkeypatch.delitem(thresholds.GROUPED_MM_CROSSOVER, (Platform.simulated("sm90").name, family), raising=False)
    monkeypatch.setitem(thresholds.GROUPED_MM_CROSSOVER, ("sm90", family), rule)


def _select(variant, label, packages=(), **kw):
    plat = Platform.simulated(label).with_packages(*packages)
    return select_experts(_config(variant), SCHEMES[VARIANTS[variant]], platform=plat, **kw)


def _outcome(variant, label, packages=(), layout=STD):
    """(chosen backend or None, {name: reason}) whether or not anything fits."""
    try:
        c = _select(variant, label, packages, layout=layout)
    except UnsupportedError as e:
        text = str(e)
        names = [n for n, cls in registry.experts_backends().items() if cls.layout is layout]
        assert "no backend can run this configuration" in text
        assert all(f" {n}" in text for n in names), "the error lists every candidate"
        plat = Platform.simulated(label).with_packages(*packages)
        reasons = {}
        for n in names:
            cls = registry.get_experts(n)
            reasons[n] = cls.why_not(_config(variant), cls.activation_scheme(SCHEMES[VARIANTS[variant]], plat), plat)
        return None, reasons
    return c.backend, dict(c.verdicts)


CELLS = [(v, p) for v in VARIANTS for p in PLATFORMS]


@pytest.mark.parametrize("variant,label", CELLS, ids=[f"{v}-{p}" for v, p in CELLS])
@pytest.mark.parametrize("with_packages", [False, True], ids=["bare", "all_packages"])
def test_choice_and_reasons_per_family_and_platform(variant, label, with_packages):
    assert family_variant(SCHEMES[VARIANTS[variant]]) == variant
    chosen, reasons = _outcome(variant, label, ALL_PACKAGES if with_packages else ())
    assert chosen == EXPECTED[variant][label]
    for name, keys in REASONS.get((variant, label), {}).items():
        key = keys[1] if with_packages else keys[0]
        if key is None:
            assert reasons[name] is None, f"{name}: {reasons[name]}"
        else:
            assert reasons[name] is not None and key in reasons[name], f"{name}: {reasons[name]!r} lacks {key!r}"


@pytest.mark.parametrize("variant,label", CELLS, ids=[f"{v}-{p}" for v, p in CELLS])
def test_declared_adapters_give_a_precise_reason(variant, label):
    """Every declared-only adapter refuses everywhere; where only its absence stops it, the bare
    platform names the package and the full one says 'declared only'."""
    config, scheme = _config(variant), SCHEMES[VARIANTS[variant]]
    bare, full = Platform.simulated(label), Platform.simulated(label).with_packages(*ALL_PACKAGES)
    adapters = [c for c in registry.experts_backends().values() if not c.capabilities.implemented]
    assert {c.name for c in adapters} >= {"deep_gemm", "flashinfer_cutlass", "trtllm", "marlin", "aiter", "pallas"}
    for cls in adapters:
        why_full = cls.why_not(config, cls.activation_scheme(scheme, full), full)
        why_bare = cls.why_not(config, cls.activation_scheme(scheme, bare), bare)
        assert why_full and why_bare, cls.name
        if why_full.startswith(DECL):
            assert why_bare == f"package '{cls.capabilities.packages[0]}' is not installed " + (
                f"({OPTIONAL_PACKAGES[cls.capabilities.packages[0]]})"
            )
        else:
            assert why_full == why_bare, f"{cls.name}: a permanent reason does not depend on packages"


@pytest.mark.parametrize("label", PLATFORMS)
def test_batched_layout(label):
    chosen, reasons = _outcome("wna16", label, ALL_PACKAGES, layout=BAT)
    assert chosen == {"cpu": "reference_batched"}.get(label, None if label.startswith("gfx") else "triton_batched")
    if label in CUDA:
        assert reasons["marlin_batched"].startswith(DECL)


def test_tables_name_only_known_backends_and_every_platform_class():
    known = set(registry.experts_backends())
    for table in (STANDARD, BATCHED):
        for variant, per_class in table.items():
            assert variant in VARIANTS
            for names in per_class.values():
                assert set(names) <= known, set(names) - known
    for variant in VARIANTS:
        assert {platform_class(Platform.simulated(p)) for p in PLATFORMS} <= set(STANDARD[variant])
    assert set(FAMILIES) == {SCHEMES[VARIANTS[v]].family for v in VARIANTS}


def test_platform_arch_and_class():
    got = {p: (Platform.simulated(p).arch, platform_class(Platform.simulated(p))) for p in PLATFORMS + ("tpu",)}
    assert got["gfx942"] == ("gfx942", "gfx942") and got["gfx950"] == ("gfx950", "gfx950")
    assert got["sm89"] == ("sm89", "sm89") and got["sm100"] == ("sm100", "sm100") and got["tpu"] == ("tpu", "tpu")


# ---- explicit requests -------------------------------------------------------------------------


def test_argument_is_honored_even_where_auto_would_not_take_it(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    c = _select("unquantized", "sm90", backend="grouped_mm")
    assert c.backend == "grouped_mm" and c.source == "argument" and c.verdicts == [("grouped_mm", None)]
    c = _select("unquantized", "sm90", backend="reference")  # never auto on a GPU, honored by name
    assert c.backend == "reference"


def test_refused_request_is_never_replaced():
    with pytest.raises(UnsupportedError) as e:
        _select("fp8_block", "sm90", backend="deep_gemm")  # triton would fit; it is not substituted
    text = str(e.value)
    assert "backend 'deep_gemm' (argument) cannot run this" in text and "package 'deep_gemm'" in text
    assert "triton" not in text.split("\n", 1)[1]
    with pytest.raises(UnsupportedError, match="quantization scheme bf16 not supported"):
        _select("unquantized", "sm90", ALL_PACKAGES, backend="deep_gemm")


def test_env_vars_family_first_then_global_then_argument_over_both(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "triton")
    monkeypatch.setenv(family_env("fp8"), "grouped_mm")
    c = _select("fp8", "sm90")
    assert (c.backend, c.source) == ("grouped_mm", "FUSEDMOE_FP8_BACKEND")
    c = _select("unquantized", "sm90")
    assert (c.backend, c.source) == ("triton", ENV_BACKEND)
    c = _select("fp8", "sm90", backend="triton")
    assert (c.backend, c.source) == ("triton", "argument")
    monkeypatch.setenv(family_env("fp8"), "auto")
    monkeypatch.setenv(ENV_BACKEND, "auto")
    assert _select("fp8", "sm90").requested is None


def test_env_request_refused_with_reason_and_source(monkeypatch):
    monkeypatch.setenv(family_env("mxfp4"), "trtllm")
    with pytest.raises(UnsupportedError, match=r"'trtllm' \(FUSEDMOE_MXFP4_BACKEND\).*compute capability sm100\+"):
        _select("mxfp4", "sm90")
    monkeypatch.setenv(family_env("mxfp4"), "no_such_backend")
    with pytest.raises(FusedMoEError, match=r"backend \(from FUSEDMOE_MXFP4_BACKEND\): expected one of"):
        _select("mxfp4", "sm90")


def test_standard_request_under_batched_layout_maps_to_its_twin():
    c = _select("unquantized", "sm90", backend="triton", layout=BAT)
    assert c.backend == "triton_batched" and "batched twin" in c.explain()
    with pytest.raises(UnsupportedError) as e:
        _select("fp8_block", "sm90", backend="deep_gemm", layout=BAT)
    assert "deep_gemm_batched" in str(e.value)
    with pytest.raises(UnsupportedError, match="token layout batched not supported"):
        _select("unquantized", "sm90", backend="grouped_mm", layout=BAT)  # no twin: refused, not replaced


def test_skip_list_and_the_next_candidate(monkeypatch):
    monkeypatch.setenv(ENV_SKIP, "triton, flashinfer_cutlass")
    c = _select("unquantized", "sm90")
    assert c.backend == "grouped_mm" and dict(c.verdicts)["triton"] == f"skipped ({ENV_SKIP})"


# ---- the shape rule between triton and grouped_mm -----------------------------------------------


def test_shape_rule_defaults_to_triton(monkeypatch):
    _arch_rule(monkeypatch, "unquantized", None)
    c = _select("unquantized", "sm90", num_tokens=100_000)
    assert c.backend == "triton" and "no measured crossover for sm90 unquantized" in c.explain()
    assert dict(c.verdicts)["triton_or_grouped_mm"].startswith("no triton/grouped_mm crossover")


@pytest.mark.parametrize(
    "gpu, who",
    [
        pytest.param("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", id="h100"),
        pytest.param("NVIDIA H200", "NVIDIA H200", id="h200"),
        pytest.param("NVIDIA H800", "sm90", id="other-sm90"),
    ],
)
def test_shipped_sm90_rows_pick_triton_at_prefill(gpu, who):
    """The shipped sm90 rows (an H100 and an H200 measured with the persistent kernel, and the
    arch row for other sm90 GPUs): triton first at every size, Mixtral's wide experts at
    T = 16384 included; the explanation names the row that decided."""
    import dataclasses

    wide = MoEConfig(8, 2, 4096, 14336)
    gpu_platform = dataclasses.replace(Platform.simulated("sm90"), name=gpu)
    for sname in ("bf16", "fp8_tensor"):
        c = select_experts(wide, QuantScheme.by_name(sname), platform=gpu_platform, num_tokens=16384)
        assert c.backend == "triton", c.explain()
        assert f"triton was faster at every size measured on {who}" in c.explain()


def test_measured_crossover_picks_the_per_call_backend(monkeypatch):
    for family in ("unquantized", "fp8"):
        rule = thresholds.Crossover(tokens_per_expert=64, min_intermediate_size=8192)
        _arch_rule(monkeypatch, family, rule)
    wide = MoEConfig(8, 2, 4096, 14336)
    plat = Platform.simulated("sm90")
    for scheme in (QuantScheme.unquantized(), QuantScheme.by_name("fp8_tensor")):
        assert select_experts(wide, scheme, platform=plat).backend == "triton_or_grouped_mm"
    block = select_experts(wide, QuantScheme.by_name("fp8_block"), platform=plat)
    assert block.backend != "triton_or_grouped_mm"
    assert "scheme fp8_block not supported" in dict(block.verdicts)["triton_or_grouped_mm"]
    narrow = select_experts(MoEConfig(128, 8, 2048, 768), QuantScheme.unquantized(), platform=plat)
    assert narrow.backend == "triton"
    assert "at I=768" in dict(narrow.verdicts)["triton_or_grouped_mm"]
    sm80 = select_experts(wide, QuantScheme.unquantized(), platform=Platform.simulated("sm80"))
    assert sm80.backend == "triton"


def test_shape_rule_uses_the_table(monkeypatch):
    rule = thresholds.Crossover(tokens_per_expert=64, min_intermediate_size=512)
    _arch_rule(monkeypatch, "unquantized", rule)
    # E=8, K=2: 256 tokens = 64 per expert
    below = _select("unquantized", "sm90", num_tokens=255)
    assert below.backend == "triton_or_grouped_mm" and "triton before grouped_mm (63.75 tokens" in below.explain()
    c = _select("unquantized", "sm90", num_tokens=256)
    assert c.backend == "triton_or_grouped_mm" and "grouped_mm before triton (64 tokens per expert" in c.explain()
    monkeypatch.setenv(ENV_SKIP, "triton_or_grouped_mm")  # without it, the static order follows the rule
    assert _select("unquantized", "sm90", num_tokens=255).backend == "triton"
    assert _select("unquantized", "sm90", num_tokens=256).backend == "grouped_mm"
    monkeypatch.delenv(ENV_SKIP)
    # no token count: the per-call backend applies the same rule at run time
    assert _select("unquantized", "sm90").backend == "triton_or_grouped_mm"
    assert _select("unquantized", "sm80", num_tokens=4096).backend == "triton"  # grouped_mm refuses sm80
    narrow = select_experts(
        MoEConfig(8, 2, 1024, 256), QuantScheme.unquantized(), platform=Platform.simulated("sm90"), num_tokens=4096
    )
    assert narrow.backend == "triton" and "I=256 < 512" in narrow.explain()


# ---- activation precision implied by a backend --------------------------------------------------


def _written(monkeypatch, cls):
    monkeypatch.setattr(cls, "capabilities", replace(cls.capabilities, implemented=True))


def test_trtllm_runs_mxfp4_with_mxfp8_activations_and_pads(monkeypatch):
    _written(monkeypatch, external.TrtLlmExperts)
    config = MoEConfig(32, 4, 2880, 2880, activation="swigluoai", has_bias=True, gate_up_interleaved=True)
    plat = Platform.simulated("sm100", ("flashinfer",))
    c = select_experts(config, QuantScheme.mxfp4_w4a16(), platform=plat)
    assert c.backend == "trtllm" and c.effective_scheme.name == "mxfp4_mxfp8"
    assert c.align == (256, 256) and c.padded == (3072, 3072)
    text = c.explain()
    assert "runs as mxfp4_mxfp8" in text and "H 2880 -> 3072, I 2880 -> 3072" in text
    # without the package the same request falls to triton, bf16 activations, no padding
    c = select_experts(config, QuantScheme.mxfp4_w4a16(), platform=Platform.simulated("sm100"))
    assert c.backend == "triton" and c.effective_scheme.name == "mxfp4" and c.padded == (2880, 2880)


@pytest.mark.parametrize(
    "label,backend,scheme,effective",
    [
        ("sm90", "flashinfer_cutlass", "mxfp4", "mxfp4"),
        ("sm90", "flashinfer_cutlass", "mxfp4_mxfp8", "mxfp4"),
        ("sm100", "flashinfer_cutlass", "mxfp4", "mxfp4_mxfp8"),
        ("sm90", "marlin", "nvfp4", "nvfp4_w4a16"),
        ("sm90", "marlin", "mxfp4_mxfp8", "mxfp4"),
        ("sm90", "oai_triton", "mxfp4_mxfp8", "mxfp4"),
    ],
)
def test_backend_fixes_the_activation_precision(monkeypatch, label, backend, scheme, effective):
    cls = registry.get_experts(backend)
    _written(monkeypatch, cls)
    config = MoEConfig(8, 2, 1024, 512, activation="swigluoai", has_bias=True, gate_up_interleaved=True)
    plat = Platform.simulated(label, tuple(OPTIONAL_PACKAGES))
    c = select_experts(config, SCHEMES[scheme], platform=plat, backend=backend)
    assert c.effective_scheme.name == effective


def test_implied_activations_never_change_the_weights():
    for cls in registry.experts_backends().values():
        for label in PLATFORMS:
            for s in all_schemes():
                eff = cls.activation_scheme(s, Platform.simulated(label))
                assert (eff.w1, eff.w2) == (s.w1, s.w2), f"{cls.name} on {label}: {s.name} -> {eff.name}"


# ---- padding ------------------------------------------------------------------------------------

# the three W13 row layouts: [gate; up] (rows move apart), interleaved (gpt-oss), non-gated
ACTS = [
    ("silu", dict(has_bias=True)),
    ("swigluoai", dict(activation="swigluoai", has_bias=True, gate_up_interleaved=True)),
    ("gelu_no_mul", dict(activation="gelu_no_mul", has_bias=True)),
]
PAD_CASES = [(s, a) for s in SCHEMES for a in ACTS]


def _same_weights(a, b) -> None:
    for f in ("w13", "w2"):
        qa, qb = getattr(a, f), getattr(b, f)
        assert qa.shape == qb.shape, f
        ta, tb = qa.tensors(), qb.tensors()
        assert ta.keys() == tb.keys(), f
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, (f, k)
            assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), (f, k)
    for f in ("b13", "b2", "a1_scale", "a2_scale", "a1_global_scale", "a2_global_scale"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or torch.equal(x, y), f
    assert a.layout == b.layout


@pytest.mark.parametrize("sname,act", PAD_CASES, ids=[f"{s}-{a[0]}" for s, a in PAD_CASES])
def test_padding_leaves_the_output_unchanged_and_round_trips(sname, act):
    scheme = SCHEMES[sname]
    config = MoEConfig(5, 2, 384, 128, **act[1])  # multiples of 128: every group and block scheme fits
    align = (256, 256)
    prob = make_problem(config, scheme, 7, seed=len(sname))
    padded = pad_weights(prob.weights, config, scheme, align)
    pconfig = padded_config(config, align)
    assert padded_sizes(config, align) == (512, 256) and pconfig.w13_rows in (512, 256)
    check_weights(padded, pconfig, scheme)
    # the original values are where they were, the new ones exactly zero
    w13, w2 = prob.weights.dequantized(scheme, torch.float64)
    p13, p2 = padded.dequantized(scheme, torch.float64)
    rows = torch.arange(config.w13_rows)
    if config.activation.is_gated and not config.gate_up_interleaved:
        rows = torch.where(rows < 128, rows, rows + 128)
    assert torch.equal(p13[:, rows, :384], w13) and torch.equal(p2[:, :384, :128], w2)
    p13[:, rows, :384] = 0
    p2[:, :384, :128] = 0
    assert not p13.any() and not p2.any()
    # the layer's output: the reference of the padded problem, cut back to H
    from fusedmoe.experts.reference import moe_reference

    out = moe_reference(pad_hidden(prob.x, 512), prob.topk_ids, prob.topk_weights, padded, pconfig, scheme)
    ref = prob.reference()
    assert out[:, 384:].abs().max() == 0
    assert rel_error(out[:, :384], ref) <= 1e-12
    _same_weights(unpad_weights(padded, config, scheme), prob.weights)


ODD = [s for s in SCHEMES if shape_supported(SCHEMES[s], 71, 37) is None and "block" not in s]


@pytest.mark.parametrize("sname", ODD)
def test_padding_odd_sizes(sname):
    scheme, config, align = SCHEMES[sname], MoEConfig(5, 2, 71, 37), (64, 128)
    prob = make_problem(config, scheme, 6, seed=3)
    padded = pad_weights(prob.weights, config, scheme, align)
    from fusedmoe.experts.reference import moe_reference

    out = moe_reference(
        pad_hidden(prob.x, 128), prob.topk_ids, prob.topk_weights, padded, padded_config(config, align), scheme
    )
    assert rel_error(out[:, :71], prob.reference()) <= 1e-12
    _same_weights(unpad_weights(padded, config, scheme), prob.weights)


def test_padding_refuses_block_scales_split_by_moved_up_rows():
    scheme = QuantScheme.fp8_block()
    config = MoEConfig(4, 2, 256, 192)  # I = 1.5 blocks: the up rows would leave their block scale
    prob = make_problem(config, scheme, 3)
    with pytest.raises(FusedMoEError, match="weights.w13: expected rows that move in whole blocks of 128"):
        pad_weights(prob.weights, config, scheme, (1, 256))


def test_no_padding_returns_the_same_weights():
    config, scheme = MoEConfig(4, 2, 256, 128), QuantScheme.mxfp4_w4a16()
    prob = make_problem(config, scheme, 3)
    assert pad_weights(prob.weights, config, scheme, (128, 128)) is prob.weights


# ---- weight conversions -------------------------------------------------------------------------

CONVERSIONS = [
    (name, s)
    for name, cls in sorted(registry.experts_backends().items())
    if cls.capabilities.implemented
    for s in SCHEMES
    if s in cls.capabilities.schemes
]


@pytest.mark.parametrize("backend,sname", CONVERSIONS, ids=[f"{b}-{s}" for b, s in CONVERSIONS])
def test_weight_conversion_round_trips(backend, sname):
    config = MoEConfig(3, 2, 128, 128, activation="swigluoai", has_bias=True, gate_up_interleaved=True)
    scheme = SCHEMES[sname]
    prob = make_problem(config, scheme, 2, seed=11)
    experts = registry.get_experts(backend)(config, scheme)
    converted = experts.prepare_weights(prob.weights)
    _same_weights(experts.restore_weights(converted), prob.weights)


@pytest.mark.parametrize("sname", ["bf16", "fp8_tensor", "fp8_channel"])
def test_grouped_mm_layout_is_the_b_operand(sname):
    config, scheme = MoEConfig(3, 2, 128, 64), SCHEMES[sname]
    prob = make_problem(config, scheme, 2)
    w = GroupedMMExperts(config, scheme).prepare_weights(prob.weights)
    assert w.layout == "grouped_mm"
    assert tuple(w.w13.data.shape) == (3, 128, 128) and tuple(w.w2.data.shape) == (3, 64, 128)
    assert w.w13.data.stride(1) == 1  # K contiguous: the reference storage, not a copy
    assert w.w13.data.data_ptr() == prob.weights.w13.data.data_ptr()
    if scheme.w1 is not None:
        assert w.w13.scale.shape == (3, 128) and w.w13.scale.dtype == torch.float32
        want = dequantize(prob.weights.w13, scheme.w1, torch.float32).transpose(1, 2)
        got = w.w13.data.float() * w.w13.scale.unsqueeze(1)
        assert torch.equal(got, want)


# ---- nothing fits, and the command ---------------------------------------------------------------


def test_nothing_fits_lists_every_candidate_and_reason():
    with pytest.raises(UnsupportedError) as e:
        _select("unquantized", "gfx942", ("aiter",))
    text = str(e.value)
    assert text.startswith("no backend can run this configuration")
    assert "aiter: declared only" in text and "triton: platform rocm not supported" in text
    assert "reference: not taken automatically on rocm" in text and text.rstrip().endswith("nothing fits")
    names = [n for n, c in registry.experts_backends().items() if c.layout is STD]
    assert all(f"no {n}" in text for n in names)


def test_cli_explain(capsys):
    rc = cli_main(
        ["explain", "--preset", "gpt-oss-20b", "--scheme", "mxfp4", "--platform", "sm100", "--packages", "flashinfer"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "no trtllm [runs as mxfp4_mxfp8: a1/a2 mxfp8:G(32):dyn; pads H, I to multiples of 256, 256]" in out
    assert "ok triton: accepted  <- chosen" in out and "activations: a1/a2 model dtype" in out
    assert "padding: none (H 2880, I 2880)" in out
    rc = cli_main(["explain", "--preset", "small", "--scheme", "fp8_channel", "--platform", "sm80"])
    out = capsys.readouterr().out
    assert rc == 1 and "fp8 tensor cores (sm89+)" in out and "nothing fits" in out
    rc = cli_main(["explain", "--preset", "small", "--scheme", "bf16", "--platform", "sm90", "--tokens", "4096"])
    assert rc == 0 and "shape rule" in capsys.readouterr().out
