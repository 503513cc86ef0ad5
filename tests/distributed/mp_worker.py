"""A torchrun worker: `map_reduce` over every rank's clients, checked against torch.

Run by tests/distributed/test_map_reduce_processes.py as
`python -m torch.distributed.run --nproc-per-node=2 mp_worker.py COUNTS SCENARIO...`, where
COUNTS are the client counts by rank ("4,3"). Each scenario writes one line per rank,
`<scenario> <json>`, to `$RESULTS_DIR/rank<rank>.txt` (a file per rank: the ranks' stdout
interleaves); the test compares the ranks' lines and the values.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
import bridge_mr  # noqa: E402

PROCESS = bridge_mr.distributed.initialize(heartbeat_timeout_seconds=10)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

COUNTS = [int(c) for c in sys.argv[1].split(",")]
TOTAL = sum(COUNTS)
LO = sum(COUNTS[: PROCESS.rank])
HI = LO + COUNTS[PROCESS.rank]
_data = torch.Generator().manual_seed(1)
XS = torch.randn(TOTAL, 6, 5, generator=_data)
YS = torch.randint(0, 3, (TOTAL, 6), generator=_data)  # int64, as torch makes labels
SIZES = torch.randint(1, 7, (TOTAL,), generator=_data).float()  # examples per client


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # The same initial parameters on every rank, as with DDP.
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def logits(p: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"]


def client_loss(p: dict, c: dict) -> jax.Array:
    logp = jax.nn.log_softmax(logits(p, c["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, c["y"][:, None], axis=1))


def local_sgd(p: dict, c: dict) -> dict:
    """Two local SGD steps; returns the delta (new - old)."""
    new = p
    for _ in range(2):
        grads = jax.grad(client_loss)(new, c)
        new = jax.tree.map(lambda w, g: w - 0.3 * g, new, grads)
    return jax.tree.map(jnp.subtract, new, p)


def mine(tree: dict) -> dict:
    return {k: v[LO:HI] for k, v in tree.items()}


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def report(name: str, **values: object) -> None:
    path = os.path.join(os.environ["RESULTS_DIR"], f"rank{PROCESS.rank}.txt")
    with open(path, "a") as out:
        out.write(f"{name} {json.dumps(values, sort_keys=True)}\n")


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()


def fedsgd(strategy: str, **options: object) -> None:
    """3 FedSGD steps over every rank's clients, against the same steps in torch."""
    m, ref = model(), model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = bridge_mr.map_reduce(
            client_loss,
            dict(m.named_parameters()),
            mine({"x": XS, "y": YS}),
            strategy=strategy,
            **options,
        )
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        torch.stack([F.cross_entropy(ref(XS[i]), YS[i]) for i in range(TOTAL)]).mean().backward()
        ref_opt.step()
    report(
        f"fedsgd_{strategy}",
        digest=digest(flat(m)),
        params=flat(m).tolist(),
        max_error=float((flat(m) - flat(ref)).abs().max()),
        losses=losses,
    )


def fedavg() -> None:
    """3 FedAvg rounds (2 local steps, weighted by example count), the mean delta stepped by
    torch SGD(lr=1) on the server, against the same rounds in torch."""
    m, ref = model(), model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    for _ in range(3):
        params = {k: v.detach() for k, v in m.named_parameters()}
        delta = bridge_mr.map_reduce(
            local_sgd,
            params,
            mine({"x": XS, "y": YS}),
            reduce="weighted_mean",
            weights=SIZES[LO:HI],
        )
        opt.zero_grad()
        for name, p in m.named_parameters():
            p.grad = -delta[name]
        opt.step()
        start = {k: v.detach().clone() for k, v in ref.named_parameters()}
        total = {k: torch.zeros_like(v) for k, v in start.items()}
        for i in range(TOTAL):
            local = model()
            local.load_state_dict(start)
            local_opt = torch.optim.SGD(local.parameters(), lr=0.3)
            for _ in range(2):
                local_opt.zero_grad()
                F.cross_entropy(local(XS[i]), YS[i]).backward()
                local_opt.step()
            for k, v in local.named_parameters():
                total[k] += SIZES[i] * (v.detach() - start[k])
        with torch.no_grad():
            for k, v in ref.named_parameters():
                v += total[k] / SIZES.sum()
    report(
        "fedavg",
        digest=digest(flat(m)),
        max_error=float((flat(m) - flat(ref)).abs().max()),
    )


