"""The CNN round written in JAX by hand, in several forms, side by side in one process (issue 42).

    python -m benchmarks.studies.bench_cnn_forms [--rows 50:medium ...] [--variants ...]
        [--reps N] [--cpu-reference] [--profile]

The round is the accelerator case's CNN row (pfl-research's CIFAR10 simple_cnn: conv 3->32,
conv 32->64, 2x2 max-pool, linear 12,544->128, linear 128->10; 5 local SGD steps of 10 images
per client, the mean delta added to the server's parameters), written directly in JAX rather
than through `from_torch`, so that each choice a lowering could make is one flag. A variant is
FORM:POOL:LAYOUT[:dot|:lanes|:lanesstep][:uK][:oK][:vK]:

* FORM "vmap" (`jax.vmap` over clients: per-client kernels become grouped convolutions),
  "map" (`lax.scan` over clients, one client at a time, as bridge_mr's per_client) or "packG"
  (`lax.scan` over groups of G clients, G dividing the clients: the group's images side by side
  in the channels, its kernels as one block-diagonal kernel, so each convolution is one dense
  convolution of G times the channels; G times the arithmetic, but the MXU's 128 lanes fuller
  than with one client's 32 or 64 channels, and G times fewer steps one after another);
* POOL "rw" (`lax.reduce_window`, as torchax lowers `max_pool2d`; JAX's gradient is a
  select-and-scatter) or "rs" (a reshape and a max, whose gradient goes to the window's first
  maximum, torch's choice, elementwise);
* LAYOUT "nchw" (torch's) or "nhwc";
* an optional ":dot": the first linear layer contracts the pooled activations' channels and
  positions directly (its weights seen as [128, C, H, W]) instead of a flattened copy in torch's
  (C, H, W) order. On the chip, XLA lays the per-client activations out with the batch between
  positions and channels, so flattening them copies twice a step;
* an optional ":lanes", packG only: the first linear layer contracts the packed channels whole,
  never splitting them into G x 64. Its weights are held, for the whole round, as one
  [128, 14, 14, G x 64] array whose channel g x 64 + c is client g's channel c (one transpose
  of the server's weights before the clients, one fold of the summed deltas after them), and
  its input is the pooled activations G times over, copy g keeping only client g's channels
  (the others zero: `where`, not a product, so an infinity stays in its client): one dense
  product of G x batch rows, G times the layer's arithmetic, and each client's gradient in its
  own channels;
* an optional ":lanesstep", packG only: as ":lanes", but the weights stay each client's own
  [128, 12544] (torch's order, as vmap holds them) and are viewed as the packed array at
  every local step (a transpose of the weights and of their gradient a step);
* an optional ":uK": the scan over a client's local steps unrolled K times (`lax.scan`'s
  `unroll`; K = the steps: no loop), so XLA may fuse and schedule across steps (one step's
  update with the next one's use of the weights) instead of paying a loop iteration a step;
* an optional ":oK": the scan over clients (or groups of G) unrolled K times;
* an optional ":vK", not with "vmap": K clients (or groups of G) at a time under `jax.vmap`
  in each step of the scan over clients, so each operation of a step is K times larger and
  there are K times fewer steps; packed groups' convolutions become grouped convolutions of K
  groups of G times the channels (pack2: 128 output channels a group, a full MXU tile).

A row is CLIENTS:PRECISION (torch's name: "highest", "high" or "medium"). Per row, each
variant's first call apart, then `--reps` rounds interleaved; each variant's delta against the
first variant's (max |difference| / max |value| over the parameters), and with
`--cpu-reference` against the first variant on the host CPU, per parameter (a ReLU whose input
rounds to the other side of 0 moves a convolution's gradient by ~1e-2 of its largest entry:
compare variants, not single digits). With `--profile`, each variant's device ops
(`bench_conv_lowering.device_ops`). Results are JSON lines as they come, then a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.studies import bench_conv_lowering

STEPS, BATCH, LR = 5, 10, 0.05
#: torch's float32 matmul precision -> JAX's name for it.
PRECISION = {"highest": "highest", "high": "high", "medium": "bfloat16"}
VARIANTS = (
    "vmap:rw:nchw", "vmap:rs:nchw", "map:rw:nchw", "map:rs:nchw", "map:rs:nhwc", "map:rs:nchw:dot",
    "map:rs:nhwc:dot", "pack2:rs:nchw", "pack5:rs:nchw", "pack5:rs:nhwc:dot",
)  # fmt: skip
#: The options for the first linear layer, at most one a variant.
LINEAR = ("dot", "lanes", "lanesstep")
#: One example's forward and backward operations (3x the forward's).
FLOPS_PER_EXAMPLE = 3 * 2 * (30 * 30 * 32 * 27 + 28 * 28 * 64 * 288 + 12544 * 128 + 128 * 10)


def pool_reduce_window(x: Any, nhwc: bool) -> Any:
    import jax

    dims = (1, 2, 2, 1) if nhwc else (1, 1, 2, 2)
    return jax.lax.reduce_window(x, -np.inf, jax.lax.max, dims, dims, "VALID")


def pool_reshape(nhwc: bool) -> Callable[[Any], Any]:
    """2x2 max-pool as a reshape and a max; its JVP routes each window's tangent from the first
    maximum in row-major order (torch's choice, and `reduce_window`'s)."""
    import jax
    import jax.numpy as jnp

    def windows(x: Any) -> Any:
        if nhwc:
            n, h, w, c = x.shape
            return x.reshape(n, h // 2, 2, w // 2, 2, c)
        n, c, h, w = x.shape
        return x.reshape(n, c, h // 2, 2, w // 2, 2)

    def at(x: Any, i: int, j: int) -> Any:
        return x[:, :, i, :, j] if nhwc else x[:, :, :, i, :, j]

    axes = (2, 4) if nhwc else (3, 5)

    @jax.custom_jvp
    def pool(x: Any) -> Any:
        return windows(x).max(axis=axes)

    @pool.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        xr, tr = windows(primals[0]), windows(tangents[0])
        y = xr.max(axis=axes)
        found = jnp.zeros(y.shape, bool)
        out = jnp.zeros(y.shape, tr.dtype)
        for i in range(2):
            for j in range(2):
                chosen = (at(xr, i, j) == y) & ~found
                found = found | chosen
                out = out + jnp.where(chosen, at(tr, i, j), 0)
        return y, out

    return pool


def init(key: Any) -> dict[str, Any]:
    """The server's parameters, torch's names and shapes (OIHW kernels, [out, in] weights)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(key, 4)

    def uniform(k: Any, shape: tuple[int, ...], fan_in: int) -> Any:
        return jax.random.uniform(k, shape, jnp.float32, -1, 1) / float(np.sqrt(fan_in))

    return {
        "c1": uniform(keys[0], (32, 3, 3, 3), 27), "b1": jnp.zeros(32),
        "c2": uniform(keys[1], (64, 32, 3, 3), 288), "b2": jnp.zeros(64),
        "l1": uniform(keys[2], (128, 12544), 12544), "d1": jnp.zeros(128),
        "l2": uniform(keys[3], (10, 128), 128), "d2": jnp.zeros(10),
    }  # fmt: skip


