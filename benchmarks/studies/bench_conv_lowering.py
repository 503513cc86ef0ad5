"""The CNN round's per-client convolutions, grouped or as matrix products (issue 42), in one
process, on the chip (or the CPU).

    python -m benchmarks.studies.bench_conv_lowering [--device tpu] [--rows 50:highest ...]
        [--chunks K ...] [--grouped G ...] [--packed G ...] [--unroll U ...] [--convolutions]
        [--reps N] [--until SECONDS] [--out FILE] [--profile]

The round is the "accelerator" case's CNN row (pfl-research's CIFAR10 simple_cnn, 5 local SGD
steps of 10 images per client, `from_torch` + `local_training`; `workloads.accelerator`). A row
is CLIENTS:PRECISION (torch's float32 matmul precision, "highest" or "medium"; pure JAX under
the same `jax.default_matmul_precision`). Variants, each from the same server parameters:

* "pure_jax": `jax.jit(jax.vmap(local))`, the mean delta, the server step: the floor a JAX
  user writes, whose convolutions over per-client kernels are grouped convolutions;
* "matmul": the same program through `jax_core.matmul_convolutions` (batched matrix products);
* "matmul:chunks:K": `jax_core.map_reduce(strategy="chunks", chunk_size=K)` of the same client,
  rewritten so (the memory of K clients at a time);
* "chunks:G" (`--grouped G ...`): the chunked round of G clients at a time, its convolutions
  grouped (as vmap leaves them);
* "packed:G" (`--packed G ...`): `map_reduce(strategy="packed", chunk_size=G)`: G clients at
  a time packed into their channels, each convolution one dense block-diagonal convolution;
* "packed:G:uU" (`--unroll U ...`, with `--packed G`): the same, the local steps' loop
  unrolled U steps an iteration (`local_training(..., unroll=U)`);
* "packed:G:conv" (`--convolutions`, with `--packed G`): "packed:G" with every convolution
  kept one (traced with `jax_core.settings.PACKED_PATCH_FEATURES` 0: on a TPU at "highest" the
  strategy otherwise computes the images' convolution and its kernel gradient as products of
  patches);
* "bridge_mr": the documented torch round (`outer_step`, host tensors, strategy "auto"), as
  the frontend compiles it for the device.

Per row: each variant's first call (trace, compile, run) apart, then `--reps` rounds timed
interleaved (A B C, B C A, ...), each until its new parameters are ready on the device (where a
JAX user's next round takes them; the torch round's are host tensors), with the 1-minute load
average per timed round; each variant's result against the first variant's that ran (pure
JAX's unless it ran out of memory; max |difference| / max |value|); achieved FLOP/s (the vmap
program's operations, `auto.cost`) against the device's peak (`device_peak`: a TPU's bf16
rate) and, on a TPU, against the precision's (a float32 product at "highest" takes 6 bf16
passes, "high" 3).
With `--profile`, each variant's round runs once more under `jax.profiler.trace`, and the
device's "XLA Ops" events are summed by op (the `TOP_OPS` longest, with their HLO category and
the start of their HLO text where the trace has them): where a round's time goes on the chip.
A variant that runs out of memory says so. Rows run in the order given while `--until` seconds
(since start) have not passed. Each result is printed as a JSON line as it comes (so that a
cut-off run keeps what it measured), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from benchmarks.workloads import accelerator as acc

#: bf16 passes per float32 product at each torch precision (XLA's float32 emulation).
PASSES = {"highest": 6, "high": 3, "medium": 1}
#: The rows in the order they run (issue 42's targets first).
DEFAULT_ROWS = ("50:medium", "500:medium", "500:highest", "50:highest", "2000:medium")
#: Above this many clients the vmap forms (pure JAX, matmul) and the torch round are not run:
#: a v5e's 16 GB do not hold pure JAX's vmap of 500 clients at "highest" (19.2 GB).
MAX_VMAP_CLIENTS = 500
#: With --profile: how many ops (the longest in total) each variant's summary lists.
TOP_OPS = 12


def _variants(
    cfg: acc.AcceleratorConfig,
    chunks: list[int],
    grouped: list[int],
    packed: list[int],
    unrolls: list[int],
    convolutions: bool = False,
) -> dict[str, Callable[[], Any]]:
    """Each variant as a zero-argument round from the same server parameters."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from bridge_mr import jax_core
    from bridge_mr.jax_core import settings

    program, params, batches, names = acc._round_program(cfg)
    local = acc._local(cfg, acc.build_model(cfg.model))
    server = acc._jax_tree(params, cfg.device)
    data = acc._jax_tree(batches, cfg.device)
    precision = acc.JAX_PRECISION[cfg.precision]

    def chunked(
        size: int, strategy: Any = "chunks", unroll: int = 1, convolutions: bool = False
    ) -> Callable[..., Any]:
        client = dataclasses.replace(local, unroll=unroll)

        def round_(p: Any, d: Any) -> Any:
            few = settings.PACKED_PATCH_FEATURES
            settings.PACKED_PATCH_FEATURES = 0 if convolutions else few  # read while it traces
            try:
                delta = jax_core.map_reduce(
                    lambda s, b: client(s, b)["delta"], p, d, strategy=strategy, chunk_size=size
                )
            finally:
                settings.PACKED_PATCH_FEATURES = few
            return jax.tree.map(jnp.add, p, delta)

        return round_

    programs: dict[str, Callable[..., Any]] = {}
    if cfg.clients <= MAX_VMAP_CLIENTS:
        programs = {"pure_jax": program, "matmul": jax_core.matmul_convolutions(program)}
    for size in chunks:
        if size < cfg.clients:
            programs[f"matmul:chunks:{size}"] = jax_core.matmul_convolutions(chunked(size))
    for size in grouped:
        if size < cfg.clients:
            programs[f"chunks:{size}"] = chunked(size)
    for size in packed:
        if size < cfg.clients:
            programs[f"packed:{size}"] = chunked(size, "packed")
            for unroll in unrolls:
                programs[f"packed:{size}:u{unroll}"] = chunked(size, "packed", unroll)
            if convolutions:
                programs[f"packed:{size}:conv"] = chunked(size, "packed", convolutions=True)

    def call(fn: Callable[..., Any]) -> Callable[[], Any]:
        jitted = jax.jit(fn)

        def run() -> Any:  # The new parameters stay on the device, for the next round.
            with jax.default_matmul_precision(precision):
                out = jitted(server, data)
            return [jax.block_until_ready(out)[name] for name in names]

        return run

    found = {name: call(fn) for name, fn in programs.items()}
    if cfg.clients <= MAX_VMAP_CLIENTS:  # The torch round.
        bridge = acc.round_bridge_mr(cfg, "bridge_mr")

        def torch_round() -> list[np.ndarray]:
            import torch

            # At the row's precision, torch's process-wide setting restored after each round.
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(cfg.precision)
            try:
                return [t.detach().numpy().copy() for t in bridge()]
            finally:
                torch.set_float32_matmul_precision(before)

        found["bridge_mr"] = torch_round
    return found


