"""A failure policy distrain does not ship: the run ends at its first failure, as while debugging, where a
restart would only bury the first error under the next attempt's output:

    PYTHONPATH=examples .venv/bin/python jobs/train.py cluster.policy._target_=user_policy.fail_fast.FailFast

A policy only decides; the supervisor carries the verdict out (distrain/cluster/supervisor.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from distrain.cluster.attempt import Failure
from distrain.cluster.policy import Decision, FailurePolicy, Verdict


class FailFast(FailurePolicy):
    def decide(self, failure: Failure, earlier: Sequence[Failure], replaces_workers: bool) -> Verdict:
        return Verdict(Decision.GIVE_UP, f"{failure.cause}; cluster.policy={self.config.policy} gives up at once")
