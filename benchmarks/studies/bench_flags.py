"""YNNPACK fusion settings, compared per compilation on the programs bridge_mr compiles.

    python -m benchmarks.studies.bench_flags [--settings NAME ...] [--rows NAME ...] [--reps N]
    python -m benchmarks.studies.bench_flags --sums [--reps N]      # levelled sums, CNN rounds
    python -m benchmarks.studies.bench_flags --frontend [--reps N]  # GPT-2 FedSGD: frontend, jit

`--xla_cpu_experimental_ynn_fusion_type` (which XLA:CPU fusions go to YNNPACK) is also a
per-compilation option (`compile(compiler_options={...})`), so every setting compiles the same
lowered program in this one process and `harness.compare` times them interleaved, which cancels
the machine's load drift between settings. The process sets no XLA flag: "default" is jaxlib's
own setting (on jaxlib 0.10.2 the same compiled programs as `REDUCE,INDIVIDUAL_DOT`), the
baseline of the ratios; "no_reduce" is what the former process flag
`--xla_cpu_experimental_ynn_fusion_type=-reduce` compiled (the same programs as
`INDIVIDUAL_DOT`; the per-compile option takes enum names only). The rows are pure-JAX programs
through `jax_core.map_reduce` (bridge_mr's own programs, without the torch side), and a
transformers GPT-2 FedSGD gradient through `from_torch`.

`--sums`: the CNN rounds compiled as bridge_mr compiles them (no YNNPACK fusion), their sums
sequential (`canonical_layouts` only, as before) against in levels (`cpu_program`), interleaved.
`--frontend`: the GPT-2 FedSGD round through the torch frontend (`bridge_mr.map_reduce` forward
and `.backward()`, options chosen per program) against `jax.jit(jax.value_and_grad(...))` of
the same converted mean loss with jaxlib's defaults, interleaved.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import harness
from ..environment import LoadMeter

OPTION = "xla_cpu_experimental_ynn_fusion_type"
_DOT, _ELTWISE = "LIBRARY_FUSION_TYPE_DOT", "LIBRARY_FUSION_TYPE_ELTWISE"

#: Setting -> the option's value (None: jaxlib's default; this process sets no XLA flag).
SETTINGS: dict[str, str | None] = {
    "default": None,
    "no_reduce": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "none": "",
    "dot+eltwise": f"{_DOT},{_ELTWISE}",
    "dot": _DOT,
    "individual_dot": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "individual_conv": "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION",
}

#: Row -> (model, algorithm, clients, strategy).
ROWS: dict[str, tuple[str, str, int, str]] = {
    "cnn fedavg c8 per_client": ("cnn", "fedavg", 8, "per_client"),
    "cnn fedavg c8 vmap": ("cnn", "fedavg", 8, "vmap"),
    "lm fedavg c4 per_client": ("lm", "fedavg", 4, "per_client"),
    "small fedsgd c64 vmap": ("small", "fedsgd", 64, "vmap"),
    "medium fedsgd c64 vmap": ("medium", "fedsgd", 64, "vmap"),
    "medium fedsgd c64 chunks": ("medium", "fedsgd", 64, "chunks"),
    "small fedavg c64 vmap": ("small", "fedavg", 64, "vmap"),
    "medium fedavg c8 vmap": ("medium", "fedavg", 8, "vmap"),
    "medium fedavg c8 chunks": ("medium", "fedavg", 8, "chunks"),
    "gpt2 fedsgd c16 vmap": ("gpt2", "fedsgd", 16, "vmap"),
}
CHUNK_SIZE = 16


def _program(row: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The row's round as a JAX function and its arguments."""
    import jax
    import jax.numpy as jnp

    from bridge_mr import jax_core

    from .. import workloads

    model, algo, clients, strategy = ROWS[row]
    chunks = {"chunk_size": CHUNK_SIZE} if strategy == "chunks" else {}
    if model == "gpt2":
        return _gpt2_fedsgd(clients, strategy)
    if model in ("cnn", "lm"):
        cfg = workloads.round_config(model, clients)
        params, data = workloads.round_jax_state(cfg)
        update = workloads.round_client_update(cfg)
        return functools.partial(jax_core.map_reduce, update, strategy=strategy, **chunks), (
            params,
            data,
        )
    fed = workloads.FedConfig(algo, model, clients)
    torch_params = workloads.torch_model(fed.widths).named_parameters()
    params = {name: jnp.asarray(p.detach().numpy()) for name, p in torch_params}
    x, y = workloads.client_data(fed)
    data = (jnp.asarray(x), jnp.asarray(y))
    if algo == "fedsgd":  # One batch per client: the client's data is its batch.

        def mean_loss(p: Any, d: Any) -> Any:
            return jax_core.map_reduce(workloads.jax_loss, p, d, strategy=strategy, **chunks)

        return jax.grad(mean_loss), (params, data)
    update = workloads.client_update(fed)
    return functools.partial(jax_core.map_reduce, update, strategy=strategy, **chunks), (
        params,
        data,
    )


def _gpt2_client(clients: int) -> tuple[Callable[..., Any], dict[str, Any], Any]:
    """A transformers GPT-2 (2 layers x 64, vocab 256) client loss through `from_torch` (the
    model's own `labels=` loss), its parameters, and `clients` clients of 8 sequences of 32
    tokens."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    import bridge_mr

    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()

    def loss(params: Any, ids: Any) -> Any:
        return torch.func.functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss

    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.named_parameters()}
    ids = jax.random.randint(jax.random.key(0), (clients, 8, 32), 0, 256)
    return bridge_mr.from_torch(loss), params, ids


def _gpt2_fedsgd(clients: int, strategy: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The gradient of the GPT-2 FedSGD round (`_gpt2_client`) through `jax_core.map_reduce`."""
    import jax

    from bridge_mr import jax_core

    converted, params, ids = _gpt2_client(clients)

    def mean_loss(p: Any, d: Any) -> Any:
        return jax_core.map_reduce(converted, p, d, strategy=strategy)

    return jax.grad(mean_loss), (params, ids)


