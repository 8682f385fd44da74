"""Served model instances as the scheduler sees them, and those still loading.

An instance (docs/design.md, glossary) has one waiting queue that its
replicas' runners draw from, a spec in the radix cache, and a health derived
from its runners. Instances added at run time wait in ``PendingModel`` until
every runner reported ``Ready``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmux import protocol
from radixmux.memory.radix_cache import ModelSpec
from radixmux.protocol import ModelArg, ModelInfo, runner_ids
from radixmux.scheduler.request import Req
from radixmux.scheduler.runners import RollCall, RunnerState


class StartupError(RuntimeError):
    """A runner failed to start; the message names it and says why."""


@dataclass(eq=False)
class ModelState:
    """One served model: its runners (replicas), waiting queue and health."""

    arg: ModelArg  # arg.name is the instance name (see ServedModel.instance)
    info: ModelInfo
    runners: list[RunnerState]
    served: protocol.ServedModel
    waiting: list[Req] = field(default_factory=list)
    down_reason: str | None = None

    @property
    def name(self) -> str:
        return self.arg.name

    @property
    def up(self) -> bool:
        return any(r.up for r in self.runners)

    @property
    def state(self) -> str:
        """serving (a runner is up), restarting (one is on its way back) or down."""
        if self.up:
            return "serving"
        if any(r.state in ("starting", "restarting") for r in self.runners):
            return "restarting"
        return "down"

    def running(self) -> list[Req]:
        return [req for r in self.runners for req in r.running]


@dataclass
class PendingModel:
    """An instance added at run time whose runners are still loading."""

    add: protocol.AddModel
    roll: RollCall


def model_spec(arg: ModelArg, info: ModelInfo) -> ModelSpec:
    """The radix cache's view of an instance: its tokenizer group, pool and layout."""
    return ModelSpec(
        name=arg.name,
        group=info.tokenizer_fingerprint,
        pool=f"{info.kv_share_key}:{info.layout.dtype}",
        layout=info.layout,
        priority=arg.priority,
        cost_per_token=float(info.layout.num_layers),
    )


def fixed_share(spec: ModelSpec, share: int, block_bytes: int) -> ModelSpec:
    """``--kv-partition static``: a pool gets exactly ``share`` bytes (whole blocks)."""
    fixed = share // block_bytes * block_bytes
    return ModelSpec(**{**spec.__dict__, "floor_bytes": fixed, "cap_bytes": fixed})


def check_replicas(arg: ModelArg, roll: RollCall) -> None:
    """Raise StartupError when an instance's replicas loaded different weights."""
    keys = {roll.infos[i].kv_share_key for i in runner_ids(arg)}
    if len(keys) != 1:
        raise StartupError(f"replicas of {arg.name} loaded different weights: {keys}")
