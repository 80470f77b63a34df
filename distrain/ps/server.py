"""One parameter-server shard: its weights, their optimizer state and a version, behind Ray calls.

A threaded actor: workers' calls run on threads of their own, so a call may wait (for a
synchronous round to fill, or for a bounded-staleness turn) while others go on. One condition
variable guards the state in every mode but Hogwild, whose pushes run concurrently, unlocked,
each through an optimizer of its own over the same storage and the same state tensors.

Pushes are idempotent per (worker, step): a replacement worker, or one resuming from a
checkpoint some shards had already applied a step to, may push a step twice, and only the first
counts. Weights go out once per version: `pull` hands every worker the same object-store ref.

A worker's record of a step (its loss, gradient norm, bytes, time) travels with that step's push
to shard 0, which hands it to the driver (`drain`) once its fate is known: applied (with its
staleness, or in sync mode the averaged gradient's norm) or dropped. So every step a checkpoint
holds has its records on shard 0 by the time the checkpoint is saved.

One file for every mode: they share the shard's state and the condition that guards it, whose rules would
split across files if the modes did.
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

from distrain.model.contract import fill_parameters
from distrain.model.hf import hf_weights
from distrain.model.registry import build_model
from distrain.ps import saved
from distrain.ps.job import ServerJob
from distrain.ps.shard import Piece, ShardView, Slot, as_tensor, model_shards
from distrain.storage.safeload import load_tensors, refuse_unplain
from distrain.train.optim import lr_at

SERVER_FILE = "server_{:03d}.pt"
RECENT_ROUNDS = 8  # sync: rounds whose norm and members a late (dropped or repeated) push may still ask for


def elastic_exchange(worker: torch.Tensor, centre: torch.Tensor, alpha: float) -> torch.Tensor:
    """EASGD's exchange (Zhang et al. 2015): with d = α(x_i − x̃), the centre moves to x̃ + d
    (in place) and the worker is to move to x_i − d; returns d."""
    diff = (worker - centre).mul_(alpha)
    centre.add_(diff)
    return diff


def feasible(in_flight: list[int], version: int, bound: int) -> bool:
    """Whether gradients pulled at `in_flight` versions can all still be applied, from `version`
    on, with staleness ≤ bound each: applied oldest first, the i-th lands at version + i."""
    return all(version + i - v <= bound for i, v in enumerate(sorted(in_flight)))


def load_weights(directory: str | Path, model: nn.Module) -> None:
    """A parameter-server checkpoint's weights into a whole model (to evaluate or export it)."""
    for path in sorted(Path(directory).glob(SERVER_FILE.replace("{:03d}", "*"))):
        state = load_tensors(path, allowed=[Piece])  # Piece: a plain record (a name, two offsets, a flag)
        ShardView(model, state["pieces"]).scatter(state["flat"])