def client_gradients() -> None:
    """Gradients for a rank's client tensors stay on that rank: its own rows only."""
    m = model()
    x = XS[LO:HI].clone().requires_grad_(True)
    loss = bridge_mr.map_reduce(client_loss, dict(m.named_parameters()), {"x": x, "y": YS[LO:HI]})
    loss.backward()
    x_all = XS.clone().requires_grad_(True)
    ref = model()
    torch.stack([F.cross_entropy(ref(x_all[i]), YS[i]) for i in range(TOTAL)]).mean().backward()
    assert x.grad is not None
    assert x_all.grad is not None
    report(
        "client_gradients",
        shape=list(x.grad.shape),
        max_error=float((x.grad - x_all.grad[LO:HI]).abs().max()),
        server_error=float((m[0].weight.grad - ref[0].weight.grad).abs().max()),
    )


def reductions() -> None:
    """sum and mean of integer and float results over every rank's clients."""

    def stats(_: jax.Array, c: dict) -> dict:
        return {"n": jnp.sum(c["y"] >= 0), "first": c["x"][0, 0]}

    server = torch.zeros(())
    clients = mine({"x": XS, "y": YS})
    total = bridge_mr.map_reduce(stats, server, clients, reduce="sum")
    mean = bridge_mr.map_reduce(stats, server, clients, reduce="mean")
    report(
        "reductions",
        n_sum=total["n"].item(),
        n_mean=mean["n"].item(),
        mean_dtype=str(mean["n"].dtype),
        first_sum_error=abs(total["first"].item() - XS[:, 0, 0].sum().item()),
        first_mean_error=abs(mean["first"].item() - XS[:, 0, 0].mean().item()),
    )


def from_torch() -> None:
    """A client loss written in torch (bridge_mr.from_torch), 2 FedSGD steps."""
    m, ref = model(), model()
    net = model()

    def torch_loss(params: dict, c: dict) -> torch.Tensor:
        out = torch.func.functional_call(net, params, (c["x"],))
        return F.cross_entropy(out, c["y"])

    loss_fn = bridge_mr.from_torch(torch_loss)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        bridge_mr.map_reduce(
            loss_fn, dict(m.named_parameters()), mine({"x": XS, "y": YS})
        ).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.stack([F.cross_entropy(ref(XS[i]), YS[i]) for i in range(TOTAL)]).mean().backward()
        ref_opt.step()
    report("from_torch", digest=digest(flat(m)), max_error=float((flat(m) - flat(ref)).abs().max()))


def refusals() -> None:
    """Ranks that call with different programs, or hold different server values (with the
    replica check on), get the same clear error on every rank; the job goes on afterwards."""
    m = model()
    params = dict(m.named_parameters())
    clients = mine({"x": XS, "y": YS})
    errors = {}
    if PROCESS.rank == 1:
        params = {**params, "extra": torch.zeros(2)}
    try:
        bridge_mr.map_reduce(client_loss, params, clients)
    except RuntimeError as error:
        errors["signature"] = str(error)
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    if PROCESS.rank == 1:
        params["2.bias"] += 1e-3
    try:
        bridge_mr.map_reduce(client_loss, params, clients)
    except RuntimeError as error:
        errors["replicas"] = str(error)
    empty = {k: v[:0] for k, v in clients.items()} if PROCESS.rank == 0 else clients
    try:
        bridge_mr.map_reduce(client_loss, params | {"2.bias": m[2].bias.detach()}, empty)
    except RuntimeError as error:
        errors["empty"] = str(error)
    with bridge_mr.program(placements={"clients": HI - LO}):
        try:
            bridge_mr.reduce_mean(XS[LO:HI])
        except NotImplementedError as error:
            errors["torch_reduction"] = str(error)
    # The job goes on: a good call after the refusals.
    good = bridge_mr.map_reduce(client_loss, dict(model().named_parameters()), clients)
    report("refusals", errors=errors, after=good.item(), check=PROCESS.check_replicas)


