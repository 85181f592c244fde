"""`evaluate` and `report_eval` through a real Loop and Trainer."""

import io
import re

import pytest
from observability_helpers import CountingDataset, make_data, make_trainer, record_compilations

import loopax
from loopax import hooks


def test_evaluate_every_n_steps_shares_results_and_runs_once_per_step(tmp_path):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    test = CountingDataset(make_data("test", 2, seed=1, shuffle=False))
    evaluator = hooks.evaluate(loop, test, every_n_steps=4)
    # Another hook asking for the same evaluation at the same steps reuses it.
    seen = []

    def read_shared(loop, metrics):
        seen.append((loop.shared_data["eval_step"], dict(loop.shared_data["eval"]["test"])))

    hooks.every_n_steps(loop, 4, "read", read_shared, priority=loopax.Priority.LOG)
    plotter = hooks.plot(loop, tmp_path, eval_datasets=[test], start_step=4, factor=2,
                         render=False)
    del plotter
    loop.run_steps(make_data(loop_forever=True), 12)

    assert [step for step, _ in evaluator.history] == [4, 8, 12]
    assert [step for step, _ in seen] == [4, 8, 12]
    for (_, results), (_, shared) in zip(evaluator.history, seen):
        assert results["test"] == shared
        assert list(shared) == ["mean_loss", "Accuracy"]
        assert all(isinstance(value, float) for value in shared.values())
    # plot fires after loop step 4 (global step 5) and at the end (12); evaluate at global
    # steps 4, 8, 12 and at the end (12 again). One evaluation per distinct step: 4, 5, 8, 12.
    assert test.resets == 4
    assert loop.shared_data["eval_step"] == 12 == trainer.global_step


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
    hooks.evaluate(loop, make_data("test", 1), every_n_steps=2, call_on_end=False,
                   print_results=True, file=out)
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
