"""Case "diloco": one DiLoCo round of a small torch transformer LM, three ways.

A round: every replica takes H AdamW steps from the server's parameters on its own batches
(a fresh AdamW state each round, as `bridge_mr.algorithms.local_training` does), the server's
pseudo-gradient is minus the replicas' mean delta, and a torch Nesterov SGD step (lr 0.7,
momentum 0.9) applies it. Interleaved, at 8 and 64 replicas:

* `bridge_mr`: `bridge_mr.algorithms.outer_step` of `local_training(from_torch(loss),
  optax.adamw, steps=H)` (one `map_reduce` program, strategy "vmap"), then the SGD step.
* `torch_loop`: a Python loop over replicas, each loading the server's parameters into one
  module and stepping `torch.optim.AdamW` H times; the mean delta; the SGD step.
* `torch_vmap`: `torch.func.vmap` over replicas of the H steps written functionally
  (`functional_call`, `torch.func.grad`, AdamW's update by hand); the mean delta; the SGD step.

All three start from the same parameters and batches; their parameters after the first round
are compared (AdamW in optax and torch: same formula, float32 rounding apart; see
`AGREEMENT_RTOL`). The first call
of each (trace and compile for bridge_mr) is timed on its own. No targets: the issue asks for
the times side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .. import harness, report

BRIDGE_MR = "bridge_mr"
TORCH_LOOP = "torch_loop"
TORCH_VMAP = "torch_vmap"
ALTERNATIVES = (BRIDGE_MR, TORCH_LOOP, TORCH_VMAP)

VOCAB = 256
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9

TITLE = (
    "DiLoCo round of a byte-level transformer LM (d_model {d_model}, {layers} layers, "
    "H={inner_steps} AdamW steps of batch {batch} x {context} per replica, outer Nesterov SGD): "
    "bridge_mr against a torch loop over replicas and torch.func.vmap"
)
UNIT = (
    "time per round (x = paired ratio to bridge_mr), replica steps/s; 'first call' rows: one "
    "call each (bridge_mr: trace and compile)"
)
NOTE = (
    "{n_params:,} parameters (float32), int64 byte tokens (int32 inside JAX). bridge_mr: "
    "bridge_mr.algorithms.outer_step(local_training(from_torch(loss), optax.adamw, steps=H), "
    "strategy='vmap'); torch_loop: one module, torch.optim.AdamW, replicas one after another; "
    "torch_vmap: torch.func.vmap over replicas of H hand-written AdamW steps (functional_call, "
    "torch.func.grad). All: fresh inner AdamW state per round, outer "
    "torch.optim.SGD(nesterov=True) on minus the mean delta."
)

#: Largest relative difference, sum |a - b| / sum |b - initial|, of the parameters after one
#: round between an alternative (a) and bridge_mr (b) for them to count as computing the same
#: round. Not a max |difference|: Adam's first steps are about lr * sign(gradient), so a
#: gradient entry near zero whose sign float32 rounding flips moves that one parameter by up
#: to 2 lr; summed over all parameters such entries weigh little, a wrong round weighs ~1.
AGREEMENT_RTOL = 1e-2


@dataclasses.dataclass(frozen=True)
class DilocoConfig:
    """One row: `replicas` replicas, H = `inner_steps` steps of `batch` windows of `context`
    bytes, a byte-level transformer of `layers` pre-LN blocks of width `d_model`."""

    replicas: int
    inner_steps: int
    batch: int
    context: int
    d_model: int
    layers: int
    heads: int = 4

    @property
    def row_id(self) -> str:
        """e.g. "diloco/lm/r8"."""
        return f"diloco/lm/r{self.replicas}"

    def params(self) -> dict[str, Any]:
        """The row's configuration, with the parameter count."""
        return {
            **dataclasses.asdict(self),
            "n_params": sum(p.numel() for p in make_model(self).parameters()),
        }


#: The quick rows and the full rows (the issue's 8 and 64 replicas).
QUICK = [DilocoConfig(r, inner_steps=5, batch=4, context=16, d_model=32, layers=1) for r in (8, 64)]
FULL = [DilocoConfig(r, inner_steps=20, batch=8, context=32, d_model=64, layers=2) for r in (8, 64)]


