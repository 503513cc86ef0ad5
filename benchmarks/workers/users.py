"""One alternative of the "users_path" and "accelerator" cases in a process of its own, serving
rounds on request.

    python -m benchmarks.workers.users '{"alternative": ..., "config": {...}, "save": PATH}'
    python -m benchmarks.workers.users '{"workload": "accelerator", "count": true, "config": ...}'

Started fresh by the case (through `harness.peak_rss`'s launcher, so that its peak RSS is its
own), it builds the round (`workloads.users`), runs the first round timed (trace and compile
included), saves the parameters after it to `save` (an .npz, for the numerical agreement), and
answers on stdout with one JSON line per event:

    {"event": "ready", "import_rss_mb", "build_s", "first_s", "first_cpu_s", "cpu_total_s"}
    stdin "round"  -> {"event": "round", "seconds", "cpu_s"}    (one more round, synced)
    stdin "round K" -> the same, "seconds" the median of K rounds timed one by one
    stdin "quit"   -> {"event": "done", "peak_rss_mb"[, device peaks]}

`"workload"`: "users" (default: `workloads.users`, its `UserConfig`) or "accelerator"
(`workloads.accelerator`, its `AcceleratorConfig`; the "ready" event says which strategy
`auto` chose, for "bridge_mr"). On CUDA ("device": "cuda" in the config) the "done" event adds
the device's peaks: `torch.cuda.max_memory_allocated()` ("torch_cuda_peak_mb") and, where JAX
was imported, its CUDA device's `memory_stats()["peak_bytes_in_use"]` ("jax_cuda_peak_mb"):
two allocators, so their sum ("device_peak_mb") bounds the device peak from above; on a TPU
host ("device": "tpu"), the chip's `peak_bytes_in_use` where the process used it. The config's
"precision" is set with `torch.set_float32_matmul_precision` before anything is built. With
`"count": true` it builds nothing and answers one {"event": "count", "flops", "peak"} line
(`accelerator.flops`, `accelerator.device_peak`). With `"start_backend": true` (bridge_mr and
pure JAX), JAX's runtime starts before the round is built (`jax.devices()`, as a program that
puts its data on the chip first does), timed apart: "backend_s" in the "ready" event.

`cpu_s` is this process's CPU time during the round, which the case takes out of the machine's
busy time to tell the load of the other processes. Runs in the pfl venv too: it imports
numpy, torch and the round's libraries only. Exits non-zero (the error on stderr) if the round
cannot be built or fails.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from typing import Any


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _numpy(value: Any) -> Any:
    """A torch tensor (any device) or JAX array as a numpy array."""
    import numpy as np

    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _device_peaks(device: str) -> dict[str, float]:
    """On CUDA: torch's and JAX's peak device memory (MB) and their sum; on a TPU, JAX's
    (where this process used the chip); else nothing."""
    if device == "tpu":
        if "jax" not in sys.modules:
            return {}
        import jax

        chip = jax.devices()[0]
        stats = (chip.memory_stats() or {}) if chip.platform == "tpu" else {}
        if "peak_bytes_in_use" not in stats:
            return {}
        return {"device_peak_mb": stats["peak_bytes_in_use"] / 2**20}
    if device != "cuda":
        return {}
    import torch

    peaks = {"torch_cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20}
    if "jax" in sys.modules:
        import jax

        try:
            stats = jax.devices("cuda")[0].memory_stats() or {}
        except RuntimeError:  # JAX has no CUDA backend here: torch's peak only.
            stats = {}
        if "peak_bytes_in_use" in stats:
            peaks["jax_cuda_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
    return {**peaks, "device_peak_mb": sum(peaks.values())}


def _auto_choice(alternative: str) -> str | None:
    """What `strategy="auto"` picked in this process (the last choice), for "bridge_mr" and
    "bridge_mr_resident" and "bridge_mr_torchtpu"."""
    if alternative not in ("bridge_mr", "bridge_mr_resident", "bridge_mr_torchtpu"):
        return None
    import bridge_mr

    choices = bridge_mr.map_reduce_choices()
    if not choices:
        return None
    last = choices[-1]
    chunk = f" of {last.chunk_size}" if last.chunk_size else ""
    return f"{last.strategy}{chunk}: {last.reason}"


def main(argv: list[str]) -> int:
    """Serves the spec in argv[0]; returns the exit status."""
    spec = json.loads(argv[0])
    import numpy as np
    import torch

    from .. import harness
    from ..workloads import accelerator, users

    accelerated = spec.get("workload", "users") == "accelerator"
    if accelerated:
        cfg: Any = accelerator.AcceleratorConfig(**spec["config"])
        build = accelerator.build
        device = cfg.device
        if device == "cuda":
            torch.cuda.init()  # Part of the import baseline, as the imports are.
        torch.set_float32_matmul_precision(cfg.precision)  # What the user sets; bridge_mr reads it.
    else:
        cfg, build, device = users.UserConfig(**spec["config"]), users.build, "cpu"
    if spec.get("count"):
        _say(event="count", flops=accelerator.flops(cfg), peak=accelerator.device_peak(device))
        return 0
    backend = {}
    if spec["alternative"].startswith("bridge_mr") or spec["alternative"] == "pure_jax":
        import jax  # (part of the import baseline, as torch is)

        import bridge_mr  # noqa: F401

        if spec.get("start_backend"):  # JAX's runtime started before the round, apart
            backend["backend_s"], _ = harness.time_once(jax.devices)
    import_rss = _max_rss_mb()
    build_s, round_fn = harness.time_once(lambda: build(spec["alternative"], cfg))
    cpu = _cpu_s()
    first_s, params = harness.time_once(round_fn)
    first_cpu = _cpu_s() - cpu
    np.savez(spec["save"], *[_numpy(p) for p in params])
    ready = {"auto_choice": _auto_choice(spec["alternative"])} if accelerated else {}
    _say(
        event="ready",
        import_rss_mb=import_rss,
        build_s=build_s,
        first_s=first_s,
        first_cpu_s=first_cpu,
        cpu_total_s=_cpu_s(),
        **backend,
        **ready,
    )
    for line in sys.stdin:
        command, *count = line.split() or [""]
        if command == "round":
            cpu = _cpu_s()
            times = [harness.time_once(round_fn)[0] for _ in range(int(count[0]) if count else 1)]
            _say(event="round", seconds=statistics.median(times), cpu_s=_cpu_s() - cpu)
        elif command == "quit":
            break
        else:
            print(f"users_worker: unknown command {command!r}", file=sys.stderr)
            return 2
    _say(event="done", peak_rss_mb=_max_rss_mb(), **_device_peaks(device))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
