"""Every MoE architecture of the installed transformers on fusedmoe, against transformers itself.

``hf_zoo`` enumerates the architectures from transformers (every package with a config that
declares experts and a model class of its own) and builds each tiny (hidden 64, 2 layers, 8
experts, top-2; random weights of random sign everywhere). Each is run unpatched, then
served two ways, and compared:

- ``patch(model)``: every MoE block as ``plan`` says (replaced, or its experts swapped);
- the registry: ``model.set_experts_implementation("fusedmoe")`` (models whose experts
  modules transformers decorates).

Per block (each patched module, or experts module, called on the inputs the unpatched one
saw) and for the final logits: float32 within ``FP32_TOL``; bfloat16 within the bf16 row of
``fusedmoe.testing.tolerance``. In bf16 a token whose routing differs from the unpatched
model's in some layer is a near tie (its inputs differ only by rounding): it is counted and
reported, and left out of the logits check. Architectures fusedmoe refuses are listed in
``REFUSED`` with the reason they must give (at most two). Run with ``-s`` for the table.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fusedmoe import FusedMoEError, QuantScheme
from fusedmoe.integrations.transformers import FusedMoEBlock, patch, plan, register
from fusedmoe.testing import rel_error, tolerance

tf = pytest.importorskip("transformers", minversion="5")
tf.logging.set_verbosity_error()

import hf_zoo  # noqa: E402

FP32_TOL = 1e-4
BF16_TOL = tolerance(QuantScheme.unquantized(), torch.bfloat16)
BACKEND = "cpu"  # PyTorch in the model dtype: the CI-speed backend (the kernels are checked against it elsewhere)

# architecture -> what its refusal must say (fusedmoe may refuse at most two)
REFUSED = {
    "nllb_moe": "NllbMoeSparseMLP: experts: NllbMoeExperts one-hot encodes the router's 0/1 top-1 mask",
    "vitpose_backbone": "VitPoseBackboneMoeMLP: experts: VitPoseNaiveMoe is one Linear per expert",
}

ARCHS = sorted(hf_zoo.moe_configs())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny GEMMs: one thread each (two xdist workers share two cores; more threads only wait)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _out(o):
    o = o[0] if isinstance(o, tuple) else o
    return getattr(o, "logits", None) if hasattr(o, "logits") else getattr(o, "last_hidden_state", o)


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def near_ties(block: FusedMoEBlock, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """bool [T]: tokens whose choice of experts changes when their router logits move by 1% of
    max(1, |logit|) (bf16 rounds a logit, or a softmax or sigmoid of it, by up to 0.4%), or
    None for a block routed by the model itself."""
    if block.router is None:
        return None
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = block.logits(x).float()
    base = block.router.route(logits, block.correction_bias, fused=False).ids.sort(dim=-1).values
    g = torch.Generator().manual_seed(0)
    ties = torch.zeros(x.shape[0], dtype=torch.bool)
    for _ in range(4):
        noisy = logits + 1e-2 * logits.abs().clamp(min=1) * torch.randn(logits.shape, generator=g)
        ids = block.router.route(noisy, block.correction_bias, fused=False).ids.sort(dim=-1).values
        ties |= (ids != base).any(dim=-1)
    return ties


class Recorder:
    """Each named module's first call (inputs, output); per routed layer the top-k ids (the input
    of its experts module, or what a ``FusedMoEBlock`` routed: ``layers`` maps both to the block's
    name, so the unpatched and the patched model line up) and a ``FusedMoEBlock``'s near ties."""

    def __init__(self, model: torch.nn.Module, names: list[str], layers: dict[str, str]) -> None:
        self.calls: dict[str, tuple] = {}
        self.ids: dict[str, torch.Tensor] = {}
        self.ties: dict[str, torch.Tensor] = {}
        self.hooks, self.routes = [], []
        for n in names:
            self.hooks.append(model.get_submodule(n).register_forward_hook(self._call(n), with_kwargs=True))
        for n, layer in layers.items():
            m = model.get_submodule(n)
            if isinstance(m, FusedMoEBlock):
                m.route = self._route(layer, m)
                self.routes.append(m)
            elif hasattr(m, "has_gate") and not isinstance(m.__dict__.get("forward"), type(self._call)):
                self.hooks.append(m.register_forward_pre_hook(self._experts(layer)))

    def _call(self, n):
        def hook(m, args, kwargs, out):
            if n not in self.calls:
                self.calls[n] = (tuple(map(_clone, args)), {k: _clone(v) for k, v in kwargs.items()}, _clone(_out(out)))

        return hook

    def _experts(self, layer):
        def hook(m, args):
            self.ids.setdefault(layer, args[1].detach().long().sort(dim=-1).values)

        return hook

    def _route(self, layer, block):
        route = block.route

        def wrapped(hidden_states, x):
            topk = route(hidden_states, x)
            self.ids.setdefault(layer, topk.ids.long().sort(dim=-1).values)
            ties = near_ties(block, x)
            if ties is not None:
                self.ties.setdefault(layer, ties)
            return topk

        return wrapped

    def close(self):
        for h in self.hooks:
            h.remove()
        for m in self.routes:
            del m.route


