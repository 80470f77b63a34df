"""The console's progress line says what happened: each loss beside the step metrics.jsonl has it at, as a
collective rank reports it (a step's loss read back during the next) and as a parameter server's does; and a
new attempt's line shows no loss of the attempt before."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator, Mapping
from dataclasses import replace

import pytest

from distrain.channel import Channel, Progress
from distrain.progress import ProgressLine


def lines(reports: list[Progress]) -> list[str]:
    out = io.StringIO()
    line = ProgressLine(0.0, stream=out)
    for report in reports:
        line.update(report)
    return [text.split(" | ETA")[0].split(" | elapsed")[0] for text in out.getvalue().splitlines()]


def test_a_collective_ranks_loss_is_shown_beside_its_own_step():
    # What rank 0's channel holds as it goes: step 2 ends before step 1's loss is read back (during step 2).
    rank0, reports = Channel(), []
    rank0.report(max_steps=3)
    steps = ({"step": 0, "logged": 0}, {"step": 1}, {"step": 2}, {"metrics": {"loss": 4.5}, "logged": 1}, {"step": 3})
    for report in (*steps, {"metrics": {"loss": 4.25}, "logged": 2}, {"metrics": {"loss": 4.0}, "logged": 3}):
        rank0.report(**report)
        reports.append(rank0.progress)
    assert lines(reports) == ["step 0/3", "step 1/3 | loss 4.5000", "step 2/3 | loss 4.2500", "step 3/3 | loss 4.0000"]
    rank0.report(step=None)  # None: unchanged
    assert rank0.progress.step == 3
    with pytest.raises(TypeError, match="stpe"):  # a name the record lacks is refused, not stored
        rank0.report(stpe=4)


class HeldFigures(Mapping):
    """Figures whose reading holds the report that merges them until `go` is set: a thread switch at the worst
    moment, made to happen."""

    def __init__(self, figures: dict[str, float]):
        self.figures, self.reading, self.go = figures, threading.Event(), threading.Event()

    def __getitem__(self, key: str) -> float:
        return self.figures[key]

    def __len__(self) -> int:
        return len(self.figures)

    def __iter__(self) -> Iterator[str]:
        self.reading.set()
        assert self.go.wait(timeout=10)
        return iter(self.figures)


@pytest.mark.timeout(30)
def test_reports_from_two_threads_lose_neither():
    """A background checkpoint's line said while the step's figures are being merged: both are kept."""
    channel, held = Channel(), HeldFigures({"loss": 2.5})
    step = threading.Thread(target=channel.report, kwargs={"metrics": held, "logged": 7})
    step.start()
    assert held.reading.wait(timeout=10)
    saver = threading.Thread(target=channel.report, kwargs={"said": ("step 6 not committed",), "metrics": {"a": 1}})
    saver.start()
    saver.join(timeout=0.5)  # done at once without a lock; waiting on the step's report with one
    held.go.set()
    step.join(timeout=10)
    saver.join(timeout=10)
    assert channel.progress.said == ("step 6 not committed",)
    assert channel.progress.metrics == {"loss": 2.5, "a": 1} and channel.progress.logged == 7


def test_a_new_attempt_shows_no_loss_of_the_one_before():
    first = Progress(max_steps=9, step=5, metrics={"loss": 3.0}, logged=4)
    again = Progress(max_steps=9, step=0, logged=0)  # the restart's fresh channel: from step 0, nothing read back
    assert lines([first, again, replace(again, step=1)]) == ["step 4/9 | loss 3.0000", "step 0/9"]


def test_a_parameter_servers_line_is_of_the_step_it_reports():
    reports = [Progress(max_steps=2, step=s, metrics={"loss": loss}) for s, loss in ((1, 2.0), (2, 1.5))]
    assert lines(reports) == ["step 1/2 | loss 2.0000", "step 2/2 | loss 1.5000"]


def test_a_mixture_of_experts_line_shows_its_busiest_expert():
    figures = {"loss": 2.0, "moe_imbalance_0": 1.25, "moe_imbalance_3": 1.5, "moe_balance_loss": 1.01}
    assert lines([Progress(max_steps=2, step=1, metrics=figures)]) == ["step 1/2 | loss 2.0000 | experts ≤ 1.50× mean"]
