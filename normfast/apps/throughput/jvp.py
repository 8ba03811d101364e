"""Sections "jacrev" and "minilm": jvp mode against per-probe Jacobians, and batched directions."""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from normfast.encoders import ModuleEncoder

from .measure import accuracy_check, count_flops, environment, percentiles, rel_diff, threads, throughput, time_rounds
from .settings import JVP_KEYS, MINILM_LAYER, JacrevSettings, MiniLMSettings

# ============================================================================
# Section "jacrev": jvp mode vs per-probe Jacobians on a small model
# ============================================================================


def mlp_encoder(widths: Sequence[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> "ModuleEncoder":
    """A tanh MLP as a :class:`~normfast.encoders.ModuleEncoder` (no head: jvp mode)."""
    from normfast.encoders import ModuleEncoder

    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = [
        torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh()) for a, b in zip(widths[:-2], widths[1:-1])
    ]
    blocks.append(torch.nn.Linear(widths[-2], widths[-1]))
    return ModuleEncoder(blocks, head=False).to(dtype).eval()


def _concat_stats(parts: list[dict]) -> dict:
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "M"}
    out["M"] = parts[0]["M"]
    return out


def _jvp_normfast(encoder, tangents: dict[str, torch.Tensor], X: torch.Tensor, chunk: int, k: int) -> dict:
    """normfast's path: the chunk's primal, then K directions per vmap'd jvp pass, accumulated."""
    from normfast.engine.transmission.jvp import Tail
    from normfast.ops import ProbeAccumulator

    names = list(tangents)
    tail = Tail(encoder, names, 0, "pooled")
    m = next(iter(tangents.values())).shape[0]
    parts = []
    for lo in range(0, X.shape[0], chunk):
        front = encoder.prepare(X[lo : lo + chunk])
        z = tail.primal(front, None)
        acc = ProbeAccumulator(z.shape[0], z.shape[1], dtype=torch.float64)
        for d0 in range(0, m, k):
            group = {n: t[d0 : d0 + k] for n, t in tangents.items()}
            acc.update(-tail.jvp(front, group, None), z)
        parts.append(acc.finalize())
    return _concat_stats(parts)


