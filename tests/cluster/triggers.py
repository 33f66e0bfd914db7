"""The chart's KEDA triggers as make scale-check's driver applies them: the metrics, the targets, the HPA's arithmetic.

No Kubernetes runs on the build machine, so tests/cluster/scale.py does what KEDA and the HPA would with the chart's
ScaledObjects (k8s/rlhf-pipeline/templates/scaledobject-rollout.yaml, scaledobject-scorers.yaml) rendered with
:data:`CHART_VALUES`; tests/deploy/test_chart.py renders the chart with those values and checks that its formula,
query and targets are the ones here. Kept free of the harness's imports so that the chart's tests can read it.

- rollout: ``held + waiting`` (KEDA's redis-streams ``pendingEntriesCount`` and ``lagCount`` of the rollout group on
  the prompts stream, summed by ``scalingModifiers``), target a replica's slots (``RLHF_ROLLOUT_MAX_INFLIGHT_JOBS``);
- reward (and reference): ``sum(avg_over_time(rlhf_requests_in_flight[window]))`` over the replicas the Service's
  endpoints list (the ServiceMonitor scrapes those), target ``requestsPerReplica``.

Both ``AverageValue``: the HPA's ``desired = ceil(current x (metric / current) / target)``, that is
``ceil(metric / target)``, clamped to ``[min, max]``, no change while ``metric / (target x current)`` is within
``TOLERANCE`` of 1, up at once and down only to the highest recommendation of the stabilization window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INFLIGHT_JOBS = 4  # RLHF_ROLLOUT_MAX_INFLIGHT_JOBS of the run's rollout replicas: a replica holds this many jobs
ROLLOUT_FORMULA = "held + waiting"
ROLLOUT_TARGET = INFLIGHT_JOBS  # rollout.autoscaling.keda.jobsPerReplica null: the replica's slots
REWARD_METRIC = "rlhf_requests_in_flight"
REWARD_WINDOW = "5s"  # reward.autoscaling.keda.window (1m by default: shortened to fit the run)
REWARD_WINDOW_S = 5.0
REWARD_TARGET = 5  # reward.autoscaling.keda.requestsPerReplica (8 by default)
TOLERANCE = 0.1  # the HPA's
SCALE_DOWN_WINDOW_S = 20.0  # the HPA's scale-down stabilization (default 300 s: shortened to fit)

# helm arguments that render the chart's ScaledObjects with the driver's targets
CHART_VALUES = (
    "--set-json",
    f'rollout.env=[{{"name": "RLHF_ROLLOUT_MAX_INFLIGHT_JOBS", "value": "{INFLIGHT_JOBS}"}}]',
    "--set",
    f"reward.autoscaling.keda.requestsPerReplica={REWARD_TARGET}",
    "--set",
    f"reward.autoscaling.keda.window={REWARD_WINDOW}",
)


def rollout_metric(held: int, waiting: int) -> float:
    """:data:`ROLLOUT_FORMULA` on the two triggers' values."""
    return float(held + waiting)


def reward_metric(samples: dict[str, list[tuple[float, float]]], now: float) -> float:
    """``sum(avg_over_time(rlhf_requests_in_flight[window]))``: per replica (``samples``: its scrapes, (time, the
    sum of its series)), the mean of the scrapes within the window ending ``now``, summed over the replicas."""
    total = 0.0
    for scrapes in samples.values():
        recent = [v for t, v in scrapes if now - REWARD_WINDOW_S < t <= now]
        if recent:
            total += sum(recent) / len(recent)
    return total


@dataclass
class Trigger:
    """One scaled workload's rule: KEDA's trigger as the HPA applies it (``AverageValue``)."""

    name: str
    target: float
    min_replicas: int
    max_replicas: int
    window_s: float = SCALE_DOWN_WINDOW_S
    tolerance: float = TOLERANCE
    history: list[tuple[float, int]] = field(default_factory=list)

    def raw(self, metric: float, current: int) -> int:
        """``ceil(current x (metric / current) / target)`` clamped, or ``current`` within the tolerance."""
        if current > 0 and abs(metric / (self.target * current) - 1.0) <= self.tolerance:
            want = current
        else:
            want = math.ceil(metric / self.target - 1e-9)
        return max(self.min_replicas, min(self.max_replicas, want))

    def desired(self, metric: float, current: int, now: float) -> int:
        """Up at once; down only to the highest recommendation of the last ``window_s``."""
        want = self.raw(metric, current)
        self.history = [(t, r) for t, r in self.history if now - t < self.window_s]
        self.history.append((now, want))
        if want >= current:
            return want
        return min(current, max(r for _, r in self.history))
