"""A profile: everything the simulator knows about one deployment of the
executor, as one JSON file.

- provenance: where the numbers come from (calibrated on which model,
  device, dtype, tensor-parallel size and commit; or a roofline estimate,
  which every report that uses it labels *uncalibrated*);
- geometry: what the executor's handshake would say (block size, KV
  blocks, context length, vocabulary), which sizes the scheduler;
- step_cost: the executor's step-time model (cost_model.py);
- host: the scheduler's own time per step, which delays the next plan
  (and the executor, when it exceeds a step) and every streamed token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from simulator.cost_model import LinearCostModel

FORMAT_VERSION = 1
PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class Geometry:
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    # The executor's host KV tier (EXECUTOR_HOST_KV_CACHE_MEMORY_MB), in
    # blocks; 0: none.
    num_host_kv_blocks: int = 0


@dataclass(frozen=True, slots=True)
class HostCost:
    """The scheduler's busy time for one step result: applying it,
    streaming its tokens and planning the next step. While busy it sends
    nothing, so with plans in flight the executor only waits when this
    exceeds a step."""

    per_step_s: float = 0.0
    per_token_s: float = 0.0
    # One-way time from the scheduler emitting a token to the client
    # seeing it (gRPC, the client's event loop).
    stream_latency_s: float = 0.0

    def busy_s(self, num_tokens: int) -> float:
        return self.per_step_s + self.per_token_s * num_tokens


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    calibrated: bool
    provenance: dict
    geometry: Geometry
    step_cost: LinearCostModel
    host: HostCost = HostCost()
    # Calibration figures (held-out MAPE, grid, repeats); empty for roofline.
    fit: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        p = self.provenance
        what = f"{p.get('model')} on {p.get('device')} TP{p.get('tensor_parallel_size', 1)} {p.get('dtype', '')}".strip()
        return f"{self.name}: {what}" + ("" if self.calibrated else " (UNCALIBRATED roofline estimate)")

    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION, "name": self.name, "calibrated": self.calibrated,
            "provenance": self.provenance, "geometry": asdict(self.geometry),
            "step_cost": self.step_cost.as_dict(), "host": asdict(self.host), "fit": self.fit,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"profile format {d.get('format_version')!r}; this simulator reads {FORMAT_VERSION}")
        return cls(d["name"], bool(d["calibrated"]), d["provenance"], Geometry(**d["geometry"]),
                   LinearCostModel.from_dict(d["step_cost"]), HostCost(**d.get("host", {})), d.get("fit", {}))

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_profile(spec: str | Path) -> Profile:
    """A JSON file, or the name of a shipped profile (e.g.
    `roofline/llama-3.1-8b_h100_tp1`)."""
    path = Path(spec)
    if not path.exists():
        shipped = PROFILES_DIR / f"{spec}.json"
        if not shipped.exists():
            names = sorted(str(p.relative_to(PROFILES_DIR).with_suffix("")) for p in PROFILES_DIR.rglob("*.json"))
            raise FileNotFoundError(f"no profile {spec!r}: neither a file nor a shipped profile ({', '.join(names)})")
        path = shipped
    return Profile.from_dict(json.loads(path.read_text()))