SUMS_ROWS = ("cnn fedavg c8 per_client", "cnn fedavg c8 vmap")


def _sums_alternatives(row: str) -> dict[str, Callable[[], Any] | str]:
    import jax

    from bridge_mr import jax_core

    fn, args = _program(row)
    out: dict[str, Callable[[], Any] | str] = {}
    for name, wrap in (
        ("sequential", jax_core.canonical_layouts),
        ("levels", jax_core.cpu_program),
    ):
        program = wrap(fn)
        options = jax_core.cpu_compiler_options(jax.make_jaxpr(program)(*args))
        out[name] = functools.partial(jax.jit(program).lower(*args).compile(options), *args)
    return out


def _frontend_alternatives() -> dict[str, Callable[[], Any] | str]:
    import jax
    import torch

    import bridge_mr

    converted, params, ids = _gpt2_client(16)
    tensors = {k: torch.from_dlpack(v).clone().requires_grad_() for k, v in params.items()}
    ids_torch = torch.from_dlpack(ids).clone()

    def frontend() -> Any:
        for p in tensors.values():
            p.grad = None
        loss = bridge_mr.map_reduce(converted, tensors, ids_torch, strategy="vmap")
        loss.backward()
        return loss

    mean = lambda p, d: jax.vmap(converted, in_axes=(None, 0))(p, d).mean()
    jitted = jax.jit(jax.value_and_grad(mean))
    return {
        "jax.jit": lambda: jax.block_until_ready(jitted(params, ids)),
        "bridge_mr": frontend,
    }


def _table(
    title: str,
    alternatives: dict[str, dict[str, Callable[[], Any] | str]],
    baseline: str,
    policy: Any,
) -> dict[str, Any]:
    """Times each row's alternatives interleaved; prints a table; returns the results."""
    names = list(next(iter(alternatives.values())))
    print(f"\n{title}\n\n| row | " + " | ".join(f"`{n}`" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    results: dict[str, Any] = {}
    for row, alts in alternatives.items():
        comparison = harness.compare(alts, baseline=baseline, policy=policy)
        cells, results[row] = [], {}
        for name in names:
            if not comparison.ok(name):
                cells.append("n/a")
                results[row][name] = str(comparison.timings[name].error)
                continue
            median = comparison.median(name)
            ratio = comparison.ratio(name, baseline)
            results[row][name] = {"median_s": median, **({"ratio": ratio} if ratio else {})}
            text = f"{median * 1e3:.1f} ms"
            if ratio is not None and name != baseline:
                text += f" ({ratio['median']:.2f}x)"
            cells.append(text)
        print(f"| {row} | " + " | ".join(cells) + " |", flush=True)
    return results


def _alternatives(row: str, settings: list[str]) -> dict[str, Callable[[], Any] | str]:
    import jax

    fn, args = _program(row)
    lowered = jax.jit(fn).lower(*args)
    out: dict[str, Callable[[], Any] | str] = {}
    for setting in settings:
        value = SETTINGS[setting]
        try:
            compiled = lowered.compile() if value is None else lowered.compile({OPTION: value})
        except Exception as err:  # A setting this jaxlib rejects is a result to report.
            out[setting] = f"{type(err).__name__}: {err}"
            continue
        out[setting] = functools.partial(compiled, *args)
    return out


def main(argv: list[str]) -> int:
    """Times every setting on every row and prints the table; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.bench_flags")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--reps", type=int, default=harness.QUICK.reps)
    parser.add_argument("--sums", action="store_true", help="levelled sums' cost (CNN rounds)")
    parser.add_argument("--frontend", action="store_true", help="GPT-2: torch frontend vs jit")
    args = parser.parse_args(argv)
    if "ynn_fusion_type" in os.environ.get("XLA_FLAGS", ""):
        parser.error("run without --xla_cpu_experimental_ynn_fusion_type in XLA_FLAGS")
    settings = ["default", *(s for s in args.settings if s != "default")]
    policy = harness.TimingPolicy(
        reps=args.reps,
        min_reps=min(args.reps, harness.QUICK.min_reps),
        warmup=1,
        min_sample_s=harness.QUICK.min_sample_s,
        budget_s=harness.QUICK.budget_s,
    )
    meter = LoadMeter()
    if args.sums:
        tables = {row: _sums_alternatives(row) for row in SUMS_ROWS}
        results = _table("Sums: sequential vs in levels", tables, "sequential", policy)
    elif args.frontend:
        tables = {"gpt2 fedsgd c16": _frontend_alternatives()}
        results = _table("GPT-2 FedSGD: jax.jit vs the torch frontend", tables, "jax.jit", policy)
    else:
        tables = {row: _alternatives(row, settings) for row in args.rows}
        results = _table("YNNPACK fusion settings", tables, "default", policy)
    load = meter.read()
    busy, wall = load["other_cpus_busy"], load["wall_s"]
    print(f"\nXLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; other processes kept {busy:.2f} CPUs")
    print(f"busy on average ({wall:.0f} s).")
    print(json.dumps({"settings": SETTINGS, "results": results, "load": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
