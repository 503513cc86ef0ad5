"""Per-client convolutions' precision on the chip against the host CPU (issue 41 item 4, 42).

    python -m benchmarks.studies.bench_conv_precision [--clients 50]

Two parts, each printed as JSON lines, every error max |difference| / max |CPU value|:

* "conv": one convolution per client (vmap over clients: XLA's grouped convolution; or
  `lax.map`, one client at a time), its forward and both gradients, at each JAX precision
  ("highest", "high", "bfloat16": torch's "highest", "high", "medium"), against the host
  CPU's float32 at the CNN round's shapes (conv 32->64 on 30x30, conv 3->32 on 32x32, 10
  images a client) and a small one;
* "step": one gradient step of the CNN round's loss (`bench_cnn_forms.make_loss`) from
  per-client parameters (the server's plus 1% noise each, as after a local step), vmap and
  `lax.map`, at "highest", per parameter; beside it, how many of the two convolutions' ReLU
  inputs have another sign on the chip than on the CPU (each such one moves its convolution's
  gradient by one term of its sum).

On the CPU alone both forms run on the CPU (a smoke run: every error is then 0 or rounding).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from benchmarks.studies import bench_cnn_forms
from benchmarks.studies.bench_cnn_forms import pre_activations, relative_error

PRECISIONS = ("highest", "high", "bfloat16")
#: (clients, batch, in channels, out channels, height): the CNN's two convolutions, a small one.
SHAPES = ((None, 10, 32, 64, 30), (None, 10, 3, 32, 32), (8, 4, 16, 32, 14))


def conv_part(clients: int) -> None:
    import jax

    def conv(x: Any, w: Any) -> Any:
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )

    def fwd_bwd(x: Any, w: Any, g: Any) -> Any:
        y, vjp = jax.vjp(conv, x, w)
        return (y, *vjp(g))

    forms = {
        "vmap": jax.vmap(fwd_bwd),
        "map": lambda x, w, g: jax.lax.map(lambda a: fwd_bwd(*a), (x, w, g)),
    }
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        c, b, cin, cout, h = (shape[0] or clients, *shape[1:])
        x = rng.standard_normal((c, b, cin, h, h), np.float32)
        w = (rng.standard_normal((c, cout, cin, 3, 3)) / np.sqrt(9 * cin)).astype(np.float32)
        g = rng.standard_normal((c, b, cout, h - 2, h - 2), np.float32)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(forms["map"])(*jax.device_put((x, w, g), cpu))
        for precision in PRECISIONS:
            for name, form in forms.items():
                with jax.default_matmul_precision(precision):
                    got = jax.jit(form)(x, w, g)
                parts = zip(("y", "dx", "dw"), got, want, strict=True)
                errors = {k: relative_error(a, e) for k, a, e in parts}
                line = {"part": "conv", "shape": [c, b, cin, cout, h], "precision": precision}
                print(json.dumps({**line, "form": name, **errors}), flush=True)


def step_part(clients: int) -> None:
    import jax

    rng = np.random.default_rng(0)
    images = rng.standard_normal((clients, 10, 3, 32, 32), np.float32)
    labels = rng.integers(0, 10, (clients, 10)).astype(np.int32)
    server = {k: np.asarray(v) for k, v in bench_cnn_forms.init(jax.random.key(0)).items()}
    params = {
        k: v[None] + 0.01 * (np.std(v) + 1e-3) * rng.standard_normal((clients, *v.shape))
        for k, v in server.items()
    }
    params = {k: v.astype(np.float32) for k, v in params.items()}
    value_and_grad = jax.value_and_grad(bench_cnn_forms.make_loss("rw", "nchw", False))
    forms = {
        "vmap": jax.vmap(value_and_grad),
        "map": lambda p, x, y: jax.lax.map(lambda a: value_and_grad(*a), (p, x, y)),
    }
    cpu = jax.devices("cpu")[0]
    pre = jax.vmap(pre_activations)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(forms["map"])(*jax.device_put((params, images, labels), cpu))
        pre_cpu = jax.jit(pre)(*jax.device_put((params, images), cpu))
        pre_chip = jax.jit(pre)(params, images)
        flips = [
            int(np.sum(np.sign(np.asarray(a)) != np.sign(np.asarray(b))))
            for a, b in zip(pre_chip, pre_cpu, strict=True)
        ]
        for name, form in forms.items():
            got = jax.jit(form)(params, images, labels)
            errors = {"loss": relative_error(got[0], want[0])}
            errors.update({k: relative_error(got[1][k], want[1][k]) for k in sorted(server)})
            line = {"part": "step", "clients": clients, "form": name, "relu_sign_flips": flips}
            print(json.dumps({**line, **errors}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--parts", nargs="+", default=["conv", "step"], choices=("conv", "step"))
    args = parser.parse_args(argv)
    for part in args.parts:
        (conv_part if part == "conv" else step_part)(args.clients)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
