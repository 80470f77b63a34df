"""AdamW whose moments live on local disk (strategy.offload=nvme), streamed through a few host buffers.

Parameters and gradients stay where CPU offload keeps them, in host memory (FSDP2 moves each block to
the device for its forward and backward). Only the optimizer state goes to disk: AdamW's two fp32
moments of every element of this rank's shard, 8 bytes a parameter, twice the parameters themselves.
There is no separate master copy to move: the parameter shard is the fp32 master (bf16 is FSDP2's cast
on the way to the device).

The moments are two files, each one flat array of this rank's parameters in order, each parameter
starting on a 4 KiB block. A step streams them through `directio.Stream`: chunk k+1 is read while chunk
k is updated and chunk k−1 written. A chunk is updated by torch's own AdamW (`self.inner`), stepped on
views of the chunk's pieces of parameters and gradients with the chunk's moments as its state: the same
kernels on the same elements, so parameters and moments come out bitwise as AdamW on whole tensors
leaves them (tests/test_nvme.py).

Checkpoints see ordinary AdamW state. `state_dict` maps the files and hands out views of them, shaped
(and for FSDP2, sharded) as the parameters: DCP reads the moments from the files and writes them into
the files on load. The files are scratch, not a checkpoint: removed when the optimizer closes or is
collected.
"""

from __future__ import annotations

import os
import secrets
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from distrain.config import TrainConfig
from distrain.storage import directio
from distrain.storage.fsutil import alive

STATES = ("exp_avg", "exp_avg_sq")
FP32 = 4
ALIGN = directio.BLOCK // FP32  # elements: each parameter's moments start on a block


class ScratchError(RuntimeError):
    """This node's nvme_path cannot hold the rank's optimizer state; the message says why and the fix."""

    permanent = True  # read by the supervisor: the same on every attempt, so the run ends at once


@dataclass(frozen=True)
class Scratch:
    """Where a rank's moments live, `root/subdir` (strategy.nvme_path, then the run's and the rank's
    directories), and how much host memory may stream them (strategy.nvme_buffer_mb)."""

    root: Path
    subdir: str
    buffer_bytes: int
    overlap: bool = True  # read ahead and write behind; False only to measure what that gains

    @property
    def directory(self) -> Path:
        return self.root / self.subdir


