"""Results as data: rows of compared alternatives, targets, the printed table, JSON and Markdown.

JSON layout (`SCHEMA`), written to `results.json`:

    {"schema", "command", "mode", "started", "duration_s", "machine", "load",
     "cases": {name: {"title", "unit", "notes": [str], "load", "rows": [row]}},
     "targets": [target]}

    row    = {"id", "params", "baseline", "alternatives": {name: alternative}}
    alternative = {"median_s", "q1_s", "q3_s", "min_s", "max_s", "reps", "calls_per_rep",
                   "ratio_to_baseline": {"median", "q1", "q3"}, <metric>: float, ...,
                   "memory": {"peak_rss_mb", "import_rss_mb", "delta_rss_mb"} | {"error"}}
                   (case "accelerator" adds "first_round_s", "achieved_flop_per_s",
                   "fraction_of_peak" and, on CUDA, "memory": {..., "device_peak_mb"})
                | {"error": str}            (could not be built or failed; not timed)
    target = {"case", "row", "description", "value", "threshold", "direction", "met", "detail"}
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from .environment import LoadMeter
from .harness import Comparison

SCHEMA = "bridge_mr.benchmarks/1"


@dataclasses.dataclass
class CaseResult:
    """One case's rows, notes and targets."""

    name: str
    title: str
    unit: str
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    targets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    load: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The case's entry under "cases" in the JSON (targets are collected at the top)."""
        return {
            "title": self.title,
            "unit": self.unit,
            "notes": self.notes,
            "load": self.load,
            "rows": self.rows,
        }


@contextlib.contextmanager
def case_result(name: str, title: str, unit: str, *notes: str) -> Iterator[CaseResult]:
    """A new case's result, with `notes`; its `load` is set to how busy other processes kept
    the CPUs while the `with` block (the case's measurements) ran."""
    meter = LoadMeter()
    case = CaseResult(name=name, title=title, unit=unit, notes=list(notes))
    yield case
    case.load = meter.read()