def parse_variant(variant: str) -> list[str]:
    """FORM:POOL:LAYOUT[:dot|:lanes|:lanesstep][:uK][:oK][:vK] as its parts; a ValueError that
    says what is expected."""
    parts = variant.split(":")
    choices = (("vmap", "map"), ("rw", "rs"), ("nchw", "nhwc"))
    packed = re.fullmatch(r"pack([2-9]|[1-9][0-9]+)", parts[0])
    options = parts[3:]
    expected = (*LINEAR, "u", "o", "v")  # in this order, each at most once
    kinds = [o if o in LINEAR else o[:1] for o in options]
    if (
        len(parts) < 3
        or (parts[0] not in choices[0] and not packed)
        or any(p not in c for p, c in zip(parts[1:3], choices[1:], strict=True))
        or any(o not in LINEAR and not re.fullmatch(r"[uov][1-9][0-9]*", o) for o in options)
        or kinds != sorted(set(kinds), key=expected.index)
        or (parts[0] == "vmap" and ("o" in kinds or "v" in kinds))
        or sum(k in kinds for k in LINEAR) > 1
        or (("lanes" in kinds or "lanesstep" in kinds) and not packed)
    ):
        raise ValueError(
            f"--variants: expected FORM:POOL:LAYOUT[:dot|:lanes|:lanesstep][:uK][:oK][:vK] "
            f"(FORM vmap, map or packG with G >= 2; lanes, lanesstep: packG only; uK: local "
            f"steps unrolled K times; oK, not with vmap: clients unrolled K times; vK, not with "
            f"vmap: K clients or groups vmapped a step) as {VARIANTS[0]}, map:rs:nhwc:dot or "
            f"pack2:rs:nchw:lanes:u5:o2:v5, got {variant!r}"
        )
    return parts