def local(t: torch.Tensor) -> torch.Tensor:
    """The elements this rank holds, as a plain tensor sharing their memory."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def shaped_like(param: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """`flat` (this rank's elements) as a tensor of the parameter's kind: a DTensor with its placements."""
    block = flat.view(local(param).shape)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            block, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return block


class NVMeAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update and state, with the moments in files under `scratch.directory`."""

    def __init__(self, groups: list[dict], scratch: Scratch, **options: Any):
        self.inner = torch.optim.AdamW([{**g, "params": []} for g in groups], **options)
        super().__init__(groups, self.inner.defaults)
        self.params = [p for g in self.param_groups for p in g["params"]]
        assert all(p.device.type == "cpu" for p in self.params), "the moments stream to and from host memory"
        for p in self.params:
            self.state[p]["step"] = torch.tensor(0.0)  # as AdamW keeps it: a CPU scalar of the default dtype
        self.sizes = [local(p).numel() for p in self.params]
        self.starts, total = [], 0
        for n in self.sizes:
            self.starts.append(total)
            total += -(-n // ALIGN) * ALIGN
        self.group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        self.overlap, self.directory = scratch.overlap, scratch.directory
        self.paths = [self.directory / f"{name}.bin" for name in STATES]
        chunk = directio.chunk_bytes(scratch.buffer_bytes, len(STATES))
        assert chunk, f"{scratch.buffer_bytes} bytes cannot hold {directio.BUFFERS} buffers (validation says so)"
        nbytes = max(total, ALIGN) * FP32
        _remove_stale(self.directory)
        trouble = directio.problem(scratch.root, nbytes * len(STATES))  # this node's; the driver checked its own
        if trouble is not None:
            raise ScratchError(f"strategy.nvme_path: {trouble}")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self.stream = directio.Stream(self.paths, nbytes, chunk)
        except OSError as e:  # another process took the space since the check
            shutil.rmtree(self.directory, ignore_errors=True)
            reserve = f"cannot reserve {len(STATES) * nbytes} bytes in {self.directory}"
            raise ScratchError(f"strategy.nvme_path: {reserve}: {e.strerror}") from None
        self.chunk = self.stream.chunk // FP32  # elements; the stream's: no larger than the files
        self.moments = [[torch.frombuffer(b, dtype=torch.float32) for b in buffers] for buffers in self.stream.buffers]
        self.pieces = self._pieces()
        self._remove = weakref.finalize(self, _remove_scratch, self.stream, self.directory)

    def _pieces(self) -> list[list[tuple[int, int, int, int]]]:
        """Per chunk, the parameters' pieces in it: (parameter, first, last element + 1, offset in the chunk)."""
        pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.stream.chunks)]
        for i, (start, n) in enumerate(zip(self.starts, self.sizes, strict=True)):
            a = 0
            while a < n:
                k, offset = divmod(start + a, self.chunk)
                e = min(n, a + self.chunk - offset)
                pieces[k].append((i, a, e, offset))
                a = e
        return pieces

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state on disk."""
        return self.stream.nbytes * len(STATES)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        assert closure is None, "NVMeAdamW takes no closure"
        for inner, outer in zip(self.inner.param_groups, self.param_groups, strict=True):
            inner.update({key: value for key, value in outer.items() if key != "params"})
        flat = [local(p).view(-1) for p in self.params]
        grads = [None if p.grad is None else local(p.grad).view(-1) for p in self.params]
        steps = [self.state[p]["step"] for p in self.params]

        def update(k: int, buffer: int) -> None:
            groups: list[list[torch.Tensor]] = [[] for _ in self.inner.param_groups]
            for i, a, e, offset in self.pieces[k]:
                if grads[i] is None:
                    continue
                piece = flat[i][a:e]
                piece.grad = grads[i][a:e]
                state = {name: m[offset : offset + e - a] for name, m in zip(STATES, self.moments[buffer], strict=True)}
                self.inner.state[piece] = {"step": steps[i].clone(), **state}
                groups[self.group_of[i]].append(piece)
            for group, params in zip(self.inner.param_groups, groups, strict=True):
                group["params"] = params
            self.inner.step()
            self.inner.state.clear()

        try:
            self.stream.run(update, self.overlap)
        finally:
            for group in self.inner.param_groups:
                group["params"] = []
        for s, g in zip(steps, grads, strict=True):
            if g is not None:
                s += 1

    def _mapped(self) -> list[torch.Tensor]:
        """The files as flat arrays, mapped into memory (shared: writes go to the files)."""
        return [torch.from_file(str(p), shared=True, size=self.stream.nbytes // FP32) for p in self.paths]

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict, its moments views of the files (read by DCP as it saves them)."""
        sd = super().state_dict()
        files = self._mapped()
        for i, p in enumerate(self.params):
            start, n = self.starts[i], self.sizes[i]
            moments = {name: shaped_like(p, f[start : start + n]) for name, f in zip(STATES, files, strict=True)}
            sd["state"][i] = {**sd["state"][i], **moments}  # a new dict: super's shares self.state's
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state dict into the files (moments) and this object (steps). Moments it lacks stay as the
        files hold them: zeros in a new optimizer, as AdamW starts them, or what DCP just loaded into the views
        `state_dict` handed out (torch's set_state_dict passes on only the keys `self.state` has: the steps)."""
        files = self._mapped()
        # Keyed as the groups list their parameters: by index, or by name (torch's set_state_dict).
        names = [name for group in state_dict["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(names)}
        rest = {}
        for key, entry in state_dict["state"].items():
            i = index[key]
            start, n = self.starts[i], self.sizes[i]
            for name, f in zip(STATES, files, strict=True):
                value, target = entry.get(name), f[start : start + n]
                if value is not None and local(value).data_ptr() != target.data_ptr():
                    target.copy_(local(value).reshape(-1))
            # The steps copied: AdamW's own load would share them with the state dict it was given.
            rest[key] = {k: v.clone() for k, v in entry.items() if k not in STATES}
        super().load_state_dict({**state_dict, "state": rest})
        for p in self.params:  # super() keeps only what the checkpoint had
            self.state[p].setdefault("step", torch.tensor(0.0))

    def close(self) -> None:
        """Remove the scratch files (also done when the optimizer is collected, or the process exits)."""
        self._remove()


def _remove_stale(directory: Path) -> None:
    """Remove the files of this rank's earlier processes that are gone: a killed process removes nothing. A
    directory is named `<rank>.<pid>-<tag>`: a process still alive (a worker kept from a failed attempt)
    removes its own when its optimizer is collected."""
    rank, dot, _ = directory.name.rpartition(".")
    for old in directory.parent.glob(f"{rank}.*") if dot else []:
        pid = old.name.rpartition(".")[2].partition("-")[0]
        if old != directory and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def _remove_scratch(stream: directio.Stream, directory: Path) -> None:
    stream.close()
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()  # the run's directory, once its last rank has gone
    except OSError:
        pass


def nvme_scratch(cfg: TrainConfig, rank: int) -> Scratch | None:
    """Where this rank's optimizer state lives under offload=nvme, else None."""
    s = cfg.strategy
    if s.offload != "nvme":
        return None
    root, run = os.path.split(s.nvme_directory(cfg.run.name))
    # A directory of its own (<rank>.<pid>-<tag>): a process kept from a failed attempt may not have removed
    # its last one yet (train/nvme.py).
    own = f"rank_{rank:05d}.{os.getpid()}-{secrets.token_hex(4)}"
    return Scratch(Path(root), os.path.join(run, own), int(s.nvme_buffer_mb * 2**20))
