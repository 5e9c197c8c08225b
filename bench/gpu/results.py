"""What bench.gpu_check's sections record, the time budget they share, and the Markdown made of it.

A section returns a SectionResult: checks (each passed, failed, or not run with the reason: out of time, a
package missing), measurements (name -> number or text) and notes (what was not measured, and why). No item
raises out of a section: an error is recorded as that item's failure, so one broken kernel cannot cost the
rest of a lent machine's time."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback

from bench.helpers.common import error_text

OUT_OF_TIME = "not run: out of time"
NOT_REACHED = "not run: the run ended before this section (stopped, or killed at its time limit)"


@dataclasses.dataclass
class Budget:
    """Wall-clock deadlines: the whole run's, and the current section's share of it."""

    seconds: float
    excluded: tuple[str, ...] = ()  # items whose name contains one of these are not run (--exclude)
    began: float = dataclasses.field(default_factory=time.perf_counter)
    section_end: float = float("inf")
    allotted: float = 0.0  # the shares of the sections started so far

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def start_section(self, share: float) -> None:
        """The next section may use `share` of the whole budget, plus what earlier sections left of theirs (and
        never more than the whole budget's rest)."""
        self.allotted += share
        self.section_end = max(time.perf_counter() + share * self.seconds, self.began + self.allotted * self.seconds)

    def out_of_time(self) -> bool:
        return self.left() <= 0

    def unbounded(self) -> Budget:
        """The same exclusions without a deadline: for sections a small run completes whatever the time."""
        return Budget(math.inf, excluded=self.excluded)

    def not_running(self, name: str) -> str | None:
        """Why item `name` does not run (out of time, or excluded), or None when it runs."""
        if self.out_of_time():
            return OUT_OF_TIME
        text = next((text for text in self.excluded if text in name), None)
        return None if text is None else f"not run: excluded (--exclude {text!r})"

    def left(self) -> float:
        """Seconds until the current section's deadline (or the whole budget's, if sooner)."""
        now = time.perf_counter()
        return min(self.section_end - now, self.began + self.seconds - now)


@dataclasses.dataclass
class SectionResult:
    checks: list[dict] = dataclasses.field(default_factory=list)
    measurements: dict = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    status: str = "ran"
    seconds: float = 0.0

    def check(self, name: str, passed: bool | None, detail: str = "") -> None:
        """passed None = not run (detail says why)."""
        self.checks.append({"name": name, "passed": passed, "detail": detail})

    def attempt(self, name: str, budget: Budget | None, fn) -> None:
        """Record fn() -> (passed, detail) as check `name`: not run when out of time or excluded (budget None: fn is
        cheap, run it whatever the time), failed on an exception."""
        if budget is not None and (reason := budget.not_running(name)) is not None:
            self.check(name, None, reason)
            return
        # Named before it runs: an item that aborts the process (an XLA check failure) is then known from the log.
        print(f"  running: {name}", file=sys.stderr, flush=True)
        try:
            passed, detail = fn()
        except Exception as error:  # recorded, not raised: see the module docstring
            passed, detail = False, error_text(error)
            traceback.print_exc()
        self.check(name, bool(passed), detail)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summary(sections: dict[str, SectionResult]) -> dict:
    checks = [c for s in sections.values() for c in s.checks]
    return {"passed": sum(c["passed"] is True for c in checks), "failed": sum(c["passed"] is False for c in checks),
            "not_run": sum(c["passed"] is None for c in checks),
            "sections_not_run": [name for name, s in sections.items() if s.status != "ran"]}


def markdown(sections: dict[str, SectionResult], header: str) -> str:
    totals = summary(sections)
    lines = [header, "", f"**{totals['passed']} checks passed, {totals['failed']} failed, {totals['not_run']} not "
             f"run**" + (f"; sections not run: {', '.join(totals['sections_not_run'])}"
                         if totals["sections_not_run"] else ""), ""]
    for name, section in sections.items():
        lines += [f"## {name}", "", f"{section.status}, {section.seconds:.0f} s", ""]
        if section.checks:
            lines += ["| check | result | detail |", "|---|---|---|"]
            for c in section.checks:
                result = {True: "pass", False: "**FAIL**", None: "not run"}[c["passed"]]
                lines.append(f"| {c['name']} | {result} | {c['detail'].replace('|', '/')} |")
            lines.append("")
        if section.measurements:
            lines += ["| measurement | value |", "|---|---|"]
            lines += [f"| {key} | {format_value(value)} |" for key, value in section.measurements.items()]
            lines.append("")
        lines += [f"- {note}" for note in section.notes]
        lines.append("")
    return "\n".join(lines)


def format_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
