"""Tests for `loopax.losses.triplet` against GoMLX's definitions, written as plain loops."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopax
from loopax import losses, optimizers

ONE_DEVICE = jax.devices()[:1]
DISTANCES = ["l2", "squared_l2", "cosine"]
MINING = ["all", "hard", "semi_hard"]


# ---------------------------------------------------------------------------------------
# Reference: GoMLX's TripletLoss, one triplet at a time in float64.


def ref_distance(a, b, distance):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if distance == "l2":
        return float(np.linalg.norm(a - b))
    if distance == "squared_l2":
        return float(np.sum((a - b) ** 2))
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def ref_margin(gap, margin):
    # margin > 0: hinge max(gap + margin, 0); otherwise the soft margin softplus(gap).
    return max(gap + margin, 0.0) if margin > 0 else float(np.logaddexp(0.0, gap))


def ref_triplet(classes, embeddings, margin, distance, mining, weights=None, keep=None):
    """Mean loss over GoMLX's valid triplets (or anchors); `keep` drops whole examples."""
    classes = np.asarray(classes).reshape(-1)
    batch = len(classes)
    keep = np.ones(batch, bool) if keep is None else np.asarray(keep).reshape(-1)
    weights = np.ones(batch) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    d = [
        [ref_distance(embeddings[i], embeddings[j], distance) for j in range(batch)]
        for i in range(batch)
    ]
    total, count = 0.0, 0
    for a in range(batch):
        if not keep[a]:
            continue
        positives = [p for p in range(batch) if p != a and keep[p] and classes[p] == classes[a]]
        negatives = [n for n in range(batch) if keep[n] and classes[n] != classes[a]]
        if mining == "all":
            for p, n in itertools.product(positives, negatives):
                total += weights[a] * ref_margin(d[a][p] - d[a][n], margin)
                count += 1
            continue
        if not positives or not negatives:
            continue
        hardest_positive = max(d[a][p] for p in positives)
        if mining == "hard":
            negative = min(d[a][n] for n in negatives)
        else:
            farther = [d[a][n] for n in negatives if d[a][n] > hardest_positive]
            negative = min(farther) if farther else max(d[a][n] for n in negatives)
        total += weights[a] * ref_margin(hardest_positive - negative, margin)
        count += 1
    return total / count if count else 0.0


def _batch(seed, batch=10, dim=6, classes=3):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, classes, size=batch).astype(np.int32),
        rng.normal(size=(batch, dim)).astype(np.float32),
    )


def _loss(loss_fn, labels, embeddings):
    return float(loss_fn([jnp.asarray(label) for label in labels], [jnp.asarray(embeddings)]))


# ---------------------------------------------------------------------------------------
# Values.

GOMLX_LABELS_1 = np.array([[0], [1], [0], [1]], np.float32)
GOMLX_EMBEDDINGS_1 = np.array([[0.23, 0.75], [0.89, 0.41], [0.37, 0.62], [0.78, 0.24]], np.float32)
GOMLX_LABELS_2 = np.array([[1], [0], [0], [0], [3], [2], [3], [2], [1], [2]], np.float32)
GOMLX_EMBEDDINGS_2 = np.array(
    [
        [0.08208963, 0.11788353, 0.46360782, 0.3360519, 0.2702437, 0.6951965],
        [0.598121, 0.14609586, 0.07872304, 0.949776, 0.41479972, 0.36961815],
        [0.11646613, 0.8878409, 0.4034519, 0.9632401, 0.6313564, 0.0198459],
        [0.03582959, 0.3428808, 0.843301, 0.6335877, 0.8623248, 0.16186231],
        [0.09054314, 0.746887, 0.56099737, 0.7181275, 0.60642695, 0.02207313],
        [0.2735666, 0.08748698, 0.13752021, 0.4570993, 0.8813543, 0.98528206],
        [0.5412437, 0.2382705, 0.6263132, 0.29713312, 0.9241606, 0.734765],
        [0.22289598, 0.84535605, 0.4398808, 0.5816502, 0.31203038, 0.5436755],
        [0.5512105, 0.6922551, 0.11149547, 0.6343566, 0.20425326, 0.3884894],
        [0.51529086, 0.35541356, 0.77092594, 0.3715265, 0.40550032, 0.7369012],
    ],
    np.float32,
)