def _error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    scale = max(float(np.max(np.abs(w))) for w in want)
    return max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True)) / scale


def device_ops(fn: Callable[[], Any]) -> dict[str, Any]:
    """One call of `fn` under `jax.profiler.trace`: its device ops' time, summed by op name.

    Returns {"device_us": total, "ops": [[name, us, count, category, hlo], ...]} with the
    `TOP_OPS` longest, or {"device_us": 0, "ops": []} where the trace has no device plane (on
    CPU, XLA's work is on host threads instead).
    """
    import glob
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            fn()
        (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
        totals: dict[str, list[Any]] = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                if line.name != "XLA Ops":
                    continue
                for event in line.events:
                    stats = dict(event.stats)
                    entry = totals.setdefault(
                        event.name,
                        [event.name, 0.0, 0, str(stats.get("hlo_category", "")),
                         str(stats.get("long_name", ""))[:160]],
                    )  # fmt: skip
                    entry[1] += event.duration_ns / 1e3
                    entry[2] += 1
    ops = sorted(totals.values(), key=lambda e: -e[1])
    return {"device_us": sum(e[1] for e in ops), "ops": ops[:TOP_OPS]}


def _row(
    clients: int,
    precision: str,
    device: str,
    reps: int,
    chunks: list[int],
    grouped: list[int],
    packed: list[int],
    unrolls: list[int],
    until: float,
    profile: bool,
    convolutions: bool = False,
) -> list[dict[str, Any]]:
    cfg = acc.AcceleratorConfig("cnn", clients, device=device, precision=precision)
    flops = acc.flops(cfg)
    peak = acc.device_peak(device).get("peak_flop_per_s")
    calls = _variants(cfg, chunks, grouped, packed, unrolls, convolutions)
    results: dict[str, dict[str, Any]] = {}
    reference: list[np.ndarray] | None = None
    for name, fn in calls.items():
        if time.monotonic() > until:
            break
        entry: dict[str, Any] = {"row": f"cnn/c{clients}/{precision}", "variant": name}
        start = time.perf_counter()
        try:
            out = [np.asarray(x) for x in fn()]
        except Exception as error:  # Out of memory, mostly: the row says so and goes on.
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(json.dumps(entry), flush=True)
            results[name] = entry
            continue
        entry["first_s"] = time.perf_counter() - start
        if reference is None:
            reference = out
        entry["error_vs_first"] = _error(out, reference)
        entry["times"], entry["load"] = [], []
        results[name] = entry
        print(json.dumps(entry), flush=True)
    running = [n for n, e in results.items() if "first_s" in e]
    for rep in range(reps):
        if time.monotonic() > until:
            break
        order = running[rep % len(running) :] + running[: rep % len(running)] if running else []
        for name in order:
            start = time.perf_counter()
            calls[name]()
            results[name]["times"].append(time.perf_counter() - start)
            results[name]["load"].append(os.getloadavg()[0])
    for name in running if profile else []:
        if time.monotonic() > until:
            break
        try:
            found = device_ops(calls[name])
        except Exception as error:  # A profile that fails leaves the row's times as they are.
            found = {"error": f"{type(error).__name__}: {error}"[:200]}
        print(json.dumps({"row": f"cnn/c{clients}/{precision}", "variant": name, **found}))
    rows = []
    for entry in results.values():
        if entry.get("times"):
            median = statistics.median(entry["times"])
            entry["median_s"] = median
            entry["tflop_per_s"] = flops / median / 1e12
            if peak:
                entry["of_peak"] = flops / median / peak
            if peak and device == "tpu":
                entry["of_precision_peak"] = flops / median / (peak / PASSES[precision])
        entry["flops"] = flops
        print(json.dumps(entry), flush=True)
        rows.append(entry)
    return rows


def parse_rows(
    parser: argparse.ArgumentParser, specs: list[str], precisions: Iterable[str]
) -> list[tuple[int, str]]:
    """Each CLIENTS:PRECISION of `specs` as (clients, precision); `parser.error` for one that is
    not (PRECISION one of `precisions`)."""
    rows = []
    for spec in specs:
        clients, _, precision = spec.partition(":")
        if not clients.isdigit() or precision not in precisions:
            parser.error(f"--rows: expected CLIENTS:PRECISION as 50:medium, got {spec!r}")
        rows.append((int(clients), precision))
    return rows


def _cell(row: dict[str, Any], name: str, form: str, scale: float = 1.0) -> str:
    return format(row[name] * scale, form) if name in row else "—"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="tpu", choices=("tpu", "cpu", "cuda"))
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--chunks", nargs="*", type=int, default=[100])
    parser.add_argument("--grouped", nargs="*", type=int, default=[], help="chunks of G")
    parser.add_argument("--packed", nargs="*", type=int, default=[], help="packed chunks of G")
    parser.add_argument(
        "--unroll", nargs="*", type=int, default=[], help="packed, local steps unrolled U a loop"
    )
    parser.add_argument(
        "--convolutions", action="store_true", help="packed, every convolution kept one"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--until", type=float, default=float("inf"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="device ops of one round each")
    args = parser.parse_args(argv)
    specs = parse_rows(parser, args.rows, PASSES)
    until = time.monotonic() + args.until
    rows: list[dict[str, Any]] = []
    for clients, precision in specs:
        if time.monotonic() > until:
            skipped = {"row": f"{clients}:{precision}", "skipped": "past --until"}
            print(json.dumps(skipped), flush=True)
            continue
        rows += _row(
            clients,
            precision,
            args.device,
            args.reps,
            args.chunks,
            args.grouped,
            args.packed,
            args.unroll,
            until,
            args.profile,
            args.convolutions,
        )
    lines = [
        "| row | variant | first call s | median | TFLOP/s | of the peak | of the precision's "
        "peak (TPU) | vs first variant | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['variant']} | {r['error'][:60]} | | | | | | |")
            continue
        cells = [
            _cell(r, "first_s", ".2f"),
            _cell(r, "median_s", ".1f", 1e3) + " ms",
            _cell(r, "tflop_per_s", ".2f"),
            _cell(r, "of_peak", ".1%"),
            _cell(r, "of_precision_peak", ".1%"),
            _cell(r, "error_vs_first", ".1e"),
            ", ".join(f"{x:.1f}" for x in r.get("load", [])),
        ]
        lines.append(f"| {r['row']} | {r['variant']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
