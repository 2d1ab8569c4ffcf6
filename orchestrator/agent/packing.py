"""How many of a session's trials share one GPU: decided from measurements, then checked on the trials' throughput.

Pure: no I/O. `orchestrator.agent.packer` reads the measurements (MLflow) and the trials' timings (the queue) and
acts on what this module decides.

- `initial_k`: after the baseline runs (each alone on its device), k = min(what fits in memory, what fills the
  device): floor(headroom x device memory / peak memory) and ceil(target busy / busy share), clamped to 1..16
  and rounded down to a power of two (the controller doubles from there, so it climbs 1, 2, 4, 8, 16 and errs
  under the estimate: trials alone overstate how well k of them overlap). Missing measurements: k = 1.
- `Controller`: a round at k gives its trials per hour; while a higher k raises that by >= 15% it tries the next
  (k x 2, capped by the memory fit), else it steps back to the previous k and holds; a packed trial that ran
  out of GPU memory steps it back too. Each decision carries a one-line evidence string; its state round-trips
  through `to_dict`/`from_dict`, so a resumed session continues where it was.

The share of a trial is always 1/k of one device; `gpus_for(k)` is the one place that turns k into a job's
`gpus` request.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping

from orchestrator.core.errors import BadInput

K_MAX = 16  # the service's limit: shares 1/k for k up to 16
AUTO = "auto"
GAIN = 0.15  # a higher k must raise trials per hour by this much to be kept
OOM_REASON = "out of GPU memory"  # the start of the reason of a job the service requeued after an OOM


def gpus_for(k: int) -> float | int:
    """The `gpus` a trial asks for when k trials share a device: 1 (a whole device) or the share 1/k."""
    return 1 if k <= 1 else 1.0 / k


def parse(value: Any) -> str | int:
    """`--trials-per-gpu`: "auto" or an integer 1..16 (as int or text); BadInput otherwise, one line."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool) and 1 <= text <= K_MAX:
        return text
    raise BadInput(f"--trials-per-gpu must be auto or an integer from 1 to {K_MAX}, got {value!r}")