@pytest.mark.parametrize(
    "batch, mining, margin, distance, expected",
    [
        # GoMLX's TestTripletLoss values.
        (1, "all", 1.0, "l2", 0.54368829),
        (1, "semi_hard", 1.0, "l2", 0.5914507),
        (1, "hard", 1.0, "l2", 0.5914507),
        (1, "semi_hard", 1.0, "cosine", 0.783348),
        (2, "all", 1.0, "l2", 1.0418946),
        (2, "semi_hard", 1.0, "l2", 0.9323689),
        (2, "hard", 1.0, "l2", 1.5172637),
        (2, "hard", -1.0, "l2", 0.98718655),
        (2, "hard", 1.0, "cosine", 1.2390234),
    ],
)
def test_matches_gomlx_own_test_values(batch, mining, margin, distance, expected):
    labels, embeddings = {
        1: (GOMLX_LABELS_1, GOMLX_EMBEDDINGS_1),
        2: (GOMLX_LABELS_2, GOMLX_EMBEDDINGS_2),
    }[batch]
    loss_fn = losses.triplet(margin=margin, distance=distance, mining=mining)
    assert _loss(loss_fn, [labels], embeddings) == pytest.approx(expected, abs=1e-5)
    # And the same from the independent reference.
    assert ref_triplet(labels, embeddings, margin, distance, mining) == pytest.approx(
        expected, abs=1e-5
    )