def make_model(cfg: DilocoConfig) -> Any:
    """The byte-level transformer LM (pre-LN blocks, causal attention written out), seeded:
    every alternative starts from it."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, cfg.heads, -1).transpose(1, 2) for z in (q, k, v))
            # By hand: torch.func.vmap has no batching rule for CPU's fused attention kernel
            # (it would loop over replicas), and all three run the same ops this way.
            scores = (q @ k.transpose(-2, -1)) * (d // cfg.heads) ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool).tril()  # no device=: see the note
            attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
            x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Embedding(VOCAB, cfg.d_model)
            self.position = nn.Parameter(torch.randn(cfg.context, cfg.d_model) * 0.02)
            self.blocks = nn.Sequential(*(Block() for _ in range(cfg.layers)))
            self.ln = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.token(tokens) + self.position[: tokens.shape[1]]
            return self.head(self.ln(self.blocks(x)))

    torch.manual_seed(0)
    return LM()


def lm_loss(model: Any) -> Callable[[Any, Any], Any]:
    """The torch loss (params, batch [b, context + 1]) -> mean next-byte cross-entropy."""
    import torch.nn.functional as F
    from torch.func import functional_call

    def loss(params: dict[str, Any], batch: Any) -> Any:
        logits = functional_call(model, params, (batch[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    return loss


def round_batches(cfg: DilocoConfig) -> Any:
    """Random byte windows [replicas, H, batch, context + 1] (int64), fixed by a seed."""
    import torch

    generator = torch.Generator().manual_seed(1)
    shape = (cfg.replicas, cfg.inner_steps, cfg.batch, cfg.context + 1)
    return torch.randint(0, VOCAB, shape, generator=generator)


def _server(cfg: DilocoConfig) -> tuple[Any, dict[str, Any], Any]:
    """(model, its parameters by name, the outer Nesterov SGD over them)."""
    import torch

    model = make_model(cfg)
    params = dict(model.named_parameters())
    outer = torch.optim.SGD(params.values(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return model, params, outer


def _outer_step(params: dict[str, Any], outer: Any, delta: dict[str, Any]) -> list[Any]:
    for name, p in params.items():
        p.grad = -delta[name]
    outer.step()
    outer.zero_grad()
    return [p.detach() for p in params.values()]


def build_bridge_mr(cfg: DilocoConfig) -> Callable[[], Any]:
    """The round through `bridge_mr.algorithms.outer_step` (strategy "vmap")."""
    import optax

    import bridge_mr
    from bridge_mr import algorithms as alg

    model, params, outer = _server(cfg)
    batches = round_batches(cfg)
    loss = bridge_mr.from_torch(lm_loss(model))
    inner = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    local = alg.local_training(loss, inner, steps=cfg.inner_steps)

    def bridge_mr_round() -> Any:
        alg.outer_step(local, params, batches, strategy="vmap")
        outer.step()
        outer.zero_grad()
        return [p.detach() for p in params.values()]

    return bridge_mr_round


def build_torch_loop(cfg: DilocoConfig) -> Callable[[], Any]:
    """The round as a Python loop over replicas: torch.optim.AdamW on one reused module."""
    import torch

    _, params, outer = _server(cfg)
    replica = make_model(cfg)
    local = dict(replica.named_parameters())
    loss = lm_loss(replica)
    batches = round_batches(cfg)

    def torch_loop_round() -> Any:
        total = {name: torch.zeros_like(p) for name, p in params.items()}
        for replica_batches in batches:
            with torch.no_grad():
                for name, p in local.items():
                    p.copy_(params[name])
            inner = torch.optim.AdamW(
                local.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
            )
            for batch in replica_batches:
                loss(local, batch).backward()
                inner.step()
                inner.zero_grad()
            with torch.no_grad():
                for name, p in local.items():
                    total[name] += p - params[name]
        return _outer_step(params, outer, {n: t / cfg.replicas for n, t in total.items()})

    return torch_loop_round


def build_torch_vmap(cfg: DilocoConfig) -> Callable[[], Any]:
    """The round with `torch.func.vmap` over replicas of H functional AdamW steps."""
    import torch
    from torch.func import grad, vmap

    model, params, outer = _server(cfg)
    loss_grad = grad(lm_loss(model))
    batches = round_batches(cfg)
    b1, b2 = BETAS

    def replica_delta(server: dict[str, Any], replica_batches: Any) -> dict[str, Any]:
        p = dict(server)
        m = {n: torch.zeros_like(v) for n, v in p.items()}
        v = {n: torch.zeros_like(x) for n, x in p.items()}
        for step in range(cfg.inner_steps):
            g = loss_grad(p, replica_batches[step])
            bc1, bc2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
            for n in p:
                m[n] = b1 * m[n] + (1 - b1) * g[n]
                v[n] = b2 * v[n] + (1 - b2) * g[n] ** 2
                update = (m[n] / bc1) / ((v[n] / bc2).sqrt() + EPS)
                p[n] = p[n] * (1 - LR * WEIGHT_DECAY) - LR * update
        return {n: p[n] - server[n] for n in p}

    deltas_of = vmap(replica_delta, in_dims=(None, 0))

    def torch_vmap_round() -> Any:
        server = {n: p.detach() for n, p in params.items()}
        deltas = deltas_of(server, batches)
        return _outer_step(params, outer, {n: d.mean(dim=0) for n, d in deltas.items()})

    return torch_vmap_round


def _measure(ctx: harness.Context, cfg: DilocoConfig, case: report.CaseResult) -> None:
    """The round row, the first-call row and the agreement note of one configuration."""
    builders = {
        BRIDGE_MR: build_bridge_mr,
        TORCH_LOOP: build_torch_loop,
        TORCH_VMAP: build_torch_vmap,
    }
    built = {name: build(cfg) for name, build in builders.items()}
    first_s, after_first = {}, {}
    for name, fn in built.items():
        first_s[name], result = harness.time_once(fn)
        after_first[name] = [x.clone() for x in result]
    initial = [p.detach() for p in make_model(cfg).parameters()]
    reference = after_first[BRIDGE_MR]
    change = sum(float((b - p0).abs().sum()) for b, p0 in zip(reference, initial, strict=True))
    difference = {
        name: sum(float((a - b).abs().sum()) for a, b in zip(result, reference, strict=True))
        / change
        for name, result in after_first.items()
        if name != BRIDGE_MR
    }
    policy = dataclasses.replace(ctx.policy, warmup=max(0, ctx.policy.warmup - 1))
    comparison = harness.compare(built, baseline=BRIDGE_MR, policy=policy)
    params = {**cfg.params(), "relative_difference_after_first_round": difference}
    steps = cfg.replicas * cfg.inner_steps
    case.rows.append(
        report.comparison_row(
            comparison, cfg.row_id, params, metrics={"replica_steps_per_s": steps}
        )
    )
    once = harness.Comparison(BRIDGE_MR, {n: harness.Timing([s], 1) for n, s in first_s.items()})
    case.rows.append(report.comparison_row(once, f"{cfg.row_id} first call", cfg.params()))
    disagreeing = [name for name, d in difference.items() if d > AGREEMENT_RTOL]
    case.notes.append(
        f"r{cfg.replicas}: parameters after the first round, sum |difference| from bridge_mr's "
        "over the sum of bridge_mr's changes: "
        + ", ".join(f"{name} {d:.2g}" for name, d in difference.items())
        + (f" (over {AGREEMENT_RTOL:g}: {', '.join(disagreeing)})" if disagreeing else "")
        + "."
    )


def run(ctx: harness.Context, configs: list[DilocoConfig] | None = None) -> report.CaseResult:
    """The DiLoCo round at each configuration (`QUICK` or `FULL` unless `configs` is given;
    `ctx.clients` replaces their replica counts)."""
    if configs is None:
        configs = QUICK if ctx.quick else FULL
        if ctx.clients:
            configs = [dataclasses.replace(configs[0], replicas=r) for r in ctx.clients]
    fields = {**dataclasses.asdict(configs[0]), "n_params": configs[0].params()["n_params"]}
    title, note = TITLE.format(**fields), NOTE.format(**fields)
    with report.case_result("diloco", title, UNIT, note) as case:
        harness.each(configs, case.name, lambda cfg: _measure(ctx, cfg, case))
    return case
