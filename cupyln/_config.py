"""What a user may choose about the plan: a frozen, hashable :class:`Config`.

The planner takes one (``DEFAULT`` unless a caller passes another); its thresholds are not here
but in per-architecture tables (``cupyln._tuning``), which ``tuning=`` overrides for the
project's tests and tuning scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGE_MODES = ("auto", "always", "never")
SWITCHES = ("stage", "cluster", "peel", "atomic_flush", "dynamic")


@dataclass(frozen=True)
class Config:
    """The planner's choices a user would set (``cupyln.Config()`` is the default plan)."""

    # Rows copied ahead into shared memory (cp.async): "auto" where the planner's rules say it
    # pays, "always" wherever a kernel can, "never".
    stage: str = "auto"
    # Thread-block clusters (sm_90 on) for rows longer than one block; off: chunks read twice.
    cluster: bool = True
    # Rows 16-byte vectors do not fit: heads and tails peeled off; off: the forward reads them
    # one element at a time, the backward in narrower vectors.
    peel: bool = True
    # dgamma/dbeta of non-deterministic calls by float32 atomics instead of per-block partials.
    atomic_flush: bool = False
    # Staged backward rows handed out by a ticket counter in non-deterministic calls.
    dynamic: bool = True
    # Overrides of the planner's table rows, {"fwd_<row>" or "bwd_<row>": value} (tests, tuning).
    tuning: tuple = ()
    # Another kernel translation unit to compile instead of cupyln/kernels/ (benchmarks' variants).
    source: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.stage not in STAGE_MODES:
            raise ValueError(f"Config.stage must be one of {STAGE_MODES}, got {self.stage!r}")
        for name in SWITCHES[1:]:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.source is not None and not isinstance(self.source, str):
            raise TypeError("Config.source must be a str or None, got "
                            f"{type(self.source).__name__}")
        from ._tuning import check_tuning

        object.__setattr__(self, "tuning", check_tuning(self.tuning))


DEFAULT = Config()


def config_of(source=None, **fields):
    """A Config of switches by name and planner rows as ``fwd_<row>`` / ``bwd_<row>`` keywords
    (tests and tuning scripts)."""
    switches = {k: fields.pop(k) for k in SWITCHES if k in fields}
    return Config(**switches, tuning=fields, source=source)
