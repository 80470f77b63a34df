"""What a failure means: the interface the supervisor asks after every failure, the policies distrain
ships, and the choice between them by config (`cluster.policy=<name>`, or a user's class with
`cluster.policy._target_=pkg.module.Class`). Beside it, when a running attempt should move (ScalingPolicy).
A policy only decides: the supervisor carries a decision out, on its clocks (timeouts.py)."""

from __future__ import annotations

import abc
import difflib
import enum
import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from distrain.cluster.attempt import Failure, FailureKind
from distrain.cluster.placement import GroupSpec, draining_nodes, room_for
from distrain.config import ClusterConfig, ConfigError
from distrain.target import import_target


class Decision(enum.StrEnum):
    RESTART = "restart"  # a new attempt from the last checkpoint; healthy actors are kept
    REPLACE = "replace"  # a new worker (a hot spare if there is one) takes the failed rank; the others go on
    SHRINK = "shrink"  # a new attempt on fewer workers: the full group cannot be placed
    GIVE_UP = "give up"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""  # GIVE_UP: why, for the error the run ends with; else a note for the event line
    size: int = 0  # SHRINK: the worker count to go on with

    def noted(self, event: str) -> str:
        """An event line with the policy's note on this verdict (the failure budget), if it gave one."""
        return f"{event} ({self.reason})" if self.reason else event


class FailurePolicy(abc.ABC):
    """Decides what each failure of a supervised run means. Built once per run on the run's cluster
    config (max_failures, and whatever else a policy reads), then asked about every failure in the order
    the supervisor saw them. Of failures seen together (several parameter-server workers), the strongest
    verdict is carried out: GIVE_UP, then RESTART; REPLACE only when every one of them says so. A REPLACE
    the engine cannot carry out (a process group, a failure of no one rank) is a RESTART."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def decide(self, failure: Failure, earlier: Sequence[Failure], replaces_workers: bool) -> Verdict:
        """RESTART, REPLACE or GIVE_UP, given the run's earlier failures (oldest first) and whether its
        engine can replace one worker while the others go on (a parameter server can, a process group
        cannot: it restarts together)."""

    def size(self, full: int, fitting: list[int]) -> Verdict:
        """After the full group could not be placed in time: the largest allowed size the alive
        nodes can hold (`fitting`, largest first), or give up."""
        if fitting:
            return Verdict(Decision.SHRINK, size=fitting[0])
        return Verdict(Decision.GIVE_UP, f"could not place {full} workers, and no smaller allowed size fits")


class DefaultPolicy(FailurePolicy):
    """Retry up to cluster.max_failures, unless retrying cannot help. The same error at the same step
    twice in a row is a bug, not bad luck; so is a process group that fails to form twice with the same
    kind of error (ranks that cannot reach each other), and an error that says so of itself (`permanent`).
    A death (a kill, a lost node) is never called that."""

    def decide(self, failure: Failure, earlier: Sequence[Failure], replaces_workers: bool) -> Verdict:
        count, budget = len(earlier) + 1, self.config.max_failures
        if failure.permanent:
            return Verdict(Decision.GIVE_UP, failure.cause)
        if failure.signature is not None and earlier and earlier[-1].signature == failure.signature:
            if failure.joining:
                return Verdict(
                    Decision.GIVE_UP,
                    f"the ranks could not form their process group, twice the same way, so retrying cannot help: "
                    f"{failure.cause}; check that the hosts reach each other at these addresses, or name the "
                    f"interface to use with cluster.env_vars.GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs)",
                )
            return Verdict(
                Decision.GIVE_UP, f"the same error at the same step twice, so retrying cannot help: {failure.cause}"
            )
        if 0 <= budget < count:
            return Verdict(
                Decision.GIVE_UP, f"{failure.cause}; that is failure {count}, over cluster.max_failures={budget}"
            )
        one_worker = failure.rank is not None and failure.kind != FailureKind.LOST
        decision = Decision.REPLACE if replaces_workers and one_worker else Decision.RESTART
        return Verdict(decision, f"failure {count} of {'unlimited' if budget < 0 else budget}")


POLICIES: dict[str, type[FailurePolicy]] = {"default": DefaultPolicy}  # cluster.policy=<name>


def failure_policy(config: ClusterConfig) -> FailurePolicy:
    """The policy config.policy names, built on `config`."""
    return policy_class(config.policy)(config)


def policy_class(name: str) -> type[FailurePolicy]:
    """A shipped policy by name, or the user's FailurePolicy subclass a dotted path names (imported
    as model._target_ is); else a one-line ConfigError. The driver calls it before anything starts."""
    if "." not in name:
        if name in POLICIES:
            return POLICIES[name]
        close = difflib.get_close_matches(name, POLICIES, n=1)
        hint = f"did you mean {close[0]}?" if close else f"shipped: {', '.join(POLICIES)};"
        raise ConfigError(
            f"cluster.policy={name}: no such failure policy; {hint} a class of your own: "
            f"cluster.policy._target_=pkg.module.Class"
        )
    cls = import_target(name, "cluster.policy._target_", POLICIES)
    if not (isinstance(cls, type) and issubclass(cls, FailurePolicy)) or inspect.isabstract(cls):
        raise ConfigError(
            f"cluster.policy._target_={name}: not a subclass of distrain.cluster.policy.FailurePolicy that "
            f"implements decide"
        )
    return cls


@dataclass(frozen=True)
class Move:
    """A scaling decision: the ranks checkpoint and return by `deadline` (wall clock), then the run is placed
    anew (off the draining node, or on the full size)."""

    why: str
    deadline: float


class ScalingPolicy:
    """When a running attempt should checkpoint and move: a node of its group is draining (the autoscaler or
    `ray drain-node`: a spot instance about to be preempted), or a run shrunk after a failure has room for all
    its workers again. Asked every cluster.node_check_s while the ranks run."""

    def __init__(self, spec: GroupSpec, full: int, setup_timeout_s: float) -> None:
        """full: the worker count asked for; setup_timeout_s: the time to checkpoint when no deadline is known."""
        self.spec, self.full, self.setup_timeout_s = spec, full, setup_timeout_s

    def decide(self, nodes: Iterable[str], world_size: int) -> Move | None:
        """A Move for an attempt of `world_size` workers on `nodes` (node ids), or None: stay."""
        draining = set(nodes) & set(deadlines := draining_nodes())
        if draining:
            deadline = min(deadlines[node] for node in draining) or time.time() + self.setup_timeout_s
            names = ", ".join(d[:8] for d in draining)
            return Move(f"node {names} is draining: checkpointing, then moving off it", deadline)
        if world_size < self.full and room_for(self.spec, self.full - world_size):
            return Move(
                f"room for all {self.full} workers again: growing back at a checkpoint",
                time.time() + self.setup_timeout_s,
            )
        return None
