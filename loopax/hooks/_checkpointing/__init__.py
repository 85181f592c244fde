"""Orbax checkpoints of a loopax run: the `Checkpointer`, its hook, its files and checks."""
