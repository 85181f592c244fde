"""`evaluate` and `report_eval` through a real Loop and Trainer."""

import io
import re

import pytest
from observability_helpers import CountingDataset, make_data, make_trainer, record_compilations

import loopax
from loopax import hooks


def test_one_evaluation_per_scheduled_point_with_every_writer_attached(tmp_path):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    test = CountingDataset(make_data("test", 2, seed=1, shuffle=False))
    evaluator = hooks.evaluate(loop, test, every_n_steps=4)
    published = []
    loop.on_evaluation("listener", lambda loop, evaluation: published.append(evaluation))
    # Every writer listens; the plot asked for the same dataset but uses the scheduled
    # evaluations instead of running its own; another hook asking again reuses them.
    hooks.plot(loop, tmp_path / "plots", eval_datasets=[test], start_step=4, factor=2, render=False)
    hooks.tensorboard(loop, tmp_path / "tb", every_n_steps=2)
    hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=2)
    reused = []
    hooks.every_n_steps(
        loop,
        4,
        "again",
        lambda loop, m: reused.append(loop.evaluate(test)),
        priority=loopax.Priority.LOG,
    )
    loop.run_steps(make_data(loop_forever=True), 12)

    assert [step for step, _ in evaluator.history] == [4, 8, 12]
    assert test.resets == 3  # evaluated once at each of global steps 4, 8 and 12
    assert [(e.step, e.dataset) for e in published] == [(4, "test"), (8, "test"), (12, "test")]
    assert reused == published  # the same records, not new evaluations
    for evaluation, (_, results) in zip(published, evaluator.history, strict=True):
        assert dict(evaluation.values) == results["test"]
        assert list(evaluation.values) == ["mean_loss", "Accuracy"]
        assert all(isinstance(value, float) for value in evaluation.values.values())
    assert loop.history["eval/test/Accuracy"] == [(e.step, e.values["Accuracy"]) for e in published]
    assert loop.evaluation("test") is published[-1]


def test_evaluate_n_times_and_on_end():
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    evaluator = hooks.evaluate(loop, [make_data("a", 1), make_data("b", 1, seed=2)], n_times=2)
    loop.run_steps(make_data(loop_forever=True), 6)
    assert [step for step, _ in evaluator.history] == [3, 6]
    assert sorted(evaluator.history[-1][1]) == ["a", "b"]

    end_loop = loopax.Loop(trainer)
    only_end = hooks.evaluate(end_loop, make_data("c", 1), call_on_end=True)
    end_loop.run_steps(make_data(loop_forever=True), 2)
    assert [step for step, _ in only_end.history] == [8]


def test_evaluate_prints_results_in_report_format():
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    out = io.StringIO()
    hooks.evaluate(
        loop, make_data("test", 1), every_n_steps=2, call_on_end=False, print_results=True, file=out
    )
    loop.run_steps(make_data(loop_forever=True), 2)
    assert out.getvalue().startswith("Step 2:\nResults on test:\n\tMean Loss (#loss): ")


def test_report_eval_gomlx_format_and_resets_datasets():
    trainer = make_trainer()
    compiled = record_compilations(trainer)
    loopax.Loop(trainer).run_steps(make_data(loop_forever=True), 3)
    train, test = make_data("train", 2), CountingDataset(make_data("test", 2, seed=3))
    out = io.StringIO()
    results = hooks.report_eval(trainer, train, test, file=out)

    lines = out.getvalue().splitlines()
    assert lines[0] == "Results on train:"
    assert re.fullmatch(r"\tMean Loss \(#loss\): \d\.\d+(e[+-]\d+)?", lines[1])
    assert re.fullmatch(r"\tAccuracy \(acc\): \d{1,3}\.\d\d%", lines[2])
    assert lines[3] == "Results on test:" and len(lines) == 6
    assert f"{100 * results['test']['Accuracy']:.2f}%" in lines[5]
    assert list(results) == ["train", "test"]
    assert test.resets == 2  # reset by evaluate at its start, then after the report
    # The trainer compiled its train and eval steps before: evaluations never compile again.
    hooks.report_eval(trainer, test, file=io.StringIO())
    assert compiled == []


def test_report_eval_reads_a_training_set_once_and_leaves_its_position():
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    train = make_data("train", 3, loop_forever=True)  # 48 examples in batches of 16
    loop.run_steps(train, 2)
    position = train.get_state()
    results = hooks.report_eval(trainer, train, file=io.StringIO())
    assert train.get_state() == position  # training goes on where it was
    # One pass, every example once, in order: the mean over all 48 examples.
    by_hand = trainer.evaluate(make_data("train", 3, shuffle=False))
    assert results["train"] == pytest.approx(by_hand)


def test_report_eval_keeps_an_iterable_where_training_left_it():
    trainer = make_trainer()
    source = make_data("stream", 4, shuffle=False)
    batches = [source.yield_batch()[1:] for _ in range(4)]
    stream = loopax.IterableDataset(batches, name="stream")
    loop = loopax.Loop(trainer)
    loop.run_steps(stream, 2)
    hooks.report_eval(trainer, stream, file=io.StringIO())
    loop.run_steps(stream, 2)  # the last two batches: report_eval did not restart it
    with pytest.raises(RuntimeError, match="reached the end of dataset 'stream' after 0 of 1"):
        loop.run_steps(stream, 1)


def test_report_eval_names_datasets_that_share_a_name_by_position():
    trainer = make_trainer()
    loopax.Loop(trainer).run_steps(make_data(loop_forever=True), 1)
    first, second = make_data("array", 2), make_data("array", 2, seed=5)
    out = io.StringIO()
    results = hooks.report_eval(trainer, first, second, file=out)
    assert list(results) == ["array#1", "array#2"]
    assert "Results on array#1:" in out.getvalue() and "Results on array#2:" in out.getvalue()
    assert results["array#1"] != results["array#2"]


def test_evaluate_rejects_bad_configuration():
    loop = loopax.Loop(make_trainer())
    with pytest.raises(ValueError, match="no schedule"):
        hooks.evaluate(loop, make_data("test"), call_on_end=False)
    with pytest.raises(ValueError, match="two datasets are named 'test'"):
        hooks.evaluate(loop, [make_data("test"), make_data("test")], every_n_steps=2)
    with pytest.raises(ValueError, match="n must be a positive int"):
        hooks.evaluate(loop, make_data("test"), every_n_steps=0)
    with pytest.raises(TypeError, match="loopax datasets"):
        hooks.evaluate(loop, ["not a dataset"], every_n_steps=2)
    with pytest.raises(ValueError, match="at least one dataset"):
        hooks.evaluate(loop, [], every_n_steps=2)
    with pytest.raises(ValueError, match="yielded no batch"):
        hooks.report_eval(loop.trainer, loopax.IterableDataset(lambda: iter([]), name="empty"))