def unrolls(parts: list[str]) -> tuple[int, int, int]:
    """The (local steps, clients) unroll factors and the clients (or groups) vmapped a step
    that a parsed variant names; 1 where it names none."""
    found = {o[0]: int(o[1:]) for o in parts[3:] if o not in LINEAR}
    return found.get("u", 1), found.get("o", 1), found.get("v", 1)


def group_size(form: str) -> int:
    """G of a form "packG"; 1 for "vmap" and "map"."""
    return int(form[4:]) if form.startswith("pack") else 1


def pool_named(pool_name: str, nhwc: bool) -> Callable[[Any], Any]:
    """The 2x2 max-pool POOL names: "rw" (`reduce_window`) or "rs" (a reshape)."""
    if pool_name == "rw":
        return functools.partial(pool_reduce_window, nhwc=nhwc)
    return pool_reshape(nhwc)


def pre_activations(p: Any, x: Any, nhwc: bool = False) -> list[Any]:
    """The two convolutions' ReLU inputs of one client's images (NCHW, or NHWC)."""
    import jax

    dn = ("NHWC", "OIHW", "NHWC") if nhwc else ("NCHW", "OIHW", "NCHW")
    bias = (1, 1, 1, -1) if nhwc else (1, -1, 1, 1)
    found, h = [], x
    for kernel, b in (("c1", "b1"), ("c2", "b2")):
        h = jax.lax.conv_general_dilated(h, p[kernel], (1, 1), "VALID", dimension_numbers=dn)
        found.append(h + p[b].reshape(bias))
        h = jax.nn.relu(found[-1])
    return found