@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("mining", MINING)
@pytest.mark.parametrize("margin", [0.5, 2.0, 0.0, -1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference(distance, mining, margin, seed):
    classes, embeddings = _batch(seed)
    loss_fn = losses.triplet(margin=margin, distance=distance, mining=mining)
    expected = ref_triplet(classes, embeddings, margin, distance, mining)
    assert _loss(loss_fn, [classes], embeddings) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_defaults_are_gomlx_semi_hard_l2_margin_one():
    classes, embeddings = _batch(4)
    expected = ref_triplet(classes, embeddings, 1.0, "l2", "semi_hard")
    assert _loss(losses.triplet(), [classes], embeddings) == pytest.approx(expected, rel=1e-5)


def test_labels_with_trailing_axis_agree_with_flat_labels():
    classes, embeddings = _batch(5)
    loss_fn = losses.triplet(mining="all")
    flat = _loss(loss_fn, [classes], embeddings)
    assert _loss(loss_fn, [classes[:, None]], embeddings) == flat


def test_semi_hard_prefers_the_closest_negative_beyond_the_hardest_positive():
    # Anchor 0 at the origin; its only positive 2 away; negatives 1 (hard), 3 and 5 away.
    classes = np.array([0, 0, 1, 1, 1], np.int32)
    embeddings = np.array([[0.0], [2.0], [1.0], [3.0], [5.0]], np.float32)
    # Weights keep anchor 0 alone; all 5 anchors are valid, so the mean divides by 5.
    only_anchor_0 = np.array([1.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    semi_hard = losses.triplet(margin=2.0, mining="semi_hard")
    hard = losses.triplet(margin=2.0, mining="hard")
    assert _loss(semi_hard, [classes, only_anchor_0], embeddings) == pytest.approx((2 - 3 + 2) / 5)
    assert _loss(hard, [classes, only_anchor_0], embeddings) == pytest.approx((2 - 1 + 2) / 5)
    # With no negative beyond the positive, semi-hard falls back to the farthest negative.
    near = np.array([[0.0], [9.0], [1.0], [3.0], [5.0]], np.float32)
    assert _loss(semi_hard, [classes, only_anchor_0], near) == pytest.approx((9 - 5 + 2) / 5)


def test_no_valid_triplet_is_zero_with_finite_gradient():
    embeddings = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    for classes in (np.array([0, 1, 2, 3]), np.array([5, 5, 5, 5])):
        for mining in MINING:
            loss_fn = losses.triplet(mining=mining)
            assert _loss(loss_fn, [classes], embeddings) == 0.0
            gradient = jax.grad(lambda e, fn=loss_fn, c=classes: fn([jnp.asarray(c)], [e]))(
                embeddings
            )
            assert np.all(gradient == 0.0)


# ---------------------------------------------------------------------------------------
# Masks and weights.


@pytest.mark.parametrize("mining", MINING)
@pytest.mark.parametrize("distance", DISTANCES)
def test_masked_out_examples_are_as_if_absent(mining, distance):
    classes, embeddings = _batch(6)
    keep = np.array([True, True, False, True, True, False, True, True, True, False])
    loss_fn = losses.triplet(mining=mining, distance=distance)
    masked = _loss(loss_fn, [classes, keep], embeddings)
    absent = _loss(loss_fn, [classes[keep]], embeddings[keep])
    assert masked == pytest.approx(absent, rel=1e-5, abs=1e-7)
    assert masked == pytest.approx(
        ref_triplet(classes, embeddings, 1.0, distance, mining, keep=keep), rel=1e-5, abs=1e-7
    )
    # Padding rows may be anything, even NaN, when masked out.
    padded = embeddings.copy()
    padded[~keep] = np.nan
    assert _loss(loss_fn, [classes, keep], padded) == pytest.approx(masked, rel=1e-5, abs=1e-7)
    gradient = jax.grad(lambda e: loss_fn([jnp.asarray(classes), jnp.asarray(keep)], [e]))(
        jnp.asarray(padded)
    )
    assert np.all(np.isfinite(gradient))
    assert np.all(gradient[~keep] == 0.0)


@pytest.mark.parametrize("mining", MINING)
def test_weights_scale_each_anchor(mining):
    classes, embeddings = _batch(7)
    weights = np.random.default_rng(8).uniform(0.0, 3.0, size=10).astype(np.float32)
    keep = np.arange(10) % 4 != 1
    loss_fn = losses.triplet(mining=mining, margin=1.5)
    expected = ref_triplet(classes, embeddings, 1.5, "l2", mining, weights=weights)
    assert _loss(loss_fn, [classes, weights], embeddings) == pytest.approx(expected, rel=1e-5)
    both = ref_triplet(classes, embeddings, 1.5, "l2", mining, weights=weights, keep=keep)
    for labels in ([classes, keep, weights], [classes, weights[:, None], keep[:, None]]):
        assert _loss(loss_fn, labels, embeddings) == pytest.approx(both, rel=1e-5)


def test_bad_extra_labels_raise():
    classes, embeddings = _batch(0)
    loss_fn = losses.triplet()
    with pytest.raises(ValueError, match=r"labels\[1\] has shape \(9,\).*\(10,\) \(\[batch\]\)"):
        loss_fn([jnp.asarray(classes), jnp.ones(9)], [jnp.asarray(embeddings)])
    with pytest.raises(ValueError, match="second bool mask"):
        mask = jnp.ones(10, bool)
        loss_fn([jnp.asarray(classes), mask, mask], [jnp.asarray(embeddings)])


# ---------------------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("mining", MINING)
def test_gradient_is_finite_for_equal_and_zero_embeddings(distance, mining):
    # Examples 0 and 1 coincide (distance 0, where sqrt has an infinite slope), example 3 is
    # all zeros (no direction for the cosine).
    classes = jnp.array([0, 0, 1, 1, 0])
    embeddings = jnp.array(
        [[1.0, 2.0], [1.0, 2.0], [-1.0, 0.5], [0.0, 0.0], [0.3, -0.2]], jnp.float32
    )
    loss_fn = losses.triplet(distance=distance, mining=mining, margin=3.0)
    value, gradient = jax.value_and_grad(lambda e: loss_fn([classes], [e]))(embeddings)
    assert np.isfinite(float(value)) and float(value) > 0
    assert np.all(np.isfinite(gradient))
    assert np.any(gradient != 0.0)


def test_l2_gradient_matches_finite_differences():
    classes, embeddings = _batch(9, batch=6, dim=3, classes=2)
    embeddings = embeddings.astype(np.float64)
    with jax.enable_x64(True):
        for mining in MINING:
            loss_fn = losses.triplet(mining=mining, margin=5.0)
            gradient = np.asarray(
                jax.grad(lambda e, fn=loss_fn: fn([jnp.asarray(classes)], [e]))(
                    jnp.asarray(embeddings)
                )
            )
            step = 1e-6
            for index in [(0, 0), (2, 1), (5, 2)]:
                shifted_up, shifted_down = embeddings.copy(), embeddings.copy()
                shifted_up[index] += step
                shifted_down[index] -= step
                numeric = (
                    ref_triplet(classes, shifted_up, 5.0, "l2", mining)
                    - ref_triplet(classes, shifted_down, 5.0, "l2", mining)
                ) / (2 * step)
                assert gradient[index] == pytest.approx(numeric, rel=1e-4, abs=1e-7), (
                    mining,
                    index,
                )


# ---------------------------------------------------------------------------------------
# Arguments, names and compilation.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"margin": float("nan")}, "margin=nan must be a finite number"),
        ({"margin": float("inf")}, "margin=inf must be a finite number"),
        ({"margin": "soft"}, "margin='soft' must be a finite number"),
        ({"distance": "euclidean"}, "unknown distance='euclidean'; valid ones are: l2, squared_l2"),
        (
            {"mining": "semi-hard"},
            "unknown mining='semi-hard'; valid ones are: all, hard, semi_hard",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        losses.triplet(**kwargs)


def test_bad_shapes_raise():
    loss_fn = losses.triplet()
    with pytest.raises(
        ValueError, match=r"embeddings of shape \[batch, embedding_dim\], got shape \(4,\)"
    ):
        loss_fn([jnp.zeros(4)], [jnp.zeros(4)])
    with pytest.raises(ValueError, match=r"of shape \(4,\) or \(4, 1\).*got shape \(3,\)"):
        loss_fn([jnp.zeros(3)], [jnp.zeros((4, 2))])
    with pytest.raises(ValueError, match="must be lists of arrays"):
        loss_fn(jnp.zeros(4), jnp.zeros((4, 2)))  # type: ignore[arg-type]


@pytest.mark.parametrize("mining", MINING)
def test_from_name_round_trip(mining):
    classes, embeddings = _batch(10)
    by_name = losses.from_name("triplet", margin=0.7, distance="cosine", mining=mining)
    assert by_name.__name__ == "triplet"
    assert losses.from_name(by_name.__name__).__name__ == "triplet"
    direct = losses.triplet(margin=0.7, distance="cosine", mining=mining)
    assert _loss(by_name, [classes], embeddings) == _loss(direct, [classes], embeddings)
    with pytest.raises(ValueError, match="unknown mining='easy'"):
        losses.from_name("triplet", mining="easy")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_keeps_its_dtype(dtype):
    classes, embeddings = _batch(11)
    loss = losses.triplet()([jnp.asarray(classes)], [jnp.asarray(embeddings, dtype)])
    assert loss.dtype == dtype
    low = np.asarray(jnp.asarray(embeddings, dtype), np.float32)
    assert float(loss) == pytest.approx(ref_triplet(classes, low, 1.0, "l2", "semi_hard"), rel=1e-2)


def _clusters(seed, batch=64):
    # 4 classes whose centres are hidden in 8 noisy features.
    rng = np.random.default_rng(seed)
    classes = rng.integers(0, 4, size=batch).astype(np.int32)
    centres = rng.normal(size=(4, 8)).astype(np.float32)
    x = centres[classes] + 0.8 * rng.normal(size=(batch, 8)).astype(np.float32)
    return x.astype(np.float32), classes


@pytest.mark.parametrize("mining", MINING)
def test_trains_an_embedding_through_the_trainer(mining):
    x, classes = _clusters(12, batch=128)

    def model_fn(ctx, spec, inputs):
        return nn.Dense(4)(nn.tanh(nn.Dense(16)(inputs[0])))

    trainer = loopax.Trainer(
        model_fn,
        losses.from_name("triplet", mining=mining, margin=1.0),
        optimizers.adam(0.01),
        devices=ONE_DEVICE,
    )
    compiled = []
    trainer.on_exec_creation(compiled.append)
    before = trainer.evaluate(loopax.ArrayDataset(x, classes, 32))["mean_loss"]
    loopax.Loop(trainer).run_steps(loopax.ArrayDataset(x, classes, 32, loop_forever=True), 40)
    after = trainer.evaluate(loopax.ArrayDataset(x, classes, 32))["mean_loss"]
    assert np.isfinite(after)
    assert after < 0.7 * before
    assert [info.graph_type for info in compiled] == ["eval", "train"]
