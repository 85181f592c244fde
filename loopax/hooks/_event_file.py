"""TensorBoard's event file, written directly: TFRecord framing around serialized `Event`s.

`tensorboard.summary.writer.event_file_writer` is the reference writer, but importing it
imports `tensorboard.summary`, its TensorFlow stub and fsspec: ~0.35 s of CPU in every
process that logs to TensorBoard (a resumed job, each process of a test's kill matrix). The
format is small and fixed, so it is written here; the protos still come from
`tensorboard.compat.proto`, which import in milliseconds. TensorBoard's own reader reads
the result (tests check it with `EventAccumulator`).

A record is: the data's length (uint64, little-endian), the masked CRC-32C of those 8
bytes, the data, the masked CRC-32C of the data (both uint32, little-endian).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from typing import Any

_CRC32C_POLYNOMIAL = 0x82F63B78  # Castagnoli, reflected
_MASK_DELTA = 0xA282EAD8
_FILE_VERSION = "brain.Event:2"
_PREFIX = "events.out.tfevents."
_uids = itertools.count()  # files opened in one second by one process differ, in order


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLYNOMIAL if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """The CRC-32C (Castagnoli) of `data`, as TFRecord files use."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits, plus a constant (mod 2**32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return b"".join(
        (
            header,
            struct.pack("<I", masked_crc32c(header)),
            data,
            struct.pack("<I", masked_crc32c(data)),
        )
    )


def _name_after_existing(logdir: str, stamp: int) -> str:
    """A new event file's name that sorts after every event file already in `logdir`.

    Readers apply a directory's files in name order, and a resumed run's restart marker only
    works after the points it drops. Two processes in one second are ordered by pid, which
    wraps (pid_max is often 32768): a later process's file would then sort first. Its time
    is put past the newest file's instead.
    """
    existing = [name for name in os.listdir(logdir) if name.startswith(_PREFIX)]
    for name in existing:
        stamp_text = name[len(_PREFIX) :].split(".", 1)[0]
        if stamp_text.isdigit():
            stamp = max(stamp, int(stamp_text))
    uid = next(_uids)
    name = f"{_PREFIX}{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{uid:06d}"
    if existing and name <= max(existing):
        name = f"{_PREFIX}{stamp + 1:010d}.{socket.gethostname()}.{os.getpid()}.{uid:06d}"
    return name


class EventFile:
    """An event file in `logdir`, opened (with its version event) at construction.

    Named as TensorBoard names its own (`events.out.tfevents.<time>.<host>.<pid>.<n>`), so
    `tensorboard --logdir` and `EventAccumulator` find it; writes are buffered until `flush`.

    Args:
      logdir: the directory (created if missing).
      event_pb2: `tensorboard.compat.proto.event_pb2`, imported by the caller.
    """

    def __init__(self, logdir: str, event_pb2: Any):
        os.makedirs(logdir, exist_ok=True)
        name = _name_after_existing(logdir, int(time.time()))
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self.add(event_pb2.Event(wall_time=time.time(), file_version=_FILE_VERSION))
        self.flush()

    def add(self, event: Any) -> None:
        """Appends one `Event` (buffered)."""
        self._file.write(record(event.SerializeToString()))

    def flush(self) -> None:
        """Hands everything written to the operating system."""
        self._file.flush()

    def close(self) -> None:
        """Flushes and closes the file."""
        if not self._file.closed:
            self._file.flush()
            self._file.close()