def power_below(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (max(1, n).bit_length() - 1)


def is_oom(reason: str | None) -> bool:
    """Whether a job event's reason says the job was requeued because it ran out of GPU memory."""
    return bool(reason) and reason.strip().lower().startswith(OOM_REASON.lower())


@dataclass(frozen=True)
class Measurement:
    """One baseline run's use of its device, as its MLflow run logged it (any may be missing): its own peak
    CUDA memory, the device's total memory (MB), and the device's mean utilisation while it ran alone (%)."""

    peak_memory_mb: float | None = None
    device_memory_mb: float | None = None
    busy_pct: float | None = None


@dataclass(frozen=True)
class Decision:
    """A k and why: `evidence` is one line for people; `fit` is how many fit in memory (None: unknown)."""

    k: int
    evidence: str
    fit: int | None = None


def _gb(mb: float) -> str:
    return f"{mb / 1000:.3g} GB"


def initial_k(measurements: Iterable[Measurement], *, target_busy: float = 0.8, headroom: float = 0.8,
              k_max: int = K_MAX) -> Decision:
    """k from the baseline runs' measurements (the worst of them: the largest peak and busy share, the smallest
    device); k = 1 with the reason when a measurement is missing."""
    runs = list(measurements)
    if not runs:
        return Decision(1, "k=1: no baseline run to measure; trials run one per GPU")
    missing = [label for label, attr in (("peak memory", "peak_memory_mb"), ("device memory", "device_memory_mb"),
                                          ("utilisation", "busy_pct"))
               if any(getattr(m, attr) is None for m in runs)]
    if missing:
        return Decision(1, f"k=1: {len(runs)} baseline run(s) did not log their GPU {', '.join(missing)}; "
                           "trials run one per GPU")
    peak = max(m.peak_memory_mb for m in runs)
    device = min(m.device_memory_mb for m in runs)
    busy = max(m.busy_pct for m in runs)
    fits = k_max if peak <= 0 else int(headroom * device // peak)
    fills = k_max if busy <= 0 else math.ceil(target_busy * 100 / busy - 1e-9)
    fit = max(1, min(fits, k_max))
    k = power_below(max(1, min(fits, fills, k_max)))
    why = (f"k={k}: {len(runs)} baseline run(s) peak {_gb(peak)} of {_gb(device)}, busy {busy:.0f}% -> fits "
           f"{fits}, busy target {target_busy * 100:.0f}% -> {fills}; chose {k}")
    if fits < 1:
        why += " (one alone already needs more than the headroom)"
    elif k < min(fits, fills, k_max):
        why += f" (a power of two at most {min(fits, fills, k_max)}; the throughput check raises it if it pays)"
    return Decision(k, why, fit)


@dataclass
class Controller:
    """Raise k while trials per hour rise by >= `gain`, then step back and hold. See the module doc.

    `fit` caps k (memory, or the session's --parallel); `prev_k`/`prev_tph` are the last kept round (or the
    baseline alone: k=1 at its measured rate); `held` ends the search for k.
    """

    k: int = 1
    fit: int = K_MAX
    prev_k: int | None = None
    prev_tph: float | None = None
    held: bool = False
    gain: float = GAIN
    rounds: list = field(default_factory=list)  # [k, trials per hour] per finished round

    def __post_init__(self) -> None:
        self.fit = max(1, min(int(self.fit), K_MAX))
        self.k = max(1, min(int(self.k), self.fit))

    def next_k(self) -> int | None:
        """The next k to try (k x 2 capped by the fit), or None when k already is the fit."""
        nxt = min(self.k * 2, self.fit)
        return nxt if nxt > self.k else None

    def observe(self, tph: float) -> Decision | None:
        """A round at the current k ran `tph` trials per hour: the new decision, or None when k stays (held)."""
        if self.held:
            return None
        self.rounds.append([self.k, round(tph, 3)])
        if self.prev_tph is not None and self.prev_k is not None and self.prev_k != self.k:
            before = self.prev_tph
            change = (tph / before - 1) if before > 0 else (math.inf if tph > 0 else 0.0)
            pct = "+inf%" if math.isinf(change) else f"{change * 100:+.0f}%"
            rates = f"trials/hour {before:.0f} -> {tph:.0f}, {pct}"
            if change < self.gain - 1e-9:  # +15% itself counts (115 / 100 - 1 is 0.1499... in floats)
                old, self.k, self.held = self.k, self.prev_k, True
                return Decision(self.k, f"k {old} -> {self.k} ({rates}, under +{self.gain * 100:.0f}%); "
                                        f"holding {self.k}")
            return self._raise(tph, f"{rates}")
        return self._raise(tph, f"trials/hour {tph:.0f} at k={self.k}")

    def _raise(self, tph: float, rates: str) -> Decision:
        nxt = self.next_k()
        if nxt is None:
            self.held = True
            return Decision(self.k, f"k {self.k} held ({rates}; {self.fit} is the most that fit)")
        old, self.prev_k, self.prev_tph, self.k = self.k, self.k, tph, nxt
        return Decision(self.k, f"k {old} -> {self.k} ({rates}); trying {self.k}")

    def oom(self, k_at: int, what: str = "a packed trial") -> Decision | None:
        """`what`, submitted at k=`k_at`, ran out of GPU memory (the service requeued it to run alone): step back
        below `k_at` and hold; None when k is already below it (an older round's trial)."""
        if k_at <= 1 or self.k < k_at:
            return None
        # Half of k_at, or the last kept k when that is between (4 after 8 kept 6: 6 is known to pay).
        below = max(k_at // 2, self.prev_k if self.prev_k is not None and self.prev_k < k_at else 1)
        old, self.k, self.held = self.k, max(1, below), True
        self.fit = min(self.fit, k_at - 1)
        return Decision(self.k, f"k {old} -> {self.k} ({what} ran out of GPU memory at k={k_at}); "
                                f"holding {self.k}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Controller":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def trials_per_hour(durations_s: Iterable[float], in_flight: int) -> float | None:
    """Trials per hour with `in_flight` trials running at once, each taking the median of `durations_s` (what a
    round's trials took at that packing); None without a positive duration."""
    took = sorted(d for d in durations_s if d > 0)
    if not took or in_flight < 1:
        return None
    return in_flight * 3600.0 / took[len(took) // 2]
