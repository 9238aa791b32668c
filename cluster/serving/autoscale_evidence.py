"""What the pool itself has shown, for the autoscaler's policy (autoscale_policy.py): the two things a capacity
model cannot know better than the measurements. Pure Python, no clock of its own (`now` is passed in).

    LoadBands        the correction factor (measured / modelled latency) per load band: a replica's request
                     rate in octave bands, each smoothed on its own; `factor_at(rate)` interpolates
                     between learnt bands (in log rate, log factor), takes the lowest band's factor below
                     them and, above them, the highest band's but never less than 1: a factor learnt at low
                     load (where this machine beats the profile 4x) did not hold at 6x the rate, so beyond
                     what was measured the model is trusted as it is, unless it was found too fast there
    Demonstrated     the request rate per replica the pool served while the SLO held (arrivals since the pool
                     was last resized, over at least half a window, with the window's attainment at target),
                     with the mean (input, output) lengths it was served at; `per_replica(mix, now)` is the
                     best such rate in the last `horizon_s`, scaled down by how much longer (input or output,
                     the larger ratio: a step's work grows about linearly in each) the mix now is; never scaled
                     up for a lighter mix (a lower bound claims only what was carried). `refute(rate)` drops
                     every record at or above a rate the pool just failed to carry (SLO missed or latencies
                     near the targets): the machine got slower, the old evidence no longer holds
    near_targets     whether the window's measured latencies approach the targets: the attainment quantile
                     (p90 for a 90% SLO) of any metric the pool decides beyond `pressure` x its target
Called by `Policy.step` once per pool per interval: `near_targets` and `refute` first, then the decision with
`factor_at` and `per_replica`, then `LoadBands.learn` / `Demonstrated.record` with the window's evidence for
the decisions that follow (a decision never relies on evidence from its own window alone).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

BAND_WIDTH = 1.0  # log2 units: octave bands of per-replica request rate


@dataclass
class LoadBands:
    bands: dict = field(default_factory=dict)  # band -> log(factor), smoothed
    bounds: tuple = (0.25, 4.0)

    def factor_at(self, rate: float, floor_above: float = 1.0) -> float:
        """The correction factor to plan with at `rate` req/s per replica (1 before anything was learnt);
        above the learnt bands never below `floor_above` (1: no promise beyond the model; 0: what was learnt)."""
        if not self.bands:
            return 1.0
        keys = sorted(self.bands)
        x = math.log2(max(rate, 1e-6)) / BAND_WIDTH
        if x <= keys[0]:
            return math.exp(self.bands[keys[0]])
        if x >= keys[-1]:
            return max(floor_above, math.exp(self.bands[keys[-1]]))
        i = bisect.bisect_right(keys, x)
        lo, hi = keys[i - 1], keys[i]
        w = (x - lo) / (hi - lo)
        return math.exp((1 - w) * self.bands[lo] + w * self.bands[hi])

    def learn(self, rate: float, ratio: float, smoothing: float) -> float:
        """Fold a measured / modelled ratio seen at `rate` req/s per replica into the two bands around it,
        each by its nearness (a rate on a band's edge would otherwise feed one band its low draws and the
        next its high ones); a band seen for the first time starts from what the others say there. Returns
        the factor now learnt at `rate`."""
        x = math.log2(max(rate, 1e-6)) / BAND_WIDTH
        lo_b = math.floor(x)
        bmin, bmax = (math.log(v) for v in self.bounds)
        for b, weight in ((lo_b, 1 - (x - lo_b)), (lo_b + 1, x - lo_b)):
            if weight <= 0:
                continue
            prior = self.bands.get(b, math.log(min(max(self.factor_at(2 ** (b * BAND_WIDTH), 0.0),
                                                       self.bounds[0]), self.bounds[1])))
            a = smoothing * weight
            self.bands[b] = min(bmax, max(bmin, a * math.log(ratio) + (1 - a) * prior))
        return self.factor_at(rate, floor_above=0.0)


@dataclass(frozen=True)
class Shown:
    time: float
    rate: float  # req/s per replica, served within the SLO
    mean_in: float
    mean_out: float


def mix_means(pairs) -> tuple[float, float]:
    pairs = list(pairs) or [(1, 1)]
    return (max(1.0, sum(i for i, _ in pairs) / len(pairs)), max(1.0, sum(o for _, o in pairs) / len(pairs)))


@dataclass
class Demonstrated:
    horizon_s: float = 1800.0
    records: list = field(default_factory=list)  # Shown, oldest first

    def record(self, now: float, rate: float, pairs) -> None:
        if rate > 0:
            self.records.append(Shown(now, rate, *mix_means(pairs)))
        self._prune(now)

    def refute(self, rate: float) -> None:
        self.records = [r for r in self.records if r.rate < rate]

    def per_replica(self, pairs, now: float) -> float:
        """Req/s one replica has carried within the SLO, at the mix `pairs` (0: nothing shown yet)."""
        self._prune(now)
        mi, mo = mix_means(pairs)
        return max((r.rate / max(1.0, mi / r.mean_in, mo / r.mean_out) for r in self.records), default=0.0)

    def _prune(self, now: float) -> None:
        self.records = [r for r in self.records if r.time >= now - self.horizon_s]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def near_targets(finished, metrics: tuple[str, ...], targets: dict[str, float], attainment: float,
                 pressure: float) -> bool:
    """The `attainment` quantile of a metric the pool decides beyond `pressure` x its target."""
    for k in metrics:
        xs = [getattr(f, k) for f in finished if getattr(f, k) is not None]
        if xs and quantile(xs, attainment) > pressure * targets[k]:
            return True
    return False
