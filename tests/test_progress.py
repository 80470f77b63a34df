"""The console's progress line says what happened: each loss beside the step metrics.jsonl has it at, as a
collective rank reports it (a step's loss read back during the next) and as a parameter server's does; and a
new attempt's line shows no loss of the attempt before."""

from __future__ import annotations

import io
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
