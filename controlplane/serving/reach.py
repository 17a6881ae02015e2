"""The share of an app's samples that reach each model of its cascade at the spec's thresholds,
as live answers show it (docs/tuner.md, "The reach, live").

A plan sizes a cascade's later stage for the share of queries its validation records forward
there (the stage's ``scale_factor``). Live inputs may be easier or harder than those records,
and the gear switcher may put other thresholds in force, which forward more or fewer samples.
The tuner sizes a stage for the spec's thresholds whatever gear is in force (the switcher's
cheaper gears are what serves while the fleet is short; a fleet sized for the gear in force
would keep the app in it), so what it needs is the reach *at the spec's thresholds* on the live
inputs. Every answer of a model that is not the last of the spec's cascade carries its
certainty, so the meter counts, per model, the samples it answered that the spec's thresholds
send it (the dispatcher follows each sample's answers: every model before it answered it below
its spec threshold) and those of them below the spec's threshold for it, whatever the gear that
sent them; the reach of the spec's k-th model is the product of the shares below along the
models before it. For a two-model cascade that is exact: the first model sees every sample.
Further down, a model sees only what the gear in force forwarded to it: under a gear that
forwards at least what the spec's thresholds do the count is still exact (what the spec's
thresholds would not send it is left out); under one that forwards less (a lower threshold, a
model skipped) it counts only a part, the hardest samples where a lower threshold stopped the
others, and would read its share below on them: where it answered under
:data:`FORWARDED_SHARE_KEPT` of what the spec's thresholds send it, the models after it get no
reach. Otherwise the reach rests on as many of the first model's samples as its count stands for
at the spec's thresholds (its count over its own reach, where fewer than the first model's).

Counts are kept in buckets of ``window_s / buckets`` over the last ``window_s`` (memory bounded
by the buckets, not the rate).

>>> meter = ReachMeter(("a", "b", "c"), (0.5, 0.8), window_s=60.0)
>>> meter.add("a", 1.0, seen=100, below=40)
>>> meter.add("b", 1.0, seen=40, below=10)
>>> {m: (round(r, 3), n) for m, (r, n) in meter.reach(2.0).items()}
{'b': (0.4, 100), 'c': (0.1, 100)}
>>> meter.reach(200.0)  # the window has passed
{}
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_WINDOW_S = 60.0
# A model after the first that answered fewer than this share of the samples the spec's
# thresholds send it (the first model's count times its reach) was sent less by the gear in
# force: the reach of the models after it is not read (a few percent go missing without such a
# gear: parts refused or still in flight at the window's edges).
FORWARDED_SHARE_KEPT = 0.8
DEFAULT_BUCKETS = 12


@dataclass(slots=True)
class _Bucket:
    index: int
    seen: int
    below: int


class ReachMeter:
    """Counts of the samples each model of ``models`` (the spec's cascade, in order) answered
    and of those below its threshold (``thresholds``, one per model but the last), over the
    last ``window_s``. Not thread-safe: the dispatcher's event loop adds and reads."""

    def __init__(
        self,
        models: Sequence[str],
        thresholds: Sequence[float],
        *,
        window_s: float = DEFAULT_WINDOW_S,
        buckets: int = DEFAULT_BUCKETS,
    ) -> None:
        if len(thresholds) != max(len(models) - 1, 0):
            raise ValueError(
                f"{len(models)} models take {max(len(models) - 1, 0)} thresholds,"
                f" got {len(thresholds)}"
            )
        if not (math.isfinite(window_s) and window_s > 0) or buckets < 1:
            raise ValueError(f"window_s must be > 0 and buckets >= 1, got {window_s}, {buckets}")
        self.models = tuple(models)
        self.thresholds = dict(zip(models, thresholds, strict=False))
        self._positions = {m: i for i, m in enumerate(self.thresholds)}
        self.window_s = window_s
        self._bucket_s = window_s / buckets
        self._counts: dict[str, deque[_Bucket]] = {m: deque() for m in self.thresholds}

    def spec(self, model: str) -> tuple[int, float] | None:
        """``model``'s position in the spec's cascade and its threshold there; None for the
        last model or one not in the spec's cascade (nothing of its answers is counted)."""
        position = self._positions.get(model)
        return None if position is None else (position, self.thresholds[model])

    def add(self, model: str, now_s: float, seen: int, below: int) -> None:
        """``model`` answered ``seen`` samples at ``now_s``, ``below`` of them under its spec
        threshold."""
        counts = self._counts.get(model)
        if counts is None or seen <= 0:
            return
        index = math.floor(now_s / self._bucket_s)
        if counts and counts[-1].index == index:
            counts[-1].seen += seen
            counts[-1].below += below
        else:
            counts.append(_Bucket(index, seen, below))
        self._trim(counts, now_s)

    def _trim(self, counts: deque[_Bucket], now_s: float) -> None:
        first = math.floor((now_s - self.window_s) / self._bucket_s)
        while counts and counts[0].index < first:
            counts.popleft()

    def reach(self, now_s: float) -> dict[str, tuple[float, int]]:
        """Model -> (its reach at the spec's thresholds, the samples of the first model that it
        rests on: the first model's count, or fewer where a model between answered fewer than
        the spec's thresholds send it, each standing for its count over its reach), for the
        models after the first whose every model before answered something in the window."""
        out: dict[str, tuple[float, int]] = {}
        share, base = 1.0, 0
        for position, model in enumerate(self.models[:-1]):
            counts = self._counts[model]
            self._trim(counts, now_s)
            seen = sum(b.seen for b in counts)
            if seen == 0:
                break
            if position == 0:
                base = seen
            elif share > 0.0:
                if seen < FORWARDED_SHARE_KEPT * base * share:
                    # A gear that forwards less than the spec's thresholds is in force: the
                    # samples this model saw are the hardest of those they send it, and its
                    # share below, read on them, would size what follows too large.
                    break
                base = min(base, round(seen / share))
            share *= sum(b.below for b in counts) / seen
            out[self.models[position + 1]] = (share, base)
        return out