def _decorated_experts(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def _run(model, kw, names, layers):
    rec = Recorder(model, names, layers)
    with torch.no_grad():
        logits = _out(model(**kw))
    rec.close()
    return logits, rec


def _token_error(got: torch.Tensor, want: torch.Tensor, ties: torch.Tensor | None, tol: float) -> tuple[float, int]:
    """(rel_error over the tokens, but for those off by more than ``tol`` (of the mean token norm)
    that ``ties`` explains as near ties; the number of those)."""
    got, want = got.reshape(-1, got.shape[-1]).double(), want.reshape(-1, want.shape[-1]).double()
    if ties is None:
        return rel_error(got, want), 0
    excused = ties & ((got - want).norm(dim=-1) > tol * want.norm(dim=-1).mean())
    return rel_error(got[~excused], want[~excused]), int(excused.sum())


def _module_errors(served, ref: Recorder, names: list[str], layers: dict, tol: float, bf16: bool) -> tuple[dict, int]:
    """rel_error of each module of ``served`` on the inputs its unpatched twin saw; in bf16 a token
    off by more than the tolerance that a ``FusedMoEBlock`` routes differently from transformers
    (recorded ids), or near a tie (``near_ties``), is left out and counted."""
    errs, n_ties = {}, 0
    with torch.no_grad():
        for n in names:
            args, kwargs, want = ref.calls[n]
            m = served.get_submodule(n)
            ties = None
            if bf16 and isinstance(m, FusedMoEBlock):
                x = args[0].reshape(-1, args[0].shape[-1])
                ties = near_ties(m, args[0])
                theirs = ref.ids.get(layers.get(n, n))
                if theirs is not None:
                    ours = m.route(args[0], x).ids.long().sort(dim=-1).values
                    flips = (ours != theirs).any(dim=-1)
                    ties = flips if ties is None else ties | flips
            errs[n], excused = _token_error(_out(m(*args, **kwargs)), want, ties, tol)
            n_ties += excused
    return errs, n_ties


def _per_token(logits: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    t = truth.reshape(-1, truth.shape[-1])
    return (logits.float().reshape(t.shape) - t).norm(dim=-1) / t.norm(dim=-1)


def _logit_ties(ref: Recorder, got: Recorder, tokens: int) -> torch.Tensor:
    """Tokens routed differently in some layer by the two runs, or near a tie in the served one."""
    ties = torch.zeros(tokens, dtype=torch.bool)
    for n, ids in ref.ids.items():
        other = got.ids.get(n)
        if other is not None and other.shape == ids.shape:
            ties |= (other != ids).any(dim=-1)
    for t in got.ties.values():
        ties |= t
    return ties


def _layers(model: torch.nn.Module) -> tuple[list[str], list[str], dict[str, str]]:
    """(planned module names, decorated experts names, {module name: its routed layer's name})."""
    planned = [p for p in plan(model) if p.mode in ("block", "experts")]
    blocks = {p.name for p in planned if p.mode == "block"}
    experts = _decorated_experts(model)
    layers = {n: n for n in blocks}
    for n in experts:
        parent = n.rpartition(".")[0]
        layers[n] = parent if parent in blocks else n
    return [p.name for p in planned], experts, layers


def _compare(arch, ref_model, served, kw, dtype, tol, how, truth=None):
    """Per-module and logits errors of ``served`` against ``ref_model`` (the same weights).
    truth: the float32 model's logits; in bf16 a token whose transformers bf16 logits are farther
    than ``tol`` from them, and 4x farther than ours, is a near tie of transformers' bf16 routing."""
    bf16 = dtype != torch.float32
    planned, experts, layers = _layers(ref_model)
    logits, ref = _run(ref_model, kw, sorted(set(planned + experts)), layers)
    got_logits, got = _run(served, kw, [], layers)
    names = [n for n in (planned if how == "patch" else experts) if n in ref.calls]
    errs, block_ties = _module_errors(served, ref, names, layers, tol, bf16)
    ties = None
    if bf16:
        ties = _logit_ties(ref, got, logits.shape[:-1].numel())
        theirs, ours = _per_token(logits, truth), _per_token(got_logits, truth)
        ties |= (theirs > tol) & (theirs > 4 * ours)  # transformers' bf16 routing flipped, not ours
    err, n_ties = _token_error(got_logits, logits, ties, tol)
    worst = max(errs.values(), default=0.0)
    print(f"\n[zoo] {arch:22s} {how:8s} {str(dtype)[6:]:8s} modules={len(errs)} worst={worst:.1e} "
          f"logits={err:.1e} near_ties={block_ties}/{n_ties}")  # fmt: skip
    assert errs, (arch, how, "no module compared")
    assert worst < tol and err < tol, (arch, how, dtype, errs, err)
    assert n_ties <= logits.shape[:-1].numel() // 4, (arch, how, "near ties on over a quarter of the tokens", n_ties)
    for n in names:
        m = served.get_submodule(n)
        assert isinstance(m, FusedMoEBlock) or "_fusedmoe_runner" in m.__dict__, (arch, how, n, "not on fusedmoe")


def _registry(model: torch.nn.Module) -> torch.nn.Module:
    served = copy.deepcopy(model)
    served.set_experts_implementation("fusedmoe")
    for n in _decorated_experts(served):
        impl = served.get_submodule(n).config._experts_implementation
        assert impl == "fusedmoe", (n, impl, "set_experts_implementation did not reach this experts module")
    return served


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_matches_transformers(arch):
    if hf_zoo.architecture(arch) is None:
        pytest.skip(f"{arch}: a config reusing another package's model (covered there)")
    model = hf_zoo.build(arch)
    if arch in REFUSED:
        with pytest.raises(FusedMoEError, match=REFUSED[arch].replace("(", r"\(")):
            patch(model, backend=BACKEND)
        return
    register(backend=BACKEND)
    kw = hf_zoo.inputs(model)
    has_registry = bool(_decorated_experts(model))
    with torch.no_grad():
        truth = _out(model(**kw)).float()
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        ref = model if dtype == torch.float32 else hf_zoo.to_dtype(copy.deepcopy(model), dtype)
        patched = copy.deepcopy(ref)
        patch(patched, backend=BACKEND)
        _compare(arch, ref, patched, kw, dtype, tol, "patch", truth)
        if has_registry:
            _compare(arch, ref, _registry(ref), kw, dtype, tol, "registry", truth)
    _the_logits_come_through_fusedmoe(patched, kw)


def _the_logits_come_through_fusedmoe(patched: torch.nn.Module, kw: dict) -> None:
    """Zeroing the down projections fusedmoe runs changes the logits (the match is no no-op)."""
    runners = [m.__dict__["_fusedmoe_runner"] for m in patched.modules() if "_fusedmoe_runner" in m.__dict__]
    assert runners
    with torch.no_grad():
        before = _out(patched(**kw)).float()
        for r in runners:
            r.weights.w2.data.zero_()
        after = _out(patched(**kw)).float()
    assert rel_error(after, before) > 1e-3


def test_at_most_two_architectures_are_refused():
    assert len(REFUSED) <= 2 and set(REFUSED) <= set(ARCHS)


# The semantics added for these architectures, through the Triton kernels (the interpreter here):
# transposed interleaved biased experts, the bounded SiLU gates, relu, identity experts, I = 1.
TRITON_ARCHS = ["gpt_oss", "deepseek_v4", "step3p7", "inkling2", "switch_transformers", "longcat_flash", "doge"]


@pytest.mark.parametrize("arch", TRITON_ARCHS)
def test_triton_kernels_serve_the_added_semantics(arch):
    model = hf_zoo.build(arch)
    kw = hf_zoo.inputs(model)
    with torch.no_grad():
        want = _out(model(**kw))
        patch(model, backend="triton")
        got = _out(model(**kw))
    assert rel_error(got, want) < FP32_TOL, arch
