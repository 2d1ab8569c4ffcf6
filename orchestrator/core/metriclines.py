"""The output-line metric reader shared by programs and config-file experiments: `<metric>: <number>` lines.

    reader = LineReader(compile_pattern(DEFAULT_PATTERN, "val_loss"))
    reader.feed("val_loss: 0.42")      # -> (1, 0.42): the first report
    reader.feed("step 10: loss 3.1")   # -> None: not a metric line

A pattern is a regular expression with `{metric}` standing for the (escaped) metric name. The value is the
group named `value`, else the first group; the step is the group named `step` when the pattern has one, else
the number of matches so far. Standard library only: it runs inside every job's wrapper.
"""

from __future__ import annotations

import re

NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
DEFAULT_PATTERN = r"^{metric}:\s*" + NUMBER


def compile_pattern(pattern: str, metric: str) -> re.Pattern[str]:
    """The pattern with the metric name filled in (re.error when it is not a regular expression)."""
    return re.compile(pattern.replace("{metric}", re.escape(metric)))


class LineReader:
    """Reads metric values out of output lines, one line at a time; `start` continues a count of reports."""

    def __init__(self, regex: re.Pattern[str], start: int = 0):
        self.regex = regex
        self.count = start
        self.values: list[tuple[int, float]] = []

    def feed(self, line: str) -> tuple[int, float] | None:
        """(step, value) when `line` is a metric report, else None."""
        m = self.regex.search(line.rstrip("\n"))
        if not m:
            return None
        try:
            value = float(m.group("value") if "value" in self.regex.groupindex else m.group(1))
        except (IndexError, TypeError, ValueError):
            return None
        self.count += 1
        step = self.count
        if "step" in self.regex.groupindex:
            try:
                step = int(float(m.group("step")))
            except (TypeError, ValueError):
                pass
        self.values.append((step, value))
        return step, value