def make_loss(pool_name: str, layout: str, dot: bool) -> Callable[..., Any]:
    """One client's loss (params, images [batch, 3, 32, 32], labels [batch]) -> mean
    cross-entropy, in the form POOL, LAYOUT (and ":dot") name."""
    import jax
    import jax.numpy as jnp

    nhwc = layout == "nhwc"
    pool = pool_named(pool_name, nhwc)

    def loss(p: Any, x: Any, y: Any) -> Any:
        h = jnp.transpose(x, (0, 2, 3, 1)) if nhwc else x
        h = pool(jax.nn.relu(pre_activations(p, h, nhwc)[-1]))
        if dot:  # [N, C, H, W] (or NHWC) against l1 as [128, C, H, W]: no flattened copy
            w1 = p["l1"].reshape(128, 64, 14, 14)
            h = jnp.einsum("nhwc,ochw->no" if nhwc else "nchw,ochw->no", h, w1)
        else:
            h = jnp.transpose(h, (0, 3, 1, 2)) if nhwc else h  # torch's flatten order
            h = h.reshape(h.shape[0], -1) @ p["l1"].T
        h = jax.nn.relu(h + p["d1"])
        logits = h @ p["l2"].T + p["d2"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    return loss


def make_packed_loss(
    groups: int, pool_name: str, layout: str, dot: bool, lanes: str = ""
) -> Callable[..., Any]:
    """G = `groups` clients' summed losses (params with a leading [G], images [G, batch, 3, 32,
    32], labels [G, batch]) -> the sum of each client's mean cross-entropy, whose gradient is
    each client's own. The G clients' images lie side by side in the channels and each
    convolution is one dense convolution with a block-diagonal kernel: zeros off the diagonal
    blocks add exact zeros, so each client's values are its own. With `lanes` "lanes", "l1" is
    the group's one [128, 14, 14, G x 64] array (`packed_linear`) and the layer contracts the
    packed channels whole; with "lanesstep", the same from each client's own "l1"."""
    import jax
    import jax.numpy as jnp

    nhwc = layout == "nhwc"
    pool = pool_named(pool_name, nhwc)

    def block_diagonal(kernels: Any) -> Any:  # [G, O, I, kh, kw] -> [G*O, G*I, kh, kw]
        # Set into zeros (no product: a product with an identity would round to bf16 at
        # "medium", and its gradient too).
        g, o, i, kh, kw = kernels.shape
        at = jnp.arange(g)
        dense = jnp.zeros((g, o, g, i, kh, kw), kernels.dtype).at[at, :, at].set(kernels)
        return dense.reshape(g * o, g * i, kh, kw)

    def loss(p: Any, x: Any, y: Any) -> Any:
        g, n = x.shape[:2]  # channels g-major: client g's channel c is g * C + c
        h = jnp.transpose(x, (1, 3, 4, 0, 2) if nhwc else (1, 0, 2, 3, 4))
        h = h.reshape(n, 32, 32, g * 3) if nhwc else h.reshape(n, g * 3, 32, 32)
        convs = {"c1": block_diagonal(p["c1"]), "c2": block_diagonal(p["c2"])}
        packed = {**convs, "b1": p["b1"], "b2": p["b2"]}
        h = pool(jax.nn.relu(pre_activations(packed, h, nhwc)[-1]))  # [N, G*64, 14, 14] or NHWC
        if lanes:  # copy g keeps client g's channels: [G, N, ...], then one dense product
            mask = jnp.arange(g * 64) // 64 == jnp.arange(g)[:, None]  # [G, G*64]
            mask = mask[:, None, None, None] if nhwc else mask[:, None, :, None, None]
            h = jnp.where(mask, h[None], jnp.zeros((), h.dtype))
            w1 = p["l1"] if lanes == "lanes" else packed_view(p["l1"])
            h = jnp.einsum("gnhwk,ohwk->gno" if nhwc else "gnkhw,ohwk->gno", h, w1)
        elif dot:
            w1 = p["l1"].reshape(g, 128, 64, 14, 14)
            h = h.reshape(n, 14, 14, g, 64) if nhwc else h.reshape(n, g, 64, 14, 14)
            h = jnp.einsum("nhwgc,gochw->gno" if nhwc else "ngchw,gochw->gno", h, w1)
        else:  # torch's flatten order, per client
            h = h.reshape(n, 14, 14, g, 64) if nhwc else h.reshape(n, g, 64, 14, 14)
            h = jnp.transpose(h, (3, 0, 4, 1, 2)) if nhwc else jnp.swapaxes(h, 0, 1)
            h = jnp.einsum("gnk,gok->gno", h.reshape(g, n, -1), p["l1"])
        h = jax.nn.relu(h + p["d1"][:, None])
        logits = jnp.einsum("gnk,gok->gno", h, p["l2"]) + p["d2"][:, None]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)
        return -jnp.sum(jnp.mean(picked[..., 0], axis=1))

    return loss


def packed_linear(l1: Any, groups: int) -> Any:
    """The first linear layer's weights [128, 12544] (torch's (C, H, W) order) as G clients'
    one [128, 14, 14, G x 64] array, channel g x 64 + c holding client g's channel c."""
    import jax.numpy as jnp

    return jnp.tile(jnp.transpose(l1.reshape(128, 64, 14, 14), (0, 2, 3, 1)), groups)