def comparison_row(
    comparison: Comparison,
    row_id: str,
    params: dict[str, Any],
    *,
    metrics: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A row from an interleaved comparison.

    Args:
      comparison: the timings.
      row_id: a short unique name, e.g. "fedavg/small/c64".
      params: the configuration, JSON-serialisable.
      metrics: metric name -> amount of work per call; each timed alternative gets
        `amount / median_s` under that name (e.g. {"client_updates_per_s": clients}).
    """
    alternatives: dict[str, Any] = {}
    for name, timing in comparison.timings.items():
        entry = timing.summary()
        if "median_s" in entry:
            ratio = comparison.ratio(name)
            if ratio is not None:
                entry["ratio_to_baseline"] = ratio
            for metric, amount in (metrics or {}).items():
                entry[metric] = amount / entry["median_s"]
        alternatives[name] = entry
    return {
        "id": row_id,
        "params": params,
        "baseline": comparison.baseline,
        "alternatives": alternatives,
    }


def target(
    case: str,
    row: str,
    description: str,
    value: float | None,
    threshold: float,
    direction: str,
    detail: str = "",
) -> dict[str, Any]:
    """A reported (not asserted) target; `met` is None when `value` could not be measured.

    `detail` gives the measurements behind `value` (e.g. both times), for the reader.
    """
    if direction not in ("<=", ">="):
        raise ValueError(f"direction must be '<=' or '>=', got {direction!r}")
    met = None
    if value is not None:
        met = value <= threshold if direction == "<=" else value >= threshold
    return {
        "case": case,
        "row": row,
        "description": description,
        "value": value,
        "threshold": threshold,
        "direction": direction,
        "met": met,
        "detail": detail,
    }


def paired_target(
    case: str,
    row: dict[str, Any],
    description: str,
    ratio: dict[str, float] | None,
    threshold: float,
    direction: str,
    shown: tuple[str, str],
) -> dict[str, Any]:
    """A `target` on the median of a paired ratio (`Comparison.ratio`; None: not measured),
    detailed by `versus(row, *shown)`."""
    value = None if ratio is None else ratio["median"]
    return target(case, row["id"], description, value, threshold, direction, versus(row, *shown))


def versus(row: dict[str, Any], name: str, reference: str) -> str:
    """ "name T1 vs reference T2 (+difference)" from a row's medians ("" if either is missing)."""
    a = row["alternatives"].get(name, {}).get("median_s")
    b = row["alternatives"].get(reference, {}).get("median_s")
    if a is None or b is None:
        return ""
    sign = "+" if a >= b else "-"
    difference = format_time(abs(a - b))
    return f"{name} {format_time(a)} vs {reference} {format_time(b)} ({sign}{difference})"


def format_time(seconds: float) -> str:
    """`seconds` in s, ms or µs, whichever reads best."""
    if abs(seconds) >= 1:
        return f"{seconds:.2f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


#: Metrics shown in table cells, with their labels.
METRIC_LABELS: dict[str, str] = {
    "client_updates_per_s": "upd/s",
    "tensors_per_s": "tensors/s",
    "gb_per_s": "GB/s",
    "gflop_per_s": "GFLOP/s",
}


def _cell(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return "n/a"
    if "conversions" in entry:
        c = entry["conversions"]
        return (
            f"{c['imports']} imports, {c['exports']} exports, {c['copies']} copies, "
            f"{c['bytes_copied']:,} bytes copied"
        )
    text = format_time(entry["median_s"])
    spread = entry["q3_s"] - entry["q1_s"]
    if entry["median_s"] > 0:
        text += f" ±{50 * spread / entry['median_s']:.0f}%"
    ratio = entry.get("ratio_to_baseline")
    if ratio is not None:
        text += f" ({ratio['median']:.2f}x)"
    for metric, label in METRIC_LABELS.items():
        if metric in entry:
            text += f", {_number(entry[metric])} {label}"
    if "fraction_of_matmul_peak" in entry:
        text += f" ({100 * entry['fraction_of_matmul_peak']:.0f}% of matmul)"
    if entry.get("fraction_of_peak") is not None:
        text += f" ({100 * entry['fraction_of_peak']:.2g}% of peak)"
    memory = entry.get("memory", {})
    if "device_peak_mb" in memory:
        text += f", {memory['device_peak_mb']:.0f} MB device"
    elif "peak_rss_mb" in memory:
        text += f", {memory['peak_rss_mb']:.0f} MB"
    elif "error" in memory:
        text += ", RSS n/a"
    return text


def _number(value: float) -> str:
    if 100 <= abs(value) < 1e6:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _groups(rows: list[dict[str, Any]]) -> list[tuple[list[str], list[dict[str, Any]]]]:
    """Consecutive rows with the same alternatives, as (alternative names, rows)."""
    groups: list[tuple[list[str], list[dict[str, Any]]]] = []
    for row in rows:
        names = list(row["alternatives"])
        if groups and groups[-1][0] == names:
            groups[-1][1].append(row)
        else:
            groups.append((names, [row]))
    return groups


def case_markdown(case: CaseResult) -> str:
    """The case as Markdown tables: one row per configuration, one column per alternative.

    A cell reads "median ±half-IQR% (ratio to the row's baseline), metrics, peak RSS".
    Rows with different alternatives go to separate tables.
    """
    lines = [f"### {case.title}", "", f"Unit: {case.unit}.", ""]
    for names, rows in _groups(case.rows):
        lines.append("| case | baseline | " + " | ".join(names) + " |")
        lines.append("|---|---|" + "---|" * len(names))
        for row in rows:
            cells = [_cell(row["alternatives"][n]) for n in names]
            baseline = row["baseline"] or "—"
            lines.append(f"| {row['id']} | {baseline} | " + " | ".join(cells) + " |")
        lines.append("")
    problems: set[str] = set()
    for row in case.rows:
        for name, entry in row["alternatives"].items():
            memory = entry.get("memory", {})
            if "error" in entry:
                problems.add(f"n/a: {name}: {entry['error']}")
            if "error" in memory:
                problems.add(f"RSS n/a: {name} ({row['id']}): {memory['error']}")
            if "child_failed" in memory:
                failure = memory["child_failed"]
                problems.add(f"peak RSS of {name} ({row['id']}): the child {failure}")
    lines += [f"- {note}" for note in case.notes] + [f"- {p}" for p in sorted(problems)]
    if case.load.get("other_cpus_busy") is not None:
        lines.append(
            f"- Load: other processes kept {case.load['other_cpus_busy']:.2f} CPUs busy on "
            f"average during this case ({case.load['wall_s']:.0f} s)."
        )
    return "\n".join(lines).rstrip() + "\n"


def targets_markdown(targets: list[dict[str, Any]]) -> str:
    """The targets as a Markdown table: value, threshold, met/missed and by how much."""
    lines = [
        "### Targets (reported, not asserted)",
        "",
        "| target | case | value | threshold | verdict | measured |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets:
        if t["met"] is None:
            verdict, value = "not measured", "n/a"
        else:
            value = f"{t['value']:.3g}"
            if t["threshold"]:
                off = t["value"] / t["threshold"]
                verdict = "met" if t["met"] else f"MISSED ({off:.2f}x the threshold)"
            else:
                verdict = "met" if t["met"] else f"MISSED (by {t['value']:.3g})"
        lines.append(
            f"| {t['description']} | {t['case']}: {t['row']} | {value} | "
            f"{t['direction']} {t['threshold']:g} | {verdict} | {t.get('detail', '')} |"
        )
    return "\n".join(lines) + "\n"


def write_json(path: str, document: dict[str, Any]) -> None:
    """Writes the document atomically (a temporary file renamed into place)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
