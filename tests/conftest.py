"""Test-session setup shared by every test package.

Simulated CPU devices must be configured before jax is first imported, so this runs
at the top of the test tree: multi-device tests get 4 devices, and single-device tests
pass `devices=jax.devices()[:1]`.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
