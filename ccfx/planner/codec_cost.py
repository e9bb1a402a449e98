"""What a codec costs at one tensor's size, measured on this machine once and cached.

A codec pays only if the seconds it saves on the wire exceed the seconds its encode and decode
take, and those depend on the machine (a Triton kernel on a GPU, the torch reference on a
CPU), the tensor's size and the thread count: so they are measured, not guessed. Each
measurement times the path the runtime takes (``WireFormat.encode`` packs the payload into the
uint8 buffer that is sent; ``decode_into`` unpacks it into the receive buffer), the median of
a few repeats after a warm-up, on a Gaussian tensor of the edge's shape.

The cache is a JSON file per machine, keyed by codec spec, shape, dtype and device:
``$CCFX_CACHE_DIR/codec_times-<machine>.json`` (default ``~/.cache/ccfx``), where ``<machine>``
names the torch version, the device and the thread count. Delete it to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import codecs
from ..wire.format import WireFormat


@dataclass(frozen=True)
class CodecCost:
    """Seconds to encode (sender) and decode (receiver) one tensor, and its bytes."""

    spec: str
    encode_s: float
    decode_s: float
    raw_bytes: int
    wire_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


def machine_key(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine())
    text = f"{torch.__version__}|{device.type}|{name}|{torch.get_num_threads()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_path(device: torch.device | str = "cpu") -> Path:
    root = Path(os.environ.get("CCFX_CACHE_DIR", Path.home() / ".cache" / "ccfx"))
    return root / f"codec_times-{machine_key(device)}.json"


class CodecTimer:
    """Codec costs by (spec, shape, dtype): measured at the first request, then cached in
    memory and, unless ``path`` is None, on disk.

    ``throughput`` (raw bytes per second) prices every codec's encode and its decode at that
    rate instead of measuring them, the wire bytes still exact: the same answer on any machine
    at any load (tests that compare predictions), or a plan for a machine you are not on."""

    def __init__(self, device: torch.device | str = "cpu", path: Path | str | None | bool = True,
                 repeats: int = 5, throughput: float | None = None):
        self.device = torch.device(device)
        self.throughput = throughput
        if throughput is not None:
            path = None  # modelled costs are not measurements: never cached on disk
        self.path = cache_path(self.device) if path is True else (Path(path) if path else None)
        self.repeats = repeats
        self._table: dict[str, dict] = self._load()

    def cost(self, spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> CodecCost:
        spec = codecs.canonical(spec)
        shape = tuple(int(d) for d in shape)
        raw = _numel(shape) * dtype.itemsize
        codec = codecs.get(spec)
        if spec == "none" or not codec.applies_to(dtype):
            return CodecCost("none", 0.0, 0.0, raw, raw)
        key = f"{spec}|{'x'.join(map(str, shape))}|{str(dtype).replace('torch.', '')}|{self.device.type}"
        hit = self.cached(key, lambda: self._measure(spec, shape, dtype))
        return CodecCost(spec, hit["encode_s"], hit["decode_s"], raw, hit["wire_bytes"])

    def cached(self, key: str, measure) -> dict:
        """``measure()`` (a JSON-able dict) once per ``key`` on this machine, then the cache."""
        hit = self._table.get(key)
        if hit is None:
            hit = self._table[key] = measure()
            self._save()
        return hit

    def _measure(self, spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
        wire = WireFormat(codecs.prototype(spec), shape, dtype)
        if self.throughput is not None:
            seconds = _numel(shape) * dtype.itemsize / self.throughput
            return {"encode_s": seconds, "decode_s": seconds, "wire_bytes": int(wire.nbytes)}
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen).to(device=self.device, dtype=dtype)
        out = torch.empty_like(x)
        state = wire.init_state(self.device)  # explicit, as a pipeline stage keeps it
        enc, dec = [], []
        for i in range(self.repeats + 1):
            t0 = self._now()
            buf = wire.encode(x, state)
            t1 = self._now()
            wire.decode_into(buf, out, state)
            t2 = self._now()
            if i:  # the first call warms caches
                enc.append(t1 - t0)
                dec.append(t2 - t1)
        return {"encode_s": statistics.median(enc), "decode_s": statistics.median(dec),
                "wire_bytes": int(wire.nbytes)}

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _load(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}  # a damaged cache is measured again
        return data if isinstance(data, dict) else {}

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._table, indent=1, sort_keys=True))
            tmp.replace(self.path)  # atomic: ranks measuring at once never see half a file
        except OSError:
            pass  # a read-only home: measure again next time


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
