"""The demo's report: the runs side by side, and bridge_mr against each baseline, from the run."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from ._train import PhaseResult

OURS = "bridge_mr"
BUSY_CORES = 0.25  # Other processes' mean CPU use above which the report calls timings noisy.


def duration(seconds: float) -> str:
    """`seconds` to three significant digits: "31.2 s", "3.12 s", "543 ms", "1.40 ms"."""
    value, unit = (seconds, "s") if seconds >= 1.0 else (seconds * 1e3, "ms")
    decimals = 0 if value >= 100 else 1 if value >= 10 else 2 if value >= 1 else 3
    return f"{value:.{decimals}f} {unit}"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """bridge_mr's run of one algorithm against a baseline's run of it.

    `later_ratio` is bridge_mr's median later round over the baseline's (above 1: bridge_mr is
    slower); `first_extra_seconds` what bridge_mr's first round took beyond the baseline's;
    `catch_up_rounds` how many later rounds bridge_mr needs to make that up (its total time is
    then the baseline's), or None when it never does (its later rounds are not faster).
    """

    ours: PhaseResult
    theirs: PhaseResult

    @property
    def later_ratio(self) -> float:
        """bridge_mr's median later round / the baseline's."""
        return self.ours.later_round_seconds / self.theirs.later_round_seconds

    @property
    def first_extra_seconds(self) -> float:
        """bridge_mr's first round minus the baseline's (negative: bridge_mr's was shorter)."""
        return self.ours.first_round_seconds - self.theirs.first_round_seconds

    @property
    def catch_up_rounds(self) -> int | None:
        """Later rounds until bridge_mr's total is the baseline's; 0 if it never falls behind."""
        if self.first_extra_seconds <= 0:
            return 0
        saved = self.theirs.later_round_seconds - self.ours.later_round_seconds
        return math.ceil(self.first_extra_seconds / saved) if saved > 0 else None

    def describe(self) -> str:
        """One line: later rounds faster or slower and by how much, then the first round."""
        ours, theirs = self.ours, self.theirs
        later = (
            f"later rounds {_times(self.later_ratio)} "
            f"({duration(ours.later_round_seconds)} vs {duration(theirs.later_round_seconds)})"
        )
        first = (
            f"first round {duration(abs(self.first_extra_seconds))} "
            f"{'slower' if self.first_extra_seconds > 0 else 'faster'} "
            f"({duration(ours.first_round_seconds)} vs {duration(theirs.first_round_seconds)})"
        )
        catch_up = self.catch_up_rounds
        if catch_up is None:
            first += ", never made up: its later rounds are not faster"
        elif catch_up > 0:
            rounds = len(ours.round_seconds)
            plural = "s" if catch_up > 1 else ""
            first += f", made up after {catch_up} later round{plural} (this run: {rounds - 1})"
        return f"{ours.algorithm} vs {theirs.implementation}: {later}; {first}"


def _times(ratio: float) -> str:
    """ "1.29x slower" for 1.29, "3.10x faster" for 1 / 3.1."""
    return f"{ratio:.2f}x slower" if ratio >= 1 else f"{1 / ratio:.2f}x faster"


def _rate(per_second: float) -> str:
    """Three significant digits, without an exponent: "1234", "12.4", "0.0806"."""
    return f"{per_second:.0f}" if per_second >= 100 else f"{per_second:.3g}"


def comparisons(phases: Sequence[PhaseResult]) -> list[Comparison]:
    """bridge_mr against every other implementation, per algorithm, in the order of `phases`."""
    ours = {p.algorithm: p for p in phases if p.implementation == OURS}
    return [
        Comparison(ours[p.algorithm], p)
        for p in phases
        if p.implementation != OURS and p.algorithm in ours
    ]


def format_table(phases: Sequence[PhaseResult]) -> str:
    """The runs side by side: accuracy, final loss, first round, later rounds, all rounds."""
    rounds = {len(p.round_seconds) for p in phases}
    total = f"all {rounds.pop()} rounds" if len(rounds) == 1 else "all rounds"
    header = (
        f"{'algorithm':<9}  {'implementation':<14}  {'test acc':>8}  {'final loss':>10}  "
        f"{'1st round':>9}  {'later rounds (median)':>21}  {'rounds/s':>8}  {total:>13}"
    )
    lines = [header, "-" * len(header)]
    for p in phases:
        lines.append(
            f"{p.algorithm:<9}  {p.implementation:<14}  {p.accuracy:>8.1%}  "
            f"{p.losses[-1]:>10.4f}  {duration(p.first_round_seconds):>9}  "
            f"{duration(p.later_round_seconds):>21}  {_rate(p.rounds_per_second):>8}  "
            f"{duration(p.seconds):>13}"
        )
    return "\n".join(lines)


def format_speed(phases: Sequence[PhaseResult]) -> str:
    """bridge_mr against each baseline, then where it was slower in this run, from `phases`."""
    found = comparisons(phases)
    if not found:
        return ""
    lines = ["bridge_mr against each baseline (medians of this run's later rounds):"]
    lines += [f"  {c.describe()}" for c in found]
    slower_first = [c for c in found if c.first_extra_seconds > 0]
    slower_later = [c for c in found if c.later_ratio > 1]
    where = []
    if slower_first:
        extra = sorted(c.first_extra_seconds for c in slower_first)
        span = (
            duration(extra[0])
            if len(extra) == 1
            else f"{duration(extra[0])} to {duration(extra[-1])}"
        )
        where.append(
            f"its first round, in {len(slower_first)} of {len(found)} comparisons ({span} more: "
            'tracing the torch code into JAX, XLA compilation, strategy="auto"\'s choice)'
        )
    where += [
        f"{c.ours.algorithm}'s later rounds against {c.theirs.implementation} "
        f"({c.later_ratio:.2f}x its time)"
        for c in slower_later
    ]
    lines.append("where bridge_mr is slower in this run: " + ("; ".join(where) or "nowhere"))
    return "\n".join(lines)


def format_load(phases: Sequence[PhaseResult]) -> str:
    """The other processes' CPU use while each algorithm's rounds were timed, and what it means."""
    per_algorithm = {p.algorithm: p.other_cpu for p in phases}
    known = [cpu for cpu in per_algorithm.values() if cpu is not None]
    if len(known) < len(per_algorithm):
        return "other processes' CPU use: unknown on this platform (timings may be noisy)"
    used = ", ".join(f"{name} {cpu:.2f}" for name, cpu in per_algorithm.items())
    line = (
        f"other processes' CPU use while the rounds were timed, in cores of {os.cpu_count()}: "
        f"{used}"
    )
    if max(known) < BUSY_CORES:
        return f"{line} (quiet)"
    return (
        f"{line}: the machine was busy, so these times are not a quiet machine's; rerun "
        "when it is idle"
    )
