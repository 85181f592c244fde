"""GoMLX's triplet loss over a batch of embeddings, with its distances and mining strategies."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._weights import LossFn, compute_dtype, masked_mean, result_dtype, split_extras, unpack

DISTANCES = ("l2", "squared_l2", "cosine")
MINING_STRATEGIES = ("all", "hard", "semi_hard")

# GoMLX's epsilons (Epsilon32/64): below it a squared distance counts as 0.
_EPSILON = {jnp.dtype(jnp.float32): 1e-7, jnp.dtype(jnp.float64): 1e-8}


def _pairwise_distances(embeddings: jax.Array, distance: str) -> jax.Array:
    """The `[batch, batch]` matrix of distances between the rows of `embeddings`."""
    epsilon = _EPSILON[jnp.dtype(embeddings.dtype)]
    dot_products = embeddings @ embeddings.T
    # The diagonal of the products (not a separate sum) makes d(i, i) exactly 0.
    square_norms = jnp.diagonal(dot_products)
    if distance == "cosine":
        # GoMLX divides by the norm as is; the floor keeps an all-zero embedding finite.
        norms = jnp.sqrt(jnp.maximum(square_norms, epsilon * epsilon))
        unit = embeddings / norms[:, None]
        distances = 1.0 - unit @ unit.T
    else:
        distances = square_norms[:, None] - 2.0 * dot_products + square_norms[None, :]
        if distance == "l2":
            # sqrt has an infinite gradient at 0 (the diagonal, equal embeddings): take it
            # only where the squared distance is not tiny, and give 0 elsewhere.
            tiny = distances < epsilon
            distances = jnp.where(tiny, 0.0, jnp.sqrt(jnp.where(tiny, epsilon, distances)))
    # Rounding may leave tiny negative distances.
    return jnp.maximum(distances, 0.0)


def _check_labels(labels: jax.Array, embeddings: jax.Array) -> None:
    if embeddings.ndim != 2:
        raise ValueError(
            f"triplet: predictions[0] must be embeddings of shape [batch, embedding_dim], got "
            f"shape {embeddings.shape}"
        )
    batch = embeddings.shape[0]
    if labels.shape not in ((batch,), (batch, 1)):
        raise ValueError(
            f"triplet: labels[0] must hold one class per example, of shape ({batch},) or "
            f"({batch}, 1) for embeddings of shape {embeddings.shape}; got shape {labels.shape}"
        )


def triplet(*, margin: float = 1.0, distance: str = "l2", mining: str = "semi_hard") -> LossFn:
    """Returns GoMLX's triplet loss: pulls same-class embeddings together, pushes others apart.

    `labels[0]` holds a class per example (`[batch]` or `[batch, 1]`, any dtype compared by
    equality) and `predictions[0]` the embeddings `[batch, embedding_dim]`. With `d` the
    pairwise distances, a triplet `(a, p, n)` has `p != a` of the anchor's class and `n` of
    another class; its loss is `max(d(a, p) - d(a, n) + margin, 0)`, or the soft margin
    `softplus(d(a, p) - d(a, n))` when `margin <= 0` (as in GoMLX). Mining picks the triplets:

    - "all": every valid triplet; the loss is the mean over all of them (easy ones count as 0).
    - "hard": per anchor, its farthest positive and its closest negative.
    - "semi_hard" (GoMLX's default): per anchor, its farthest positive `P`, and the closest
      negative farther than `P`; if no negative is farther than `P`, the farthest negative.

    For "hard" and "semi_hard" the loss is the mean over the anchors that have at least one
    positive and one negative. A batch with no valid triplet gives 0.

    Distances: "l2" (`||x - y||`, with a zero gradient where two embeddings coincide),
    "squared_l2" (`||x - y||^2`) and "cosine" (`1 - cos(x, y)`), all clipped at 0.

    Extra labels may be a bool mask and/or float weights of shape `[batch]` or `[batch, 1]`.
    Weights scale each anchor's loss. A masked-out example takes no part in any triplet (as
    anchor, positive or negative), so padding never changes the loss; GoMLX only drops
    masked-out anchors.

    The loss mines within the batch it is given: in a data-parallel run each device mines
    within its own shard.

    Args:
        margin: the wanted gap between positive and negative distances when positive; zero
            or negative selects the soft margin. Must be finite.
        distance: "l2", "squared_l2" or "cosine".
        mining: "all", "hard" or "semi_hard".

    Returns:
        A LossFn `loss_fn(labels, predictions) -> scalar`.

    Raises:
        ValueError: if `margin` is not a finite number or `distance` or `mining` is unknown
            (raised here); when the loss runs, if the embeddings are not 2-D or the labels'
            shape does not match them.

    Example:
        Anchors 0 and 1 lose max(1 - 3 + 1, 0) = 0 and max(1 - 2 + 1, 0) = 0; anchor 2 has
        no positive, so it is no anchor:

        >>> import jax.numpy as jnp
        >>> from loopax.losses import triplet
        >>> loss_fn = triplet(margin=1.0, mining="hard")
        >>> classes = jnp.array([0, 0, 1])
        >>> embeddings = jnp.array([[0.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
        >>> float(loss_fn([classes], [embeddings]))
        0.0
        >>> float(triplet(margin=2.5, mining="hard")([classes], [embeddings]))  # (0.5 + 1.5) / 2
        1.0
    """
    if (
        isinstance(margin, bool)
        or not isinstance(margin, numbers.Real)
        or not math.isfinite(margin)
    ):
        raise ValueError(
            f"triplet: margin={margin!r} must be a finite number (positive for a hinge "
            "margin, zero or negative for the soft margin), e.g. triplet(margin=1.0)"
        )
    if distance not in DISTANCES:
        raise ValueError(
            f"triplet: unknown distance={distance!r}; valid ones are: {', '.join(DISTANCES)}"
        )
    if mining not in MINING_STRATEGIES:
        raise ValueError(
            f"triplet: unknown mining={mining!r}; valid ones are: {', '.join(MINING_STRATEGIES)}"
        )
    margin = float(margin)

    def triplet_loss(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
        classes, embeddings, extras = unpack("triplet", labels, predictions)
        _check_labels(classes, embeddings)
        batch = embeddings.shape[0]
        mask, weights = split_extras(
            "triplet", extras, {(batch,): "[batch]", (batch, 1): "[batch, 1]"}
        )
        classes = classes.reshape(batch)
        dtype = compute_dtype(embeddings)
        out_dtype = result_dtype(embeddings)
        embeddings = embeddings.astype(dtype)
        if mask is None:
            in_batch = jnp.ones(batch, bool)
        else:
            in_batch = mask.reshape(batch)
            # Padding may hold anything (NaN): zero it so that neither the distances nor
            # their gradient (a matrix product over every row) see it.
            embeddings = jnp.where(in_batch[:, None], embeddings, 0)
        distances = _pairwise_distances(embeddings, distance)

        same_class = classes[:, None] == classes[None, :]
        pair_in_batch = in_batch[:, None] & in_batch[None, :]
        positive = same_class & ~jnp.eye(batch, dtype=bool) & pair_in_batch
        negative = ~same_class & pair_in_batch

        if mining == "all":
            gaps = distances[:, :, None] - distances[:, None, :]  # [anchor, positive, negative]
            valid = positive[:, :, None] & negative[:, None, :]
        else:
            # Distances are >= 0, so filling with 0 leaves the maximum over positives as is,
            # and filling with a row's maximum leaves its minimum over negatives as is; both
            # fills keep the gradient finite for anchors without positives or negatives.
            positive_distance = jnp.max(jnp.where(positive, distances, 0.0), axis=1)
            if mining == "hard":
                farthest = jnp.max(distances, axis=1, keepdims=True)
                negative_distance = jnp.min(jnp.where(negative, distances, farthest), axis=1)
            else:
                farthest_negative = jnp.max(jnp.where(negative, distances, 0.0), axis=1)
                semi_hard = negative & (distances > positive_distance[:, None])
                negative_distance = jnp.min(
                    jnp.where(semi_hard, distances, farthest_negative[:, None]), axis=1
                )
            gaps = positive_distance - negative_distance
            valid = jnp.any(positive, axis=1) & jnp.any(negative, axis=1)

        if margin > 0:
            per_triplet = jnp.maximum(gaps + margin, 0.0)
        else:
            per_triplet = jax.nn.softplus(gaps)
        if weights is not None:
            anchor_weights = weights.reshape(batch).astype(dtype)
            per_triplet = per_triplet * anchor_weights.reshape((batch,) + (1,) * (gaps.ndim - 1))
        return masked_mean(per_triplet, valid, out_dtype)

    triplet_loss.__name__ = triplet_loss.__qualname__ = "triplet"
    triplet_loss.__doc__ = (
        f"Triplet loss with margin={margin:g}, distance={distance!r}, mining={mining!r} "
        "(see `loopax.losses.triplet`)."
    )
    return triplet_loss
