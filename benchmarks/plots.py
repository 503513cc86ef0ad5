"""PNG plots of a results document (matplotlib, Agg backend); one file per case, plus ratios."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

_COLORS = {
    "bridge_mr": "tab:red",
    "drjax": "tab:blue",
    "torch_vmap": "tab:green",
    "torch_loop": "tab:orange",
    "bridge_mr_xla": "tab:pink",
    "torch_xla": "tab:olive",
}


_OTHER_COLORS = ["tab:purple", "tab:brown", "tab:gray", "tab:cyan", "gold", "navy"]


def _color(name: str, index: int) -> str:
    if name in _COLORS:
        return _COLORS[name]
    if name.startswith("bridge"):
        return "tab:red"
    return _OTHER_COLORS[index % len(_OTHER_COLORS)]


def _names(rows: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for row in rows:
        for name, entry in row["alternatives"].items():
            if name not in names and "median_s" in entry:
                names.append(name)
    return names


def _grouped_bars(
    ax: Any, rows: list[dict[str, Any]], value: Any, ylabel: str, *, log: bool = True
) -> None:
    """Bars of value(entry) per row (groups) and alternative (colours); missing ones left out."""
    names = _names(rows)
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        xs, ys = [], []
        for position, row in enumerate(rows):
            entry = row["alternatives"].get(name, {})
            y = value(entry) if "median_s" in entry else None
            if y is not None:
                xs.append(position + (index - (len(names) - 1) / 2) * width)
                ys.append(y)
        ax.bar(xs, ys, width=width, label=name, color=_color(name, index))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([row["id"] for row in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig: Any, out_dir: str, name: str, title: str) -> str:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _federated(cases: dict[str, Any], out_dir: str, footer: str) -> list[str]:
    present = [name for name in ("fedsgd", "fedavg") if cases.get(name, {}).get("rows")]
    if not present:
        return []
    paths = []
    fig, axes = plt.subplots(len(present), 1, figsize=(10, 4 * len(present)), squeeze=False)
    for ax, name in zip(axes[:, 0], present, strict=True):
        _grouped_bars(
            ax,
            cases[name]["rows"],
            lambda e: e.get("client_updates_per_s"),
            "client updates / s (higher is better)",
        )
        ax.set_title(cases[name]["title"], fontsize=9)
    paths.append(_save(fig, out_dir, "federated.png", f"Federated rounds — {footer}"))

    fig, ax = plt.subplots(figsize=(10, 4.5))
    rows = [row for name in present for row in cases[name]["rows"] if row["baseline"] == "drjax"]
    _grouped_bars(
        ax,
        rows,
        lambda e: e.get("ratio_to_baseline", {}).get("median"),
        "time / drjax time (lower is better)",
    )
    ax.axhline(1.10, color="tab:red", linestyle="--", linewidth=1, label="target 1.10x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir, "ratios.png", f"Time per round relative to drjax — {footer}"))
    return paths


def _scaling(case: dict[str, Any], out_dir: str, footer: str) -> list[str]:
    rows = case["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, name in enumerate(_names(rows)):
        points = [
            (row["params"]["clients"], row["alternatives"][name])
            for row in rows
            if "median_s" in row["alternatives"].get(name, {})
        ]
        clients = [c for c, _ in points]
        left.plot(
            clients, [e["median_s"] for _, e in points], "o-", label=name, color=_color(name, index)
        )
        memory = [
            (c, e["memory"]["peak_rss_mb"])
            for c, e in points
            if "peak_rss_mb" in e.get("memory", {})
        ]
        if memory:
            right.plot(
                [c for c, _ in memory],
                [m for _, m in memory],
                "o-",
                label=name,
                color=_color(name, index),
            )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("seconds per round")
    right.set_ylabel("peak RSS of a fresh process (MB)")
    return [_save(fig, out_dir, "scaling.png", f"{case['title']} — {footer}")]


def _boundary(case: dict[str, Any], out_dir: str, footer: str) -> list[str]:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, direction in zip(axes, ("import", "export"), strict=True):
        rows = [r for r in case["rows"] if r["params"].get("direction") == direction]
        if rows:
            _grouped_bars(
                ax,
                rows,
                lambda e: e["median_s"] * 1e6,
                "µs per call (lower is better)",
            )
            ax.set_title(
                f"{direction}: torch -> JAX"
                if direction == "import"
                else f"{direction}: JAX -> torch",
                fontsize=9,
            )
    return [_save(fig, out_dir, "boundary.png", f"Boundary cost — {footer}")]


def _panels(
    rows: list[dict[str, Any]], value: Any, ylabel: str, *, log: bool
) -> tuple[Any, list[Any]]:
    """One bar chart per row, over that row's own alternatives."""
    fig, axes = plt.subplots(1, len(rows), figsize=(3.4 * len(rows), 4.4), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        names = [n for n, e in row["alternatives"].items() if "median_s" in e]
        values = [value(row["alternatives"][n]) for n in names]
        ax.bar(range(len(names)), values, color=[_color(n, i) for i, n in enumerate(names)])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_title(row["id"], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    return fig, list(axes[0])


def _overhead(case: dict[str, Any], out_dir: str, footer: str) -> list[str]:
    fig, _ = _panels(case["rows"], lambda e: e["median_s"] * 1e6, "µs per fwd+bwd", log=True)
    return [_save(fig, out_dir, "overhead.png", f"Bridge overhead — {footer}")]


def _limits(case: dict[str, Any], out_dir: str, footer: str) -> list[str]:
    def rate(entry: dict[str, Any]) -> float:
        return entry.get("gb_per_s") or entry.get("gflop_per_s") or 0.0

    rows = case["rows"]
    fig, axes = _panels(rows, rate, "GB/s moved or GFLOP/s", log=False)
    matmul = [
        e["gflop_per_s"]
        for row in rows
        if row["id"].startswith("matmul")
        for e in row["alternatives"].values()
        if "gflop_per_s" in e
    ]
    for ax, row in zip(axes, rows, strict=True):
        if row["id"].startswith("client update") and matmul:
            ax.axhline(max(matmul), color="black", linestyle="--", linewidth=1)
            ax.text(0, max(matmul), " large-matmul GFLOP/s", fontsize=7, va="bottom")
    return [_save(fig, out_dir, "limits.png", f"Physical limits — {footer}")]


def write_plots(document: dict[str, Any], out_dir: str) -> list[str]:
    """Writes the PNGs for the cases present in `document`; returns their paths."""
    machine = document["machine"]
    footer = f"{machine['cpu_model']}, {machine['usable_cpus']} CPUs, {document['mode']} run"
    cases = document["cases"]
    paths = _federated(cases, out_dir, footer)
    for name, plot in (
        ("scaling", _scaling),
        ("boundary", _boundary),
        ("overhead", _overhead),
        ("limits", _limits),
    ):
        if cases.get(name, {}).get("rows"):
            paths += plot(cases[name], out_dir, footer)
    return paths