class ParameterServer:
    def __init__(self, job: ServerJob, index: int, env: dict[str, str] | None = None):
        """`env`: what the driver forwards of its environment (the object store's credentials), as to every worker."""
        os.environ.update(env or {})
        cfg = job.config
        self.cfg, self.index = cfg, index
        p, t = cfg.ps, cfg.trainer
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        self.mode, self.workers = p.mode, cfg.cluster.num_workers
        self.needed = self.workers - p.backup_workers  # gradients that close a synchronous round
        self.bound = p.max_staleness
        self.alpha = p.elastic_alpha(self.workers)
        model = build_model(cfg.model, t.seq_len, seed=t.seed)  # the workers' and every strategy's weights
        if cfg.model.init_from:  # a Hugging Face model's (a resumed checkpoint, loaded below, wins)
            fill_parameters(model, hf_weights(cfg.model.init_from, cfg.model))
        self.pieces = model_shards(model, p.num_servers)[index]
        self.flat = ShardView(model, self.pieces).gather(grad=False).clone()
        self.slots = [
            Slot(self.flat, self.pieces, cfg.optim) for _ in range(self.workers if p.mode == "hogwild" else 1)
        ]
        self.version = 0
        self.applied: dict[int, int] = {}  # worker → the last step of it applied (or exchanged)
        self.cond = threading.Condition()
        self.in_flight: dict[int, int] = {}  # async and Hogwild: worker → the version it pulled
        self.round: dict[int, torch.Tensor] = {}  # sync: worker → its gradient for step version + 1
        self.closed: dict[int, torch.Tensor] = {}  # sync: step → its averaged gradient, until applied
        self.members: dict[int, set[int]] = {}  # sync: step → the workers whose gradients it averaged (recent)
        self.norm_sq: dict[int, float] = {}  # sync: step → its averaged gradient's norm², for recent steps
        self.waiting: dict[int, list[dict]] = {}  # sync: step → its members' records, until the round is applied
        self.records: list[dict] = []  # records whose fate is known (shard 0), until drained
        self.records_lock = threading.Lock()  # not the condition: Hogwild's pushes take no lock
        self.stopped = False
        self.state_ready = False  # Hogwild: whether the first update has created the optimizer state
        self.version_lock = threading.Lock()  # Hogwild: versions counted without losing one
        self.updating: set[tuple[int, int]] = set()  # Hogwild: (worker, step) of the updates under way
        self._published: tuple[int, ray.ObjectRef] | None = None
        if job.resume_from:
            self.load(str(saved.restored(cfg, job.resume_from) / SERVER_FILE.format(index)))
        for slot in self.slots[1:]:
            slot.share_state_of(self.slots[0])

    # -- weights out ----------------------------------------------------------------------------

    def pull(self, worker: int, min_version: int = 0, apply: tuple[int, float] | None = None) -> tuple:
        """(version, [ref to the shard's weights], stopped) once the version is at least min_version;
        the ref travels in a list so that Ray hands it over as a ref, not as the weights it names.
        `apply` = (step, norm): a sync worker's word that round `step` closed and the whole averaged
        gradient's norm (which only the workers, summing every shard's, know); the first applies it.
        async/Hogwild: notes the version the worker computes on (its gradient's staleness is counted
        from it); with max_staleness, first waits for a turn that keeps every bound."""
        with self.cond:
            if apply is not None and apply[0] in self.closed and apply[0] == self.version + 1:
                self._apply_round(*apply)
            if self.mode in ("async", "hogwild"):
                self.in_flight.pop(worker, None)
                if self.bound is not None:
                    self._wait(lambda: feasible([*self.in_flight.values(), self.version], self.version, self.bound))
                self.in_flight[worker] = self.version
            self._wait(lambda: self.version >= min_version)
            return self.version, [self._publish()], self.stopped

    def _publish(self) -> ray.ObjectRef:
        """The current weights in the object store, put once per version."""
        version = self.version
        if self._published is None or self._published[0] != version:
            self._published = (version, ray.put(self.flat.numpy()))  # copied into the store now
        return self._published[1]

    # -- gradients in ---------------------------------------------------------------------------

    def push(self, worker: int, step: int, grad: np.ndarray, record: dict | None = None) -> dict:
        """A worker's gradient of `step` (and, to shard 0, its record of the step). sync: waits for
        the round to close, then returns the averaged shard gradient's norm² (`applied` False when it
        came after the round closed: a dropped straggler). async/hogwild: applied at once, with its
        staleness."""
        grad = as_tensor(grad)
        if self.mode == "hogwild":
            return self._push_unlocked(worker, step, grad, record)
        with self.cond:
            if self.mode == "sync":
                return self._push_sync(worker, step, grad, record)
            return self._push_async(worker, step, grad, record)

    def _push_sync(self, worker: int, step: int, grad: torch.Tensor, record: dict | None) -> dict:
        applied = step == self.version + 1 and step not in self.closed and worker not in self.round
        if applied:
            self.round[worker] = grad
            self.waiting.setdefault(step, []).extend([record] if record else [])
            if len(self.round) == self.needed:
                total = torch.stack([self.round[w] for w in sorted(self.round)]).sum(0)  # in worker order
                self.closed[step] = total.div_(self.needed)
                self.norm_sq[step] = float(self.closed[step].double().pow(2).sum())
                self.members[step] = set(self.round)
                for old in (self.norm_sq, self.members):
                    old.pop(step - RECENT_ROUNDS, None)
                self.round = {}
                self.cond.notify_all()
        elif worker not in self.round and worker not in self.members.get(step, ()):
            self._emit(record, applied=False)  # a straggler's gradient for a round that closed without it
        self._wait(lambda: step in self.norm_sq or self.version >= step)
        return {"norm_sq": self.norm_sq.get(step), "applied": applied, "stopped": self.stopped}

    def _apply_round(self, step: int, norm: float) -> None:
        clip = self.cfg.optim.grad_clip
        self.slots[0].step(self.closed.pop(step), self._lr(step), (clip, torch.tensor(norm)) if clip > 0 else None)
        self._advance({})
        for record in self.waiting.pop(step, []):
            self._emit(record, applied=True, round_norm=norm)

    def _seen(self, worker: int, step: int) -> bool:
        """Whether this (worker, step) was applied already: it counts once. A rejected push no longer
        holds a bounded-staleness turn either."""
        if step > self.applied.get(worker, 0):
            return False
        self.in_flight.pop(worker, None)
        self.cond.notify_all()
        return True

    def _push_async(self, worker: int, step: int, grad: torch.Tensor, record: dict | None) -> dict:
        if not self._seen(worker, step) and self.bound is not None:
            self._wait(
                lambda: feasible([v for w, v in self.in_flight.items() if w != worker], self.version + 1, self.bound)
            )
        if self._seen(worker, step):  # also after the wait: a replaced worker's call may wait beside its successor's
            return {"applied": False, "stopped": self.stopped}
        staleness = self.version - self.in_flight.pop(worker, self.version)
        self.slots[0].step(grad, self._lr(step))
        self._advance({worker: step})
        self._emit(record, applied=True, staleness=staleness)
        return {"applied": True, "staleness": staleness, "version": self.version, "stopped": self.stopped}

    def _push_unlocked(self, worker: int, step: int, grad: torch.Tensor, record: dict | None) -> dict:
        """Hogwild: in place, concurrently with other pushes; the version read is the staleness
        as this push saw it."""
        with self.cond:  # the bookkeeping only (`_seen` notifies the condition's waiters): the update takes no lock
            if self._seen(worker, step) or (worker, step) in self.updating:  # a replaced worker's push may still run
                return {"applied": False, "stopped": self.stopped}
            self.updating.add((worker, step))
            pulled = self.in_flight.pop(worker, self.version)
        slot = self.slots[worker % len(self.slots)]
        if self.state_ready:
            slot.step(grad, self._lr(step))
        else:
            with self.cond:  # the first update creates the optimizer state the slots share: not twice at once
                slot.step(grad, self._lr(step))
                self.state_ready = True
        with self.version_lock:  # a count only: the update itself took no lock
            staleness = self.version - pulled
            self.version += 1
            self.applied[worker] = step
            self.updating.discard((worker, step))
        self._emit(record, applied=True, staleness=staleness)
        return {"applied": True, "staleness": staleness, "version": self.version, "stopped": self.stopped}

    def exchange(self, worker: int, step: int, weights: np.ndarray, records: list[dict] | None = None) -> dict:
        """EASGD: the elastic exchange with a worker's shard weights after its local step `step`
        (and, to shard 0, its records of the local steps since the last one); returns the difference
        d the worker subtracts from its own weights."""
        with self.cond:
            if self._seen(worker, step):
                return {"diff": None, "applied": False, "stopped": self.stopped}
            diff = elastic_exchange(as_tensor(weights), self.flat, self.alpha)
            self._advance({worker: step})
            for record in records or ():
                self._emit(record)
            return {"diff": diff.numpy(), "applied": True, "version": self.version, "stopped": self.stopped}

    def _advance(self, steps: dict[int, int]) -> None:
        self.version += 1
        self.applied.update(steps)
        self.cond.notify_all()

    def _lr(self, step: int) -> float:
        return lr_at(step, self.cfg.optim, self.cfg.trainer.max_steps)

    def _wait(self, ready) -> None:
        """Wait (holding the condition) until `ready()` or a stop request."""
        while not (ready() or self.stopped):
            self.cond.wait(timeout=1.0)

    # -- records out, and the driver's calls ------------------------------------------------------

    def _emit(self, record: dict | None, **facts: object) -> None:
        if record is not None:
            with self.records_lock:
                self.records.append({**record, **facts})

    def log(self, records: list[dict]) -> None:
        """Records sent on their own: worker 0's validation losses, a stopped EASGD worker's last steps."""
        with self.records_lock:
            self.records.extend(records)

    def drain(self) -> dict:
        """The records whose fate became known since the last drain, and the version."""
        with self.records_lock:
            records, self.records = self.records, []
        return {"records": records, "version": self.version}

    def next_step(self, worker: int) -> int:
        """Where a (new) worker starts: sync, the open round; otherwise after its last applied step."""
        with self.cond:
            return self.version + 1 if self.mode == "sync" else self.applied.get(worker, 0) + 1

    def forget(self, worker: int) -> None:
        """A worker died: it no longer holds back a bounded-staleness turn."""
        with self.cond:
            self.in_flight.pop(worker, None)
            self.cond.notify_all()

    def stop(self) -> None:
        """Release every waiting call: workers see `stopped` and return."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def save(self, staging: str) -> dict:
        """Write this shard's state into the staging directory `staging` of the run's checkpoints (saved.py): its
        file name, size and checksum (for the commit), and the last step of every worker the saved weights hold."""
        with self.cond:
            state = copy.deepcopy(  # under the lock: weights, moments and version of one moment
                {
                    "pieces": self.pieces,
                    "flat": self.flat,
                    "optim": self.slots[0].optimizer.state_dict(),
                    "version": self.version,
                    "applied": self.applied,
                    "norm_sq": self.norm_sq,  # a resumed sync worker may ask for a round this shard applied
                }
            )
        refuse_unplain(state, f"parameter server {self.index}'s state", allowed=[Piece])
        name, directory = SERVER_FILE.format(self.index), saved.staging_dir(self.cfg, staging)
        path = f"{directory}/{name}"
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        sync = self.mode == "sync"
        applied = {w: state["version"] if sync else state["applied"].get(w, 0) for w in range(self.workers)}
        size, crc32 = os.path.getsize(path), saved.checksum(directory, name)
        return {"file": name, "size": size, "crc32": crc32, "applied": applied}

    def upload(self, staging: str, prefix: str) -> str | None:
        """On an object store: this shard's saved file to the checkpoint's `prefix` there; why not, or None."""
        return saved.upload(self.cfg, staging, SERVER_FILE.format(self.index), prefix)

    def load(self, path: str) -> None:
        state = load_tensors(path, allowed=[Piece])  # refuses anything but tensors, plain data and Piece
        if state["pieces"] != self.pieces:
            raise ValueError(
                f"{path} holds a different slice of the model than shard {self.index} of "
                f"ps.num_servers={self.cfg.ps.num_servers}: resume with the num_servers it was saved with"
            )
        self.flat.copy_(state["flat"])
        self.slots[0].optimizer.load_state_dict(state["optim"])
        self.version, self.applied, self.norm_sq = state["version"], state["applied"], state["norm_sq"]

    def reset(self, job: ServerJob, index: int, env: dict[str, str] | None = None) -> dict:
        """Start over as a new server of `job` (a kept server, between runs of one driver: no process
        start); where it runs. Called with no other call under way."""
        self.__init__(job, index, env)
        return self.node_info()

    def node_info(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }
