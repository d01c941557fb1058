"""Reads TensorBoard event files back (tensorboardX writes them; tensorboard is not installed):
the TFRecord framing (length, CRC, Event proto, CRC) parsed with tensorboardX's own protos."""

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2


def read_events(tb_dir: Path) -> dict[str, dict[str, list]]:
    """``{file name: {tag: [(step, value or image summary), ...]}}`` of every event file under
    `tb_dir` (scalars give their float, images their ``Summary.Image``)."""
    out = {}
    for path in sorted(Path(tb_dir).iterdir()):
        tags: dict[str, list] = {}
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                item = v.simple_value if kind == "simple_value" else getattr(v, kind)
                tags.setdefault(v.tag, []).append((event.step, item))
        out[path.name] = tags
    return out