def _jvp_jacrev(encoder, tangents: dict[str, torch.Tensor], X: torch.Tensor, chunk: int) -> dict:
    """Naive: materialize ``J_i`` of every probe (``vmap(jacrev)``), apply it to each direction."""
    from torch.func import functional_call, jacrev, vmap

    from normfast.ops import ProbeAccumulator

    params = {n: encoder.get_parameter(n).detach() for n in tangents}
    flat_tangents = {n: t.flatten(1) for n, t in tangents.items()}

    def one_probe(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(encoder, p, ({"x": x[None]},))[0]

    jacobians = vmap(jacrev(one_probe), in_dims=(None, 0))
    parts = []
    for lo in range(0, X.shape[0], chunk):
        x = X[lo : lo + chunk]
        with torch.no_grad():
            z = encoder(encoder.prepare(x))
        J = jacobians(params, x)  # {name: [n, d, *shape]}
        t = sum(torch.einsum("ndp,mp->mnd", J[n].flatten(2), flat_tangents[n]) for n in J)
        acc = ProbeAccumulator(z.shape[0], z.shape[1], dtype=torch.float64)
        acc.update(-t, z)
        parts.append(acc.finalize())
    return _concat_stats(parts)


def _mlp_directions(encoder, s: JacrevSettings, seed: int = 0):
    from normfast.data.batches import virtual_batches
    from normfast.data.pairs import PairSource
    from normfast.engine.directions.gradients import compute_directions
    from normfast.engine.directions.objectives import InfoNCE
    from normfast.engine.directions.presets import OptimizerPreset

    g = torch.Generator().manual_seed(seed + 1)
    anchors = torch.randn(s.pairs, s.widths[0], generator=g, dtype=encoder_dtype(encoder))
    positives = anchors + 0.3 * torch.randn(anchors.shape, generator=g, dtype=anchors.dtype)
    pairs = PairSource.from_iterable(list(zip(anchors, positives)), kind="pairs")
    names = [n for n, _ in encoder.named_parameters()]
    presets = {n: OptimizerPreset("sgd") for n in names}
    batches = virtual_batches(s.pairs, s.m, s.batch_size, seed)
    dirs = compute_directions(encoder, InfoNCE(), pairs, names, presets, batches, seed=seed, progress=False)
    return dirs.stacked(list(range(s.m)), "u")


def encoder_dtype(encoder: torch.nn.Module) -> torch.dtype:
    return next(encoder.parameters()).dtype


def run_jacrev(s: JacrevSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.core.reference import brute_force_stats, stat_errors
    from normfast.engine.transmission.jvp import Tail

    with threads(s.threads):
        encoder = mlp_encoder(s.widths)
        tangents = _mlp_directions(encoder, s)
        X = torch.randn(s.n, s.widths[0], generator=torch.Generator().manual_seed(7))
        k = s.m
        methods = {
            "normfast": lambda x: _jvp_normfast(encoder, tangents, x, s.chunk, k),
            "jacrev": lambda x: _jvp_jacrev(encoder, tangents, x, s.chunk),
        }

        # float64 brute force: the same model and directions in double, every t materialized
        n_check = min(s.check, s.n)
        enc64 = copy.deepcopy(encoder).double()
        tan64 = {n: t.double() for n, t in tangents.items()}
        front = enc64.prepare(X[:n_check].double())
        tail64 = Tail(enc64, list(tangents), 0, "pooled")
        want = brute_force_stats(-tail64.jvp(front, tan64, None), tail64.primal(front, None), "u")
        checks, errors = [], {}
        for name, fn in methods.items():
            errors[name] = stat_errors(fn(X[:n_check]), want, list(JVP_KEYS))
            checks.append(
                accuracy_check(
                    f"jacrev/{name}",
                    max(errors[name].values()),
                    s.tolerance,
                    f"float64 brute force, first {n_check} probes",
                )
            )
        failed = {c["check"].split("/")[1] for c in checks if not c["passed"]}
        timed = {name: fn for name, fn in methods.items() if name not in failed}
        flops = {
            name: count_flops(lambda fn=fn: fn(X[: s.chunk])) * (s.n / min(s.chunk, s.n)) for name, fn in timed.items()
        }
        times = time_rounds(
            {name: (lambda fn=fn: fn(X)) for name, fn in timed.items()}, s.repeats, desc="jacrev", progress=progress
        )
        env = environment()
    seconds = {name: percentiles(ts) for name, ts in times.items()}
    n_params = sum(t[0].numel() for t in tangents.values())
    base = seconds.get("normfast", {}).get("p50")
    return {
        "what": "per-probe statistics (D, se_D, m2, V2, Q) of a tanh MLP over all its parameters; "
        "normfast = M directions per vmap'd forward-mode pass (Tail.jvp); naive = per-probe "
        "Jacobians by vmap(jacrev), applied to each direction; both accumulate the same way",
        "config": {**asdict(s), "parameters": n_params, "directions_per_pass": k},
        "environment": env,
        "accuracy": checks,
        "accuracy_errors": errors,
        "seconds": seconds,
        "items": s.n,
        "items_per_s": {name: throughput(ts, s.n) for name, ts in times.items()},
        "ratios": {"normfast_vs_jacrev": seconds["jacrev"]["p50"] / base} if base and "jacrev" in seconds else {},
        "flops": {k_: int(v) for k_, v in flops.items()},
        "flop_ratios": {"normfast_vs_jacrev": flops["jacrev"] / flops["normfast"]} if len(flops) == 2 else {},
        "flops_note": "matmul-class ops counted by torch.utils.flop_counter on one chunk, scaled by "
        "the number of chunks",
    }


# ============================================================================
# Section "minilm": batched vs sequential directions, engine throughput
# ============================================================================


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _engine_batches(n_items: int, m: int, batch_size: int, seed: int) -> list[np.ndarray]:
    # the engine draws its virtual batches with this seed (normfast.engine.probe)
    from normfast.data.batches import virtual_batches

    rng = np.random.default_rng(seed)
    return virtual_batches(n_items, m, batch_size, int(rng.integers(2**31)))


class _MiniLMWork:
    """The cached pieces of the MiniLM section: model, directions, tokenized chunks."""

    def __init__(self, s: MiniLMSettings):
        from normfast.data.pairs import PairSource
        from normfast.data.word_frequencies import top_words
        from normfast.encoders import load_encoder
        from normfast.engine.directions.gradients import compute_directions
        from normfast.engine.directions.objectives import SimCSE
        from normfast.engine.directions.parameters import resolve_parameters
        from normfast.engine.directions.presets import OptimizerPreset
        from normfast.engine.transmission.jvp import Tail

        self.s = s
        self.encoder = load_encoder("minilm")
        self.encoder.eval()
        self.names = resolve_parameters(self.encoder, MINILM_LAYER)
        stage_of = self.encoder.stage_of_parameters()
        self.cut = min(stage_of[n] for n in self.names)
        self.engine_words = top_words(s.engine_words)
        self.words = self.engine_words[: s.words]
        # the directions the engine itself computes for the engine words (same batches, seed)
        pairs = PairSource.from_iterable(self.engine_words, kind="items")
        presets = {n: OptimizerPreset("sgd") for n in self.names}
        t0 = time.perf_counter()
        dirs = compute_directions(
            self.encoder,
            SimCSE(),
            pairs,
            self.names,
            presets,
            _engine_batches(len(pairs), s.m, s.batch_size, 0),
            cut=self.cut,
            seed=0,
            progress=False,
        )
        self.directions_seconds = time.perf_counter() - t0
        self.tangents = dirs.stacked(list(range(s.m)), "u")
        self.params = {n: self.encoder.get_parameter(n).detach() for n in self.names}
        self.tail = Tail(self.encoder, self.names, self.cut, "tokens")
        self.states = [self.encoder.prepare(list(c)) for c in _chunks(self.words, s.chunk)]
        self.engine_states = [self.encoder.prepare(list(c)) for c in _chunks(self.engine_words, s.chunk)]
        self.tokens = sum(int(st["mask"].sum()) for st in self.states)
        self.engine_tokens = sum(int(st["mask"].sum()) for st in self.engine_states)

    def front(self, state: dict) -> dict:
        with torch.no_grad():
            return self.encoder(state, 0, self.cut)

    def direction(self, k: int) -> dict[str, torch.Tensor]:
        return {n: t[k : k + 1] for n, t in self.tangents.items()}

    # -- the three transmissions of one chunk -> [M, n_tokens, d] -------------------
    def groups(self) -> list[dict[str, torch.Tensor]]:
        """The M directions in groups of K (one vmap'd pass each)."""
        k = self.s.k
        return [{n: t[d0 : d0 + k] for n, t in self.tangents.items()} for d0 in range(0, self.s.m, k)]

    def batched(self, state: dict) -> torch.Tensor:
        front, rows = self.front(state), state["mask"].bool()
        return torch.cat([self.tail.jvp(front, group, rows) for group in self.groups()])

    def sequential_cached(self, state: dict) -> torch.Tensor:
        front, rows = self.front(state), state["mask"].bool()
        return torch.cat([self.tail.jvp(front, self.direction(k), rows) for k in range(self.s.m)])

    def sequential_full(self, state: dict) -> torch.Tensor:
        from torch.func import functional_call, jvp

        from normfast.encoders import forward_ad_safe

        rows = state["mask"].bool()
        enc = self.encoder

        def whole_model(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(enc, p, (state,), {"start": 0, "output": "tokens"}, strict=False)

        outs = []
        with forward_ad_safe(), torch.no_grad():
            for k in range(self.s.m):
                tangent = {n: t[k] for n, t in self.tangents.items()}
                outs.append(jvp(whole_model, (self.params,), (tangent,))[1][rows])
        return torch.stack(outs)


def _float64_transmission(work: _MiniLMWork, state: dict, n_dir: int) -> torch.Tensor:
    from normfast.engine.transmission.jvp import Tail

    enc64 = copy.deepcopy(work.encoder).double()
    tail64 = Tail(enc64, work.names, work.cut, "tokens")
    with torch.no_grad():
        front = enc64(state, 0, work.cut)
    tangents = {n: t[:n_dir].double() for n, t in work.tangents.items()}
    return tail64.jvp(front, tangents, state["mask"].bool())


def _engine_consistency(work: _MiniLMWork, result: Any) -> dict[str, Any]:
    """The engine's statistics of the first chunk vs those accumulated from the batched transmission."""
    from normfast.core.reference import stat_errors
    from normfast.ops import ProbeAccumulator

    state = work.engine_states[0]
    rows = state["mask"].bool()
    with torch.no_grad():
        z = work.tail.primal(work.front(state), rows)
    acc = ProbeAccumulator(z.shape[0], z.shape[1], dtype=torch.float64)
    acc.update(-work.batched(state), z)
    want = acc.finalize()
    n = z.shape[0]
    got = {k: torch.as_tensor(result.column(k)[:n]) for k in JVP_KEYS}
    errors = stat_errors(got, want, list(JVP_KEYS))
    return {
        "max_rel_diff": max(errors.values()),
        "errors": errors,
        "note": "engine output rows of the first chunk vs ProbeAccumulator fed by the batched "
        "transmission timed here (same directions): the figures measure the engine's "
        "own computation",
    }


def run_minilm(s: MiniLMSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.engine.probe import ProbeConfig, probe

    work = _MiniLMWork(s)
    first = work.states[0]
    # accuracy: every transmission of the first chunk, and the batched one vs float64
    outs = {
        "batched": work.batched(first),
        "sequential_cached": work.sequential_cached(first),
        "sequential_full": work.sequential_full(first),
    }
    ref64 = _float64_transmission(work, first, s.check_directions)
    checks = [
        accuracy_check(
            "minilm/batched/float64",
            rel_diff(outs["batched"][: s.check_directions], ref64),
            s.tolerance,
            f"float64 model, first chunk, {s.check_directions} directions",
        )
    ]
    for name in ("sequential_cached", "sequential_full"):
        checks.append(
            accuracy_check(
                f"minilm/{name}",
                rel_diff(outs[name], outs["batched"]),
                s.tolerance,
                "batched transmission, first chunk, all directions",
            )
        )
        checks.append(
            accuracy_check(
                f"minilm/{name}/float64",
                rel_diff(outs[name][: s.check_directions], ref64),
                s.tolerance,
                f"float64 model, first chunk, {s.check_directions} directions",
            )
        )
    failed = {c["check"].split("/")[1] for c in checks if not c["passed"]}
    del outs, ref64

    methods = {
        "batched": work.batched,
        "sequential_cached": work.sequential_cached,
        "sequential_full": work.sequential_full,
    }
    methods = {k: v for k, v in methods.items() if k not in failed}
    flops_first = {name: count_flops(lambda fn=fn: fn(first)) for name, fn in methods.items()}
    times = time_rounds(
        {name: (lambda fn=fn: [fn(st) for st in work.states]) for name, fn in methods.items()},
        s.repeats,
        desc="minilm: batched vs sequential",
        progress=progress,
    )
    seconds = {name: percentiles(ts) for name, ts in times.items()}
    base = seconds.get("batched", {}).get("p50")
    ratios = {f"batched_vs_{name}": seconds[name]["p50"] / base for name in seconds if name != "batched" and base}

    # throughput: the full engine (directions included) and the transmission alone
    config = ProbeConfig(
        params=MINILM_LAYER,
        mode="jvp",
        output="tokens",
        optimizer="sgd",
        batches=s.m,
        batch_size=s.batch_size,
        seed=0,
        chunk_size=s.chunk,
        directions_per_pass=s.k,
        drift_batches=None,
    )
    fronts = [(work.front(st), st["mask"].bool()) for st in work.engine_states]
    groups = work.groups()

    def engine() -> Any:
        return probe(
            work.encoder,
            work.engine_words,
            "simcse",
            None,
            copy.deepcopy(config),
            progress=False,
            model_name="all-MiniLM-L6-v2",
        )

    def transmission() -> None:
        for front, rows in fronts:
            for group in groups:
                work.tail.jvp(front, group, rows)

    checked = engine()  # warm-up, and the run whose rows are checked
    consistency = _engine_consistency(work, checked)
    rows_engine = len(checked)
    del checked
    thr_times = time_rounds(
        {"engine": engine, "transmission": transmission}, s.repeats, desc="minilm: throughput", progress=progress
    )
    env = environment()
    engine_tps = throughput(thr_times["engine"], rows_engine)
    trans_tps = throughput(thr_times["transmission"], work.engine_tokens)
    transmission_flops = count_flops(lambda: [work.tail.jvp(fronts[0][0], g, fronts[0][1]) for g in groups])
    summary = {
        "model": "all-MiniLM-L6-v2",
        "probed": MINILM_LAYER,
        "output": "tokens",
        "M": s.m,
        "directions_per_pass": s.k,
        "objective": "simcse",
        "batch_size": s.batch_size,
        "words": s.engine_words,
        "chunk_words": s.chunk,
        "token_rows": rows_engine,
        "engine_tokens_per_s": engine_tps,
        "transmission_tokens_per_s": trans_tps,
        "engine_seconds": percentiles(thr_times["engine"]),
        "directions_seconds_once": work.directions_seconds,
        "transmission_seconds": percentiles(thr_times["transmission"]),
        "threads": env["threads"],
        "device": env["device"],
        "versions": env["versions"],
        "note": "token rows include [CLS] and [SEP]; the engine figure includes computing the M "
        "directions (directions_seconds_once: the same M directions computed once at set-up, "
        "outside the timed runs), the fronts, kappa, the accumulators, the quartic solve and "
        "the table; "
        "the transmission figure is the vmap'd jvp passes alone (fronts cached)",
    }
    return {
        "what": "token-level jvp through MiniLM's last layer (all its parameters), M directions; "
        "batched = front cached once per chunk, K directions per vmap'd pass (Tail.jvp); "
        "sequential_cached = same cached front, one direction per pass; sequential_full = "
        "torch.func.jvp through the whole model per direction (front re-run each time)",
        "config": {
            **asdict(s),
            "parameters": sum(p.numel() for p in work.params.values()),
            "cut_stage": work.cut,
            "comparison_tokens": work.tokens,
            "engine_tokens": work.engine_tokens,
        },
        "environment": env,
        "accuracy": checks,
        "seconds": seconds,
        "items": work.tokens,
        "items_per_s": {name: throughput(ts, work.tokens) for name, ts in times.items()},
        "ratios": ratios,
        "flops_first_chunk": flops_first,
        "flop_ratios": {
            f"batched_vs_{k}": v / flops_first["batched"]
            for k, v in flops_first.items()
            if k != "batched" and "batched" in flops_first
        },
        "flops_note": "matmul-class ops counted by torch.utils.flop_counter on the first chunk "
        "(front included where it is run)",
        "throughput": summary,
        "transmission_flops_per_token": transmission_flops / int(fronts[0][1].sum()),
        "engine_consistency": consistency,
    }
