"""Train a character-level transformer language model on Python's own standard library source.

    python examples/transformer_lm.py                 # 1000 steps: a few minutes on 2 cores
    python examples/transformer_lm.py --dir runs/lm   # again with the same --dir: it resumes
    python examples/transformer_lm.py --steps-per-execution 1   # one dispatch per step
    python examples/transformer_lm.py --compute-dtype bfloat16

The text is the standard library's top-level `.py` files (found with `sysconfig`, so nothing is
downloaded), read as characters: printable ASCII and newlines, tabs as four spaces, anything
else as `?`. The last tenth is held out for validation. The model is a Flax Linen module: a
GPT-style decoder of 2 pre-norm blocks (causal self-attention, an MLP), width 128, context
64, trained with AdamW on batches of 32 windows, 8 steps fused into one dispatch.

Attached: progress bar, evaluation of the validation text every 250 steps, Orbax checkpoints
(resume on restart). At the end it samples a line of code from a prompt. The last two lines
printed are `validation loss: <nats per character>` and the sampled line.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

# The characters the model reads and writes: newline, then printable ASCII; `?` stands for
# anything else (rare in the standard library's source).
VOCABULARY = "\n" + "".join(chr(code) for code in range(32, 127))
UNKNOWN = VOCABULARY.index("?")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="global step to train to")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="characters the model sees")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument(
        "--steps-per-execution", type=int, default=8, help="steps fused into one dispatch"
    )
    parser.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the dtype the model computes in (parameters stay float32)",
    )
    parser.add_argument("--eval-every", type=int, default=250, help="steps between evaluations")
    parser.add_argument(
        "--val-batches", type=int, default=16, help="validation batches per evaluation"
    )
    parser.add_argument("--max-chars", type=int, default=None, help="read at most this much text")
    parser.add_argument("--prompt", default="def ", help="what the sampled line starts with")
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature; 0: greedy"
    )
    parser.add_argument("--dir", default="runs/transformer_lm", help="checkpoints")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# -- the data ------------------------------------------------------------------------------


def standard_library_text(max_chars: int | None = None) -> str:
    """The standard library's top-level `.py` files, in name order, joined (at most `max_chars`)."""
    directory = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(directory.glob("*.py"))
    if not files:
        sys.exit(f"found no .py files in the standard library directory {directory}")
    parts, total = [], 0
    for path in files:
        part = path.read_text(encoding="utf-8", errors="replace").expandtabs(4)
        parts.append(part)
        total += len(part)
        if max_chars is not None and total >= max_chars:
            break
    text = "\n".join(parts)
    return text if max_chars is None else text[:max_chars]


def encode(text: str) -> np.ndarray:
    """Characters as indices into `VOCABULARY` (`?` for any other), int32."""
    codes = np.frombuffer(text.encode("ascii", errors="replace"), np.uint8).astype(np.int32)
    indices = np.where(codes == ord("\n"), 0, codes - 31)  # " " is 1, "~" is 95
    printable = (codes == ord("\n")) | ((codes >= 32) & (codes < 127))
    return np.where(printable, indices, UNKNOWN).astype(np.int32)


def decode(indices: Any) -> str:
    return "".join(VOCABULARY[int(index)] for index in indices)


