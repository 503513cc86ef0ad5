"""Case 5: how close to the machine's limits the hot paths run.

Memory bandwidth: `reduce_sum` over a float32 [clients, params] array against a plain copy of
the same bytes. Bandwidth counts the bytes each operation must move: a copy reads and writes N
bytes (2N); a reduction over clients reads N and writes N / clients.

Compute: matrix-multiply FLOPs per second of the medium model's FedAvg client update (see
`workloads.train_flops`) against this machine's large float32 matmul (JAX and torch, the better
of the two is the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import harness, report, workloads

TITLE = "Physical limits: reduce bandwidth vs memcpy, model GFLOP/s vs large matmul"
UNIT = "time per call; (x) = ratio to the row's baseline; GB/s (bytes moved) or GFLOP/s"
NOTE = (
    "Bandwidth counts bytes moved: a copy reads and writes N bytes (2N); a reduction over "
    "clients reads N and writes N/clients. FLOPs: matmuls of forward and backward only."
)


def _reduce_row(ctx: harness.Context, case: report.CaseResult) -> dict[str, Any]:
    import drjax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import bridge_mr
    from bridge_mr import jax_core

    clients, params = (64, 1 << 18) if ctx.quick else (64, 1 << 20)
    x = torch.randn(clients, params)
    x_np = x.numpy()
    x_jax = jnp.asarray(x_np)
    dst = torch.empty_like(x)
    dst_np = np.empty_like(x_np)

    @jax.jit
    @jax_core.program(placements={"clients": clients})
    def core_sum(v: jax.Array) -> jax.Array:
        return jax_core.reduce_sum(v)

    @jax.jit
    @drjax.program(placements={"clients": clients})
    def drjax_sum(v: jax.Array) -> jax.Array:
        return drjax.reduce_sum(v)

    def bridge_sum() -> Any:
        with bridge_mr.program(placements={"clients": clients}):
            return bridge_mr.reduce_sum(x)

    n_bytes = x.numel() * x.element_size()
    copy_bytes, reduce_bytes = 2 * n_bytes, n_bytes + n_bytes // clients
    alternatives: dict[str, tuple[Callable[[], Any], int]] = {
        "memcpy torch copy_": (lambda: dst.copy_(x), copy_bytes),
        "memcpy np.copyto": (lambda: np.copyto(dst_np, x_np), copy_bytes),
        "bridge_mr.reduce_sum (torch)": (bridge_sum, reduce_bytes),
        "jax_core.reduce_sum (jit)": (lambda: core_sum(x_jax), reduce_bytes),
        "drjax.reduce_sum (jit)": (lambda: drjax_sum(x_jax), reduce_bytes),
        "torch.sum(dim=0)": (lambda: x.sum(dim=0), reduce_bytes),
    }
    comparison = harness.compare(
        {name: fn for name, (fn, _) in alternatives.items()},
        baseline="memcpy torch copy_",
        policy=ctx.policy,
    )
    row = report.comparison_row(
        comparison,
        f"reduce_sum [{clients}, {params}] f32",
        {"clients": clients, "params": params, "bytes": n_bytes},
    )
    for name, (_, moved) in alternatives.items():
        entry = row["alternatives"][name]
        if "median_s" in entry:
            entry["bytes_moved"] = moved
            entry["gb_per_s"] = moved / entry["median_s"] / 1e9
    copies = [n for n in alternatives if n.startswith("memcpy") and comparison.ok(n)]
    bridge = "bridge_mr.reduce_sum (torch)"
    value, reference, detail = None, None, ""
    if copies and comparison.ok(bridge):
        reference = max(copies, key=lambda n: row["alternatives"][n]["gb_per_s"])
        paired = comparison.ratio(reference, bridge)
        value = paired["median"] * reduce_bytes / copy_bytes if paired else None
        detail = (
            f"{row['alternatives'][bridge]['gb_per_s']:.1f} GB/s vs "
            f"{row['alternatives'][reference]['gb_per_s']:.1f} GB/s"
        )
    case.targets.append(
        report.target(
            "limits",
            row["id"],
            f"bridge_mr.reduce_sum bandwidth / memcpy bandwidth ({reference or 'memcpy'})",
            value,
            0.70,
            ">=",
            detail,
        )
    )
    return row


def _matmul_row(ctx: harness.Context) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch

    n = 1024 if ctx.quick else 2048
    a_torch = torch.randn(n, n)
    a_jax = jnp.asarray(a_torch.numpy())
    dot = jax.jit(jnp.dot)
    comparison = harness.compare(
        {
            "torch.mm": lambda: torch.mm(a_torch, a_torch),
            "jnp.dot (jit)": lambda: dot(a_jax, a_jax),
        },
        baseline="torch.mm",
        policy=ctx.policy,
    )
    return report.comparison_row(
        comparison,
        f"matmul {n}x{n} f32",
        {"n": n},
        metrics={"gflop_per_s": 2 * n**3 / 1e9},
    )


def _client_update_row(ctx: harness.Context, peak: float | None) -> dict[str, Any]:
    cfg = workloads.FedConfig("fedavg", "medium", 2 if ctx.quick else 8)
    flops = workloads.train_flops(cfg)
    built = {name: workloads.build(name, cfg) for name in workloads.ALTERNATIVES}
    comparison = harness.compare(built, baseline="drjax", policy=ctx.policy)
    row = report.comparison_row(
        comparison,
        f"client update fedavg/medium/c{cfg.clients}",
        {"algo": cfg.algo, "model": cfg.model, "clients": cfg.clients, "flops": flops},
        metrics={"gflop_per_s": flops / 1e9},
    )
    if peak:
        for entry in row["alternatives"].values():
            if "gflop_per_s" in entry:
                entry["fraction_of_matmul_peak"] = entry["gflop_per_s"] / peak
    return row


def run(ctx: harness.Context) -> report.CaseResult:
    """Case 5."""
    with report.case_result("limits", TITLE, UNIT, NOTE) as case:
        with harness.progress(3, "limits") as bar:
            bar.set_postfix_str("reduce_sum")
            case.rows.append(_reduce_row(ctx, case))
            bar.update()
            bar.set_postfix_str("matmul")
            matmul = _matmul_row(ctx)
            case.rows.append(matmul)
            bar.update()
            rates = [
                e["gflop_per_s"] for e in matmul["alternatives"].values() if "gflop_per_s" in e
            ]
            peak = max(rates) if rates else None
            bar.set_postfix_str("client update")
            case.rows.append(_client_update_row(ctx, peak))
            bar.update()
        if peak:
            case.notes.append(
                f"Large-matmul reference: {peak:.1f} GFLOP/s (best of the matmul row)."
            )
    return case
