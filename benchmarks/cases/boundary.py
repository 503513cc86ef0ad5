"""Case 1: the torch <-> JAX boundary, per tensor and per `map_reduce` call.

Per tensor: `bridge_mr.dlpack.import_tensors` / `export_arrays` against the public
`jax.dlpack.from_dlpack` / `torch.from_dlpack` and against a copy through numpy, for tensor
sizes from 1 KiB to tens of MiB and for a batch of small tensors. Per call: conversions, copies
and bytes copied by one `map_reduce` round, counted with `bridge_mr.dlpack.count_conversions`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import harness, report, workloads

KIB = 1024
TITLE = "Boundary cost: torch <-> JAX per tensor, and copies per map_reduce round"
UNIT = (
    "time per call (a call converts the row's tensors); (x) = ratio to the public DLPack "
    "function; tensors/s. map_reduce rows: conversions counted in one round (forward and "
    "backward for FedSGD, with the optimizer step)"
)
NOTE = (
    "public dlpack: jax.dlpack.from_dlpack(t) (import) and torch.from_dlpack(a) (export). numpy "
    "copy: jnp.asarray(t.numpy()) and torch.from_numpy(np.array(a)); on CPU "
    "jax.device_put(t.numpy()) aliases the buffer, so it would not be a copy."
)


def _label(n_bytes: int) -> str:
    return f"{n_bytes // KIB} KiB" if n_bytes < KIB * KIB else f"{n_bytes // (KIB * KIB)} MiB"


def exchange_rows(
    ctx: harness.Context, tensors: list[Any], name: str, bar: Any = None
) -> list[dict[str, Any]]:
    """Two rows, "import/<name>" and "export/<name>": `tensors` into JAX, and back.

    The export side converts as many fresh outputs of a jitted function (what the bridge
    exports in practice) of the same shapes, on the same device.
    """
    import jax

    from bridge_mr import dlpack

    arrays = [jax.jit(lambda x: x + 1)(a) for a in dlpack.import_tensors(tensors)]
    rows = []
    for direction, paths in workloads.dlpack_paths(tensors, arrays).items():
        if bar is not None:
            bar.set_postfix_str(f"{direction} {name}")
        comparison = harness.compare(paths, baseline="public dlpack", policy=ctx.policy)
        rows.append(
            report.comparison_row(
                comparison,
                f"{direction}/{name}",
                {
                    "direction": direction,
                    "tensors": len(tensors),
                    "bytes_per_tensor": tensors[0].numel() * tensors[0].element_size(),
                    "device": str(tensors[0].device),
                },
                metrics={"tensors_per_s": len(tensors)},
            )
        )
        if bar is not None:
            bar.update()
    return rows


def _per_tensor_rows(ctx: harness.Context, bar: Any) -> list[dict[str, Any]]:
    import torch

    sizes = [(1, KIB), (32, KIB), (1, KIB * KIB), (1, (16 if ctx.quick else 64) * KIB * KIB)]
    rows = []
    for count, n_bytes in sizes:
        tensors = [torch.randn(n_bytes // 4) for _ in range(count)]
        name = f"{count} x {_label(n_bytes)}" if count > 1 else _label(n_bytes)
        rows += exchange_rows(ctx, tensors, name, bar)
    return rows


def _count_round(fn: Callable[[], Any]) -> dict[str, int]:
    from bridge_mr.dlpack import count_conversions

    harness.sync(fn())  # Compiles outside the count (compilation converts nothing, but be sure).
    with count_conversions() as stats:
        harness.sync(fn())
    return {
        "imports": stats.imports,
        "exports": stats.exports,
        "copies": stats.copies,
        "bytes_copied": stats.bytes_copied,
    }


def _strided_fedsgd(cfg: workloads.FedConfig) -> Callable[[], Any]:
    """FedSGD through map_reduce with client inputs that are a strided (non-compact) view."""
    import torch

    from bridge_mr import map_reduce

    model = workloads.torch_model(cfg.widths)
    params = dict(model.named_parameters())
    xs, ys = workloads.torch_client_data(cfg)
    wide = torch.zeros(*xs.shape[:-1], 2 * xs.shape[-1])
    wide[..., ::2] = xs
    strided = wide[..., ::2]

    def fedsgd_round() -> Any:
        loss = map_reduce(workloads.jax_loss, params, (strided, ys), reduce="mean")
        loss.backward()
        return loss

    return fedsgd_round


def _conversions_text(entry: dict[str, Any]) -> str:
    if "conversions" not in entry:
        return entry.get("error", "")
    c = entry["conversions"]
    return f"{c['imports']} imports, {c['exports']} exports, {c['copies']} copies"


def _copy_rows(case: report.CaseResult) -> list[dict[str, Any]]:
    rows = []
    configs = [
        ("fedsgd/small/c64", workloads.FedConfig("fedsgd", "small", 64), True),
        ("fedavg/small/c64", workloads.FedConfig("fedavg", "small", 64), True),
        ("fedsgd/small/c64 strided inputs", workloads.FedConfig("fedsgd", "small", 64), False),
    ]
    for row_id, cfg, contiguous in configs:
        entry: dict[str, Any]
        try:
            fn = workloads.build("bridge_mr", cfg) if contiguous else _strided_fedsgd(cfg)
            entry = {"error": fn} if isinstance(fn, str) else {"conversions": _count_round(fn)}
        except Exception as err:  # Reported as the row's result.
            entry = {"error": f"{type(err).__name__}: {err}"}
        rows.append(
            {
                "id": f"map_reduce {row_id}",
                "params": {
                    "algo": cfg.algo,
                    "model": cfg.model,
                    "clients": cfg.clients,
                    "contiguous_inputs": contiguous,
                },
                "baseline": None,
                "alternatives": {"bridge_mr": entry},
            }
        )
        if contiguous:
            copied = entry.get("conversions", {}).get("bytes_copied")
            case.targets.append(
                report.target(
                    "boundary",
                    f"map_reduce {row_id}",
                    "bytes copied at the boundary per round (contiguous inputs)",
                    copied,
                    0,
                    "<=",
                    _conversions_text(entry),
                )
            )
    return rows


def run(ctx: harness.Context) -> report.CaseResult:
    """Case 1."""
    with report.case_result("boundary", TITLE, UNIT, NOTE) as case:
        with harness.progress(8, "boundary") as bar:
            case.rows += _per_tensor_rows(ctx, bar)
        case.rows += _copy_rows(case)
    return case
