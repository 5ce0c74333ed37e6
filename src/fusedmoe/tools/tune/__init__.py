"""``fusedmoe tune``: search grouped-GEMM launch configs on this GPU and write them as JSON.

A *combo* is one (preset, scheme); a *step* is one GEMM of its layer at one token count T
(W13: N = 2I, K = H; W2: N = H, K = I), launched as the layer launches it (bias, router
weights on GEMM2, into a preallocated output). Per step:

    plan     the space's configs whose BM suits the rows per expert (``candidates``), fitted to
             the scheme's scale groups, ranked by distance from the heuristic config
    warm     worker processes compile them into Triton's on-disk cache, most urgent first, while
             the main process times earlier steps; a job is one Triton specialisation, so a
             binary that several steps share (same scheme, same size classes) compiles once:
             ~1560 compiles for the 4302 candidates of 4 presets x 3 schemes x 6 T (counted on
             a CPU under the interpreter), ~200 s on 12 workers at 1.5 s per compile
    check    the main process runs each warm candidate once; an output further than 1e-2 from
             the heuristic config's output is rejected
    screen   every survivor: a short timing (CUDA-graph replays, L2 flushed before each)
    re-time  the best ``top`` and the heuristic config: a longer timing; the fastest wins
    write    <dir>/<gpu>/<scheme>/E=..,N=..,K=...json (``kernels.tuned_configs``) per GEMM, by
             rename (never half written), with the token counts whose two GEMMs both finished

GEMM2 is tuned under the BM GEMM1 chose at the same T (``candidates``), so a combo's steps run
G1(T0), G1(T1), G2(T0), G1(T2), G2(T1), ...: the workers compile G2(Ti) during G1(Ti+1).
``extra_tokens`` are tuned after every combo's ``tokens``, with the time those leave.

Budget (``budget_s``, ``run``): every remaining step keeps the fraction of its ranked candidates
the time left affords (at least 5); on expiry or Ctrl-C the files hold the token counts that
finished. The token count picks the entry, never the file (STYLE point 6).

Modules, in import order:

    space     the candidate spaces, ``candidates`` of one step, their ranking
    operands  ``Combo``; the GEMM operands of a step, full size and a worker's; ``launch``
    probe     Triton specialisation keys; what a worker compiles (``warm``)
    pool      ``WarmPool``: the compile workers, most urgent job first
    report    step and combo results, the JSON files, the summary
    run       ``tune_many``, ``tune``, ``plan_summary``: planning, timing, checking, the budget
"""

from .operands import Combo
from .report import ComboResult, StepResult, TuneReport, write_combo
from .run import plan_summary, tune, tune_many
from .space import ALL_PRESETS, SCHEMES, SPACES, candidates, parse_presets

__all__ = [
    "ALL_PRESETS",
    "SCHEMES",
    "SPACES",
    "Combo",
    "ComboResult",
    "StepResult",
    "TuneReport",
    "candidates",
    "parse_presets",
    "plan_summary",
    "tune",
    "tune_many",
    "write_combo",
]
