"""The table of the Trainer's programs: what each reports and the axes its batches carry."""

import pytest

from loopax.trainer import _program
from loopax.trainer._program import (
    EVAL,
    EVAL_UNEVEN,
    PREDICT,
    TRAIN,
    TRAIN_STEPS,
    TRAIN_STEPS_GATHERED,
)

PROGRAMS = [TRAIN, TRAIN_STEPS, TRAIN_STEPS_GATHERED, EVAL, EVAL_UNEVEN, PREDICT]


def test_programs_report_the_public_graph_types():
    reported = {program.graph_type for program in PROGRAMS}
    assert reported == {"train", "train_steps", "eval", "predict"}
    assert TRAIN_STEPS_GATHERED.graph_type == "train_steps"  # the fused steps it runs


@pytest.mark.parametrize(
    ("program", "plain", "accumulating"),
    [
        (TRAIN, (), ("micro-batches",)),
        (TRAIN_STEPS, ("steps",), ("steps", "micro-batches")),
        (TRAIN_STEPS_GATHERED, ("steps",), ("steps",)),
        (EVAL, (), ()),
        (EVAL_UNEVEN, (), ()),
        (PREDICT, (), ()),
    ],
)
def test_micro_batches_lead_only_under_gradient_accumulation(program, plain, accumulating):
    assert program.axes(False) == plain
    assert program.axes(True) == accumulating


def test_only_the_state_and_the_eval_metric_states_are_donated():
    for program in PROGRAMS:
        expected = {"eval": (1,), "predict": ()}.get(program.name, (0,))
        assert program.donate == expected, program


def test_the_records_are_frozen():
    with pytest.raises(AttributeError):
        TRAIN.donate = ()  # type: ignore[misc]
    assert repr(TRAIN) == "Program('train')"
    assert _program.MICRO_BATCHES == "micro-batches"
