"""Child process for peak-memory measurement: builds one round, runs it, prints its peak RSS.

Usage: python -m benchmarks.workers.peak_rss '{"alternative": ..., "config": {...}, "calls": n}'
("workload": "round" makes "config" a `workloads.RoundConfig`, else a `FedConfig`)
Prints one JSON line {"peak_rss_mb", "import_rss_mb", "delta_rss_mb"} (ru_maxrss is in KiB on
Linux); exits non-zero if the round cannot be built or fails. XLA_FLAGS comes from the parent's
environment.
"""

from __future__ import annotations

import json
import resource
import sys


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str]) -> int:
    """Runs the spec in argv[0]; returns the exit status."""
    spec = json.loads(argv[0])
    import jax  # noqa: F401  (imported before measuring the import baseline)
    import torch  # noqa: F401

    from .. import harness, workloads

    import_rss = _max_rss_mb()
    kind = workloads.RoundConfig if spec.get("workload") == "round" else workloads.FedConfig
    cfg = kind(**spec["config"])
    fn = workloads.build(spec["alternative"], cfg)
    if isinstance(fn, str):
        print(fn, file=sys.stderr)
        return 2
    for _ in range(spec["calls"]):
        harness.sync(fn())
    peak = _max_rss_mb()
    print(
        json.dumps(
            {"peak_rss_mb": peak, "import_rss_mb": import_rss, "delta_rss_mb": peak - import_rss}
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