def windows(tokens: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive windows of `context` characters and, for each, the next characters.

    Window i reads characters `i*context .. (i+1)*context - 1` and learns to predict each
    one's successor: the targets are the same window shifted by one.
    """
    count = (len(tokens) - 1) // context
    inputs = tokens[: count * context].reshape(count, context)
    targets = tokens[1 : count * context + 1].reshape(count, context)
    return inputs, targets


# -- the model -------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention, then a 4x-wide MLP, each residual."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        causal = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(
            nn.LayerNorm()(x), mask=causal
        )
        hidden = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(hidden)


class CharTransformer(nn.Module):
    """A GPT-style character model: `[batch, context]` indices -> `[batch, context, vocab]` logits.

    Position t's logits predict character t + 1 from characters 0..t only.
    """

    vocab: int = len(VOCABULARY)
    width: int = 128
    layers: int = 2
    heads: int = 4
    context: int = 64

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        # No dtype= anywhere: with Trainer(compute_dtype=...) the parameters arrive cast to
        # it, and Flax computes in the parameters' dtype.
        x = nn.Embed(self.vocab, self.width)(tokens)
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (self.context, self.width)
        )
        x = x + positions[: tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


# -- sampling --------------------------------------------------------------------------------


def sample_line(trainer: Any, prompt: str, context: int, temperature: float, seed: int) -> str:
    """Continues `prompt` one character at a time until a newline (at most 3 lines' worth).

    Each character is one `trainer.predict` of the last `context` characters (right-padded:
    the causal model's logits at the last real position ignore the padding after it).
    """
    rng = np.random.default_rng(seed)
    text = encode(prompt).tolist()
    for _ in range(3 * context):
        window = text[-context:]
        padded = np.zeros((1, context), np.int32)
        padded[0, : len(window)] = window
        logits = np.asarray(trainer.predict(padded, batch_size=1))[0, len(window) - 1]
        if temperature <= 0:
            index = int(np.argmax(logits))
        else:
            scaled = (logits - logits.max()) / temperature
            probabilities = np.exp(scaled) / np.exp(scaled).sum()
            index = int(rng.choice(len(probabilities), p=probabilities))
        if VOCABULARY[index] == "\n":
            break
        text.append(index)
    return decode(text)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    import loopax
    from loopax import hooks, losses, optimizers

    tokens = encode(standard_library_text(args.max_chars))
    split = int(0.9 * len(tokens))
    train_x, train_y = windows(tokens[:split], args.context)
    val_x, val_y = windows(tokens[split:], args.context)
    val_count = min(len(val_x), args.val_batches * args.batch_size)
    if len(train_x) < args.batch_size or val_count == 0:
        sys.exit(f"{len(tokens)} characters are too few for batches of {args.batch_size}")
    print(
        f"{len(tokens):,} characters: {len(train_x):,} training windows of {args.context}, "
        f"{val_count:,} for validation"
    )
    # The training windows stay on the device: a fused group slices its batches there.
    train = loopax.ArrayDataset(
        train_x, train_y, args.batch_size, name="train", seed=args.seed, loop_forever=True,
        on_device=True,
    )  # fmt: skip
    val = loopax.ArrayDataset(
        val_x[:val_count], val_y[:val_count], args.batch_size, name="val", shuffle=False,
        drop_remainder=False,
    )  # fmt: skip
    model = CharTransformer(
        width=args.width, layers=args.layers, heads=args.heads, context=args.context
    )
    schedule = optimizers.warmup_cosine(
        args.learning_rate, warmup_steps=min(100, args.steps // 10), decay_steps=args.steps + 1
    )
    trainer = loopax.Trainer(
        model,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.adamw(schedule, weight_decay=0.01, clip_global_norm=1.0),
        seed=args.seed,
        compute_dtype=None if args.compute_dtype == "float32" else args.compute_dtype,
    )
    loop = loopax.Loop(trainer, steps_per_execution=args.steps_per_execution)
    compiling: list[float] = []  # seconds each program took to compile
    trainer.on_exec_creation(lambda info: compiling.append(info.compile_seconds))
    checkpointer = hooks.checkpoint(
        loop, os.path.join(args.dir, "checkpoints"), every_n_steps=args.eval_every
    )
    if trainer.global_step > 0:
        print(f"resumed from step {trainer.global_step} in {args.dir}")
    if not args.no_progress:
        hooks.progress_bar(loop)
    hooks.evaluate(loop, val, every_n_steps=args.eval_every, print_results=True)
    loop.run_to_step(train, args.steps)
    checkpointer.wait()
    print(f"compiled {len(compiling)} programs in {sum(compiling):.1f} s")
    loss = trainer.evaluate(val)["mean_loss"]
    print(f"validation loss: {loss:.3f}")
    line = sample_line(trainer, args.prompt, args.context, args.temperature, args.seed)
    print(line)
    return loss


if __name__ == "__main__":
    main()