def large_payload() -> None:
    """An 8 MiB gradient (gloo's reduce-scatter gave wrong values on 4 MiB chunks,
    jax-ml/jax#40830): every rank gets the right sum, bit-identical."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(524288, 4, generator=g) * 0.01).requires_grad_(True)
    xs = torch.randn(TOTAL, 3, 524288, generator=g)
    loss = bridge_mr.map_reduce(lambda w, x: jnp.mean((x @ w) ** 2), w, xs[LO:HI])
    loss.backward()
    ref = w.detach().clone().requires_grad_(True)
    torch.stack([((xs[i] @ ref) ** 2).mean() for i in range(TOTAL)]).mean().backward()
    assert w.grad is not None
    assert ref.grad is not None
    report(
        "large_payload",
        digest=digest(w.grad),
        relative_error=float((w.grad - ref.grad).abs().max() / ref.grad.abs().max()),
    )


def streamed() -> None:
    """Each rank streams its clients in 2 chunks (`reduce="sum"` with example-count weights,
    gradients accumulated, divided by the total weight): one weighted FedSGD step. Every rank
    makes the same number of calls, so each splits its own clients into that many chunks."""
    m, ref = model(), model()
    params = dict(m.named_parameters())

    def weighted_loss(p: dict, c: dict) -> jax.Array:
        return c["n"] * client_loss(p, c)

    for rows in torch.arange(LO, HI).tensor_split(2):
        chunk = {"x": XS[rows], "y": YS[rows], "n": SIZES[rows]}
        bridge_mr.map_reduce(weighted_loss, params, chunk, reduce="sum").backward()
    for p in params.values():
        assert p.grad is not None
        p.grad /= SIZES.sum()
    losses = torch.stack([F.cross_entropy(ref(XS[i]), YS[i]) for i in range(TOTAL)])
    (losses * SIZES).sum().div(SIZES.sum()).backward()
    report(
        "streamed",
        max_error=max(
            float((a.grad - b.grad).abs().max())
            for a, b in zip(m.parameters(), ref.parameters(), strict=True)
            if a.grad is not None and b.grad is not None
        ),
    )


def auto_measured() -> None:
    """`strategy="auto"` timing every candidate (`AUTO_TIMING`, no time box): every rank picks
    the same strategy (the timings are agreed across ranks)."""
    from bridge_mr.auto import settings

    settings.AUTO_TIMING, settings.AUTO_TIME_BOX = True, float("inf")
    settings.AUTO_MIN_SECONDS = 0.0

    def heavy(w: jax.Array, x: jax.Array) -> jax.Array:
        h = x
        for _ in range(12):
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(192, 192, generator=g) * 0.1).requires_grad_(True)
    xs = torch.randn(TOTAL, 96, 192, generator=g)
    bridge_mr.map_reduce(heavy, w, xs[LO:HI]).backward()
    choice = bridge_mr.map_reduce_choices()[-1]
    report(
        "auto_measured",
        strategy=[choice.strategy, choice.chunk_size],
        timed=[c.timed_calls for c in choice.candidates],
        seconds=[c.seconds for c in choice.candidates],
    )


SCENARIOS = {
    "fedsgd_vmap": lambda: fedsgd("vmap"),
    "fedsgd_chunks": lambda: fedsgd("chunks", chunk_size=2),
    "fedsgd_per_client": lambda: fedsgd("per_client"),
    "fedsgd_auto": lambda: fedsgd("auto"),
    "fedavg": fedavg,
    "client_gradients": client_gradients,
    "reductions": reductions,
    "from_torch": from_torch,
    "refusals": refusals,
    "large_payload": large_payload,
    "streamed": streamed,
    "auto_measured": auto_measured,
}

if __name__ == "__main__":
    np.set_printoptions(precision=10)
    for scenario in sys.argv[2:]:
        SCENARIOS[scenario]()