def packed_view(l1: Any) -> Any:
    """G clients' own first-layer weights [G, 128, 12544] as `packed_linear`'s one array."""
    import jax.numpy as jnp

    g = l1.shape[0]
    view = jnp.transpose(l1.reshape(g, 128, 64, 14, 14), (1, 3, 4, 0, 2))
    return view.reshape(128, 14, 14, g * 64)


def unpacked_linear(packed: Any, groups: int) -> Any:
    """`packed_linear`'s inverse, the G clients' weights summed: [128, 12544] in (C, H, W)."""
    import jax.numpy as jnp

    summed = packed.reshape(128, 14, 14, groups, 64).sum(3)
    return jnp.transpose(summed, (0, 3, 1, 2)).reshape(128, 12544)


def make_round(variant: str) -> Callable[..., Any]:
    """The jitted round (server params, images [C, steps, batch, 3, 32, 32], labels) -> params."""
    import jax
    import jax.numpy as jnp

    parts = parse_variant(variant)
    form, pool_name, layout = parts[:3]
    linear = next((o for o in parts[3:] if o in LINEAR), "")
    dot = linear == "dot"
    lanes = "" if dot else linear  # "", "lanes" or "lanesstep"
    unroll_steps, unroll_clients, vmapped = unrolls(parts)
    groups = group_size(form)
    if groups > 1:
        loss = make_packed_loss(groups, pool_name, layout, dot, lanes)
    else:
        loss = make_loss(pool_name, layout, dot)

    def client(p: Any, xs: Any, ys: Any) -> Any:
        """One client's (or, packed, one group's: [G, steps, ...]) summed deltas (with
        `lanes`, "l1"'s packed, not summed: `packed_linear`)."""
        if groups > 1:  # the group's local steps side by side: [steps, G, ...]
            xs, ys = jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ys, 0, 1)
            p = {
                k: a if lanes == "lanes" and k == "l1" else jnp.broadcast_to(a, (groups, *a.shape))
                for k, a in p.items()
            }

        def step(q: Any, batch: Any) -> tuple[Any, None]:
            g = jax.grad(loss)(q, *batch)
            return jax.tree.map(lambda a, d: a - LR * d, q, g), None

        trained = jax.lax.scan(step, p, (xs, ys), unroll=unroll_steps)[0]
        deltas = jax.tree.map(jnp.subtract, trained, p)
        if groups == 1:
            return deltas
        return {k: a if lanes == "lanes" and k == "l1" else a.sum(0) for k, a in deltas.items()}

    @jax.jit
    def round_(p: Any, xs: Any, ys: Any) -> Any:
        clients, server = xs.shape[0], p
        if lanes == "lanes":
            p = {**p, "l1": packed_linear(p["l1"], groups)}
        if form == "vmap":
            deltas = jax.vmap(client, in_axes=(None, 0, 0))(p, xs, ys)
            delta = jax.tree.map(lambda a: a.mean(0), deltas)
        else:
            # [clients / (G K), K, G, steps, ...], without the G (or K) axis where it is 1
            inner = (vmapped,) * (vmapped > 1) + (groups,) * (groups > 1)
            batches = jax.tree.map(lambda a: a.reshape(-1, *inner, *a.shape[1:]), (xs, ys))
            each = client
            if vmapped > 1:

                def each(p: Any, xs: Any, ys: Any) -> Any:
                    deltas = jax.vmap(client, in_axes=(None, 0, 0))(p, xs, ys)
                    return jax.tree.map(lambda a: a.sum(0), deltas)

            def add(total: Any, batch: Any) -> tuple[Any, None]:
                return jax.tree.map(jnp.add, total, each(p, *batch)), None

            zeros = jax.tree.map(jnp.zeros_like, p)
            total = jax.lax.scan(add, zeros, batches, unroll=unroll_clients)[0]
            if lanes == "lanes":
                total = {**total, "l1": unpacked_linear(total["l1"], groups)}
            delta = jax.tree.map(lambda a: a / clients, total)
        return jax.tree.map(jnp.add, server, delta)

    return round_


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _errors(got: Any, want: Any) -> dict[str, float]:
    return {k: relative_error(got[k], want[k]) for k in sorted(want)}


