"""Trainer(mesh=, rules=, fsdp=): sharded training equals one device, on 4 simulated devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import loopax
from loopax import metrics

pytestmark = pytest.mark.cpu_devices  # meshes over 4 devices: not on one GPU (--accelerator)

MESHES = [{"data": 1, "model": 1}, {"data": 4, "model": 1}, {"data": 2, "model": 2},
          {"data": 1, "model": 4}]  # fmt: skip
RULES = [("embed", None), ("mlp", "model")]
STEPS = 20


def partitioned(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


def model_fn(ctx, spec, inputs):
    hidden = nn.Dense(8, kernel_init=partitioned(("embed", "mlp")))(inputs[0])
    hidden = nn.Dropout(0.3, deterministic=not ctx.training)(nn.relu(hidden))
    scale = ctx.variable("scale", jnp.ones((8,)), axes=("mlp",))
    return nn.Dense(1)(hidden * scale)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        hidden = nn.Dense(8, kernel_init=partitioned(("embed", "mlp")))(x)
        hidden = nn.BatchNorm(use_running_average=not train)(hidden)
        hidden = nn.Dropout(0.3, deterministic=not train)(nn.relu(hidden))
        return nn.Dense(1)(hidden)


class NnxModel(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.hidden = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def make_model(kind):
    if kind == "function":
        return model_fn
    if kind == "linen":
        return LinenModel()
    with nnx.use_eager_sharding(False):  # annotations without a mesh at construction
        return NnxModel()


def mse(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def data(size=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(size, 4)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)


def losses(trainer, steps=STEPS):
    x, y = data()
    return np.array([float(trainer.train_step(None, [x], [y])["loss"]) for _ in range(steps)])


def trainer_on(mesh, model, **kwargs):
    devices = jax.devices()[: int(np.prod(list(mesh.values())))]
    return loopax.Trainer(model, mse, optax.adam(0.05), devices=devices, mesh=mesh, **kwargs)


@pytest.mark.parametrize("kind", ["function", "linen", "nnx"])
def test_every_mesh_trains_as_one_device_with_dropout(kind):
    one = loopax.Trainer(make_model(kind), mse, optax.adam(0.05), devices=jax.devices()[:1])
    expected = losses(one)
    for mesh in MESHES:
        trainer = trainer_on(mesh, make_model(kind), rules=RULES)
        np.testing.assert_allclose(losses(trainer), expected, atol=1e-5, err_msg=str(mesh))
        kernel = trainer.params["hidden" if kind == "nnx" else "Dense_0"]["kernel"]
        assert isinstance(kernel, jax.Array)
        assert kernel.sharding.spec == P(None, "model")
    assert trainer.parallel == "mesh" and trainer.mesh.shape == {"data": 1, "model": 4}


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_an_nnx_module_built_under_a_mesh_trains_as_one_device(axis_type):
    # As Flax's guides build one: annotations sharded eagerly on a mesh (JAX's default
    # axes are Explicit), the logical names mapped by rules in a context.
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2
    )

    def built_under_the_mesh():
        with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
            model = NnxModel()
        assert model.hidden.kernel[...].sharding.spec == P(None, "model")  # created sharded
        return model

    one = loopax.Trainer(make_model("nnx"), mse, optax.adam(0.05), devices=jax.devices()[:1])
    expected = losses(one)
    sharded = trainer_on({"data": 2, "model": 2}, built_under_the_mesh(), rules=RULES)
    np.testing.assert_allclose(losses(sharded), expected, atol=1e-5)
    assert sharded.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    for devices in (1, 4):  # data parallel too: the values are only where training starts

        def data_parallel(model, devices=devices):
            return loopax.Trainer(model, mse, optax.adam(0.05), devices=jax.devices()[:devices])

        # Against the module built without a mesh (4 devices draw dropout masks per device).
        reference = losses(data_parallel(make_model("nnx")))
        trainer = data_parallel(built_under_the_mesh())
        np.testing.assert_allclose(losses(trainer), reference, atol=1e-5, err_msg=str(devices))
    # A rules context still open around the Trainer: its own rules map the names.
    with nnx.logical_axis_rules(RULES):
        trainer = trainer_on({"data": 2, "model": 2}, make_model("nnx"), rules=RULES)
        np.testing.assert_allclose(losses(trainer), expected, atol=1e-5)


def test_a_trainer_made_inside_a_mesh_context_not_its_own_is_refused():
    explicit = jax.make_mesh((2, 2), ("data", "model"))
    with jax.set_mesh(explicit):
        with pytest.raises(ValueError, match=r"made inside a mesh context .* after the `with`"):
            loopax.Trainer(make_model("nnx"), mse, optax.adam(0.05), devices=jax.devices()[:1])
        with pytest.raises(ValueError, match=r"Trainer's own mesh \{'data': 2, 'model': 2\}"):
            trainer_on({"data": 2, "model": 2}, make_model("nnx"), rules=RULES)
    # Inside its own mesh (Auto axes, as the Trainer's) it trains.
    auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(auto):
        trainer = trainer_on({"data": 2, "model": 2}, make_model("nnx"), rules=RULES)
        assert np.isfinite(losses(trainer, steps=2)).all()


def test_dropout_is_on_in_train_steps_and_off_in_evaluation():
    # the same masks on every mesh (above) are real masks: the first train step's loss,
    # with dropout, differs from the evaluation of the same initial parameters
    trainer = trainer_on({"data": 2, "model": 2}, model_fn, rules=RULES)
    x, y = data()
    initial = trainer.evaluate([(None, [x], [y])])["mean_loss"]
    first = losses(trainer, steps=1)[0]
    assert abs(first - initial) > 1e-4


def wide_model(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(64)(inputs[0]))
    hidden = nn.Dense(32)(hidden)
    return nn.Dense(1)(hidden)


def test_fsdp_shards_every_rank_two_parameter_and_its_adam_state():
    trainer = trainer_on({"data": 4}, wide_model, fsdp=True)
    losses(trainer, steps=1)
    kernels = {name: layer["kernel"] for name, layer in trainer.params.items()}
    # the largest dimension that 4 divides: (4, 64) -> 1, (64, 32) -> 0, (32, 1) -> 0
    assert kernels["Dense_0"].sharding.spec == P(None, "data")
    assert kernels["Dense_1"].sharding.spec == P("data")
    assert kernels["Dense_2"].sharding.spec == P("data")
    assert trainer.params["Dense_0"]["bias"].sharding.spec == P()
    adam = trainer.state.opt_state[0]
    for moment in (adam.mu, adam.nu):
        assert moment["Dense_1"]["kernel"].sharding.spec == P("data")
        shards = moment["Dense_1"]["kernel"].addressable_shards
        assert len(shards) == 4 and all(s.data.nbytes == 64 * 32 * 4 // 4 for s in shards)
    assert adam.count.sharding.spec == P()


def test_fsdp_train_step_arguments_take_a_quarter_of_the_replicated_bytes():
    def big_model(ctx, spec, inputs):
        return nn.Dense(1)(nn.relu(nn.Dense(256)(nn.relu(nn.Dense(256)(inputs[0])))))

    def argument_bytes(**kwargs):
        trainer = loopax.Trainer(big_model, mse, optax.adam(1e-3), **kwargs)
        losses(trainer, steps=1)
        (executor,) = trainer.executors()
        return executor.run.memory_analysis().argument_size_in_bytes

    replicated = argument_bytes()
    sharded = argument_bytes(mesh={"data": 4}, fsdp=True)
    # the parameters and both Adam moments dominate; batch, biases and scalars are small
    assert sharded <= replicated / 4 + 8 * 1024, (sharded, replicated)


def test_a_rule_matching_no_annotation_raises_naming_it():
    trainer = trainer_on({"data": 2, "model": 2}, model_fn, rules=[*RULES, ("heads", "model")])
    with pytest.raises(ValueError, match=r"\('heads', 'model'\).*match no annotated"):
        losses(trainer, steps=1)
    twice = trainer_on({"data": 2, "model": 2}, model_fn, rules=[("embed", "model"), RULES[1]])
    with pytest.raises(ValueError, match=r"'params/Dense_0/kernel' of shape \(4, 8\).*one dim"):
        losses(twice, steps=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mesh": {"model": 4}}, "no 'data' axis"),
        ({"mesh": {"data": 3}}, r"needs 3 devices in all, but there are 4"),
        ({"mesh": {"data": -1, "model": 3}}, r"multiply to 3, which does not divide the 4"),
        ({"mesh": {"data": -1, "model": -1}}, "more than one -1"),
        ({"mesh": {"data": 0}}, "positive int size"),
        ({"mesh": [2, 2]}, "a dict of axis sizes"),
        ({"mesh": {"data": 4}, "parallel": "pmap"}, "parallel='pmap' cannot"),
        ({"rules": [("embed", "tensor")]}, "names mesh axis 'tensor'"),
        ({"rules": ["embed"]}, r"\(logical_name, mesh_axis or None\) pairs"),
    ],
)
def test_bad_mesh_or_rules_raise_naming_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        loopax.Trainer(model_fn, mse, optax.sgd(0.1), **kwargs)


def test_an_explicit_mesh_is_refused_and_an_auto_one_taken():
    explicit = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match="Explicit"):
        loopax.Trainer(model_fn, mse, optax.sgd(0.1), mesh=explicit)
    auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    trainer = loopax.Trainer(model_fn, mse, optax.sgd(0.1), mesh=auto, rules=RULES)
    losses(trainer, steps=1)
    assert trainer.mesh is auto


def test_sharding_report_lists_every_leaf_with_its_spec_and_bytes():
    trainer = trainer_on({"data": 2, "model": 2}, model_fn, rules=RULES)
    assert trainer.sharding_report() == "no train state yet"
    losses(trainer, steps=1)
    report = trainer.sharding_report()
    lines = report.splitlines()
    assert lines[0].split() == ["path", "shape", "partition", "spec", "bytes", "per", "device"]
    kernel = next(line for line in lines if line.startswith("params/Dense_0/kernel"))
    assert kernel.split() == ["params/Dense_0/kernel", "(4,", "8)", "P(None,", "'model')", "64"]
    assert any(line.startswith("opt_state/0/mu/scale ") and "P('model',)" in line for line in lines)
    assert lines[-1].startswith("total: ") and "bytes per device" in lines[-1]


def test_state_shardings_and_load_state_dict_across_meshes():
    source = trainer_on({"data": 2, "model": 2}, model_fn, rules=RULES)
    losses(source, steps=2)
    shardings = source.state_shardings()
    assert shardings["params"]["Dense_0"]["kernel"].spec == P(None, "model")
    assert shardings["opt_state"]["0"]["mu"]["Dense_0"]["kernel"].spec == P(None, "model")
    saved = source.state_dict()
    expected = losses(source, steps=3)
    for tree in (saved, jax.tree.map(jnp.asarray, saved)):
        target = trainer_on({"data": 1, "model": 4}, model_fn, rules=RULES)
        target.load_state_dict(tree)  # before the first batch: placed when it shows shapes
        np.testing.assert_allclose(losses(target, steps=3), expected, atol=1e-5)
        assert target.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    # jax.Arrays of another sharding, onto a trainer with a state: resharded on the devices
    target = trainer_on({"data": 4, "model": 1}, model_fn, rules=RULES)
    losses(target, steps=1)
    fresh = trainer_on({"data": 2, "model": 2}, model_fn, rules=RULES)
    losses(fresh, steps=2)
    target.state = fresh.state
    assert target.params["Dense_0"]["kernel"].sharding.mesh == target.mesh
    np.testing.assert_allclose(losses(target, steps=3), expected, atol=1e-5)


def test_evaluate_predict_fused_on_device_and_accumulated_steps_equal_one_device():
    x, y = data(32)

    def absolute_error(labels, predictions):
        return abs(labels[0] - predictions[0])

    def run(**kwargs):
        mean_error = metrics.Mean("abs", absolute_error)
        median = metrics.StreamingMedian("median", absolute_error)  # a host metric
        trainer = loopax.Trainer(model_fn, mse, optax.adam(0.05), eval_metrics=[mean_error, median],
                                 train_metrics=[metrics.StreamingMedian("median", absolute_error)],
                                 **kwargs)  # fmt: skip
        on_device = {"on_device": True, "devices": trainer.devices}
        for fused, placement in [(1, {}), (4, {}), (4, on_device)]:
            dataset = loopax.ArrayDataset(x, y, 8, loop_forever=True, **placement)
            last = loopax.Loop(trainer, steps_per_execution=fused).run_steps(dataset, 4)
        evaluation = trainer.evaluate(loopax.ArrayDataset(x[:30], y[:30], 7, drop_remainder=False))
        evaluation["train median"] = float(last["median"])
        return evaluation, trainer.predict(x[:5]), trainer.state_dict()["params"]

    one = run(devices=jax.devices()[:1])
    sharded = run(mesh={"data": 2, "model": 2}, rules=RULES, fsdp=True)
    for key in one[0]:
        assert sharded[0][key] == pytest.approx(one[0][key], abs=1e-5)
    np.testing.assert_allclose(sharded[1], one[1], atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), sharded[2], one[2])
    accumulated = [
        loopax.Trainer(model_fn, mse, optax.adam(0.05), accumulate_steps=2, **kwargs)
        for kwargs in ({"devices": jax.devices()[:1]}, {"mesh": {"data": 4}, "fsdp": True})
    ]
    stacked = [np.stack([x[:8], x[8:16]]), np.stack([y[:8], y[8:16]])]
    values = [float(t.train_step(None, stacked[:1], stacked[1:])["loss"]) for t in accumulated]
    assert values[1] == pytest.approx(values[0], abs=1e-6)


def test_init_params_start_sharded():
    one = loopax.Trainer(model_fn, mse, optax.adam(0.05), devices=jax.devices()[:1])
    losses(one, steps=1)
    start = jax.device_get(one.params)
    trainers = [
        loopax.Trainer(model_fn, mse, optax.adam(0.05), init_params=start, **kwargs)
        for kwargs in (
            {"devices": jax.devices()[:1]},
            {"mesh": {"data": 2, "model": 2}, "rules": RULES},
        )  # fmt: skip
    ]
    results = [losses(t, steps=3) for t in trainers]
    np.testing.assert_allclose(results[1], results[0], atol=1e-5)
    assert trainers[1].params["Dense_0"]["kernel"].sharding.spec == P(None, "model")


def test_the_default_path_keeps_its_one_dimensional_mesh_and_replicated_state():
    trainer = loopax.Trainer(model_fn, mse, optax.sgd(0.1))
    losses(trainer, steps=1)
    assert trainer.parallel == "shard_map" and trainer.mesh.axis_names == ("devices",)
    specs = {s.spec for s in jax.tree.leaves(trainer.state_shardings())}
    assert specs == {P()}
    # annotated variables are stored unboxed there too, so states move to and from a mesh
    assert isinstance(trainer.params["Dense_0"]["kernel"], jax.Array)
    assert set(trainer.params) == {"Dense_0", "Dense_1", "scale"}


def test_ctx_variable_axes_must_be_names():
    def bad_axes(ctx, spec, inputs):
        return inputs[0] * ctx.variable("scale", jnp.ones((4,)), axes="embed")

    trainer = loopax.Trainer(bad_axes, mse, optax.sgd(0.1), mesh={"data": 4})
    with pytest.raises(TypeError, match=r"ctx.variable\('scale'\): axes must be a sequence"):
        losses(trainer, steps=1)