def run_row(
    clients: int, precision: str, variants: list[str], reps: int, cpu: bool, profile: bool
) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    row = f"cnn/c{clients}/{precision}"
    rng = np.random.default_rng(0)
    images = rng.standard_normal((clients, STEPS, BATCH, 3, 32, 32), np.float32)
    labels = rng.integers(0, 10, (clients, STEPS, BATCH)).astype(np.int32)
    device = jax.devices()[0]
    args = jax.device_put((init(jax.random.key(0)), images, labels), device)

    def delta(out: Any, server: Any) -> dict[str, Any]:
        return jax.tree.map(jnp.subtract, out, server)

    rounds, entries, first, on_cpu = {}, {}, None, None
    with jax.default_matmul_precision(PRECISION[precision]):
        for name in variants:
            entry: dict[str, Any] = {"row": row, "variant": name}
            start = time.perf_counter()
            try:
                fn = make_round(name)
                out = delta(jax.block_until_ready(fn(*args)), args[0])
            except Exception as error:  # Out of memory, mostly: the row says so and goes on.
                entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                print(json.dumps(entry), flush=True)
                continue
            entry["first_s"] = time.perf_counter() - start
            first = out if first is None else first
            entry["error_vs_first"] = max(_errors(out, first).values())
            if cpu and on_cpu is None:
                host = jax.device_put(args, jax.devices("cpu")[0])
                on_cpu = delta(make_round(variants[0])(*host), host[0])
            if on_cpu is not None:
                entry["error_vs_cpu"] = _errors(out, on_cpu)
            rounds[name], entries[name] = fn, entry
            entry["times"] = []
            print(json.dumps(entry), flush=True)
        names = list(rounds)
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                start = time.perf_counter()
                jax.block_until_ready(rounds[name](*args))
                entries[name]["times"].append(time.perf_counter() - start)
        for name in names if profile else []:
            fn = rounds[name]
            ops = bench_conv_lowering.device_ops(lambda fn=fn: jax.block_until_ready(fn(*args)))
            print(json.dumps({"row": row, "variant": name, **ops}), flush=True)
    flops = clients * STEPS * BATCH * FLOPS_PER_EXAMPLE
    for entry in entries.values():
        if entry["times"]:
            entry["median_s"] = statistics.median(entry["times"])
            entry["tflop_per_s"] = flops / entry["median_s"] / 1e12
        print(json.dumps(entry), flush=True)
    return list(entries.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=["50:medium", "50:highest", "500:medium"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cpu-reference", action="store_true")
    parser.add_argument("--profile", action="store_true", help="device ops of one round each")
    args = parser.parse_args(argv)
    specs = bench_conv_lowering.parse_rows(parser, args.rows, PRECISION)
    for variant in args.variants:
        try:
            parts = parse_variant(variant)
        except ValueError as error:
            parser.error(str(error))
        step = group_size(parts[0]) * unrolls(parts)[2]
        for clients, precision in specs:
            if clients % step:
                parser.error(
                    f"--variants {variant}: its steps of {step} clients (G times the K of "
                    f":vK) do not divide the row {clients}:{precision}'s clients; pick G and "
                    f"K whose product divides them"
                )
    rows = []
    for clients, precision in specs:
        rows += run_row(
            clients, precision, args.variants, args.reps, args.cpu_reference, args.profile
        )
    print("| row | variant | first call s | median | TFLOP/s | vs first variant |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        median = f"{r['median_s'] * 1e3:.1f} ms" if "median_s" in r else "—"
        rate = f"{r['tflop_per_s']:.2f}" if "tflop_per_s" in r else "—"
        print(
            f"| {r['row']} | {r['variant']} | {r['first_s']:.2f} | {median} | {rate} | "
            f"{r['error_vs_first']:.1e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
