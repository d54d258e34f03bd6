"""Configuration of the SDM op and the errors it raises for settings it cannot serve."""

from __future__ import annotations

import dataclasses

__all__ = ["SDMConfig", "UnsupportedConfigurationError", "SNAPSHOT_QUANT_MODES"]

#: Snapshot quantization modes (SPEC §5). ``None`` keeps snapshot rows in the bank dtype.
SNAPSHOT_QUANT_MODES = ("bf16", "fp8_e4m3", "int8")


class UnsupportedConfigurationError(ValueError):
    """A setting that this backend refuses (an unknown or useless quantization mode, a head
    width the kernels cannot tile, a device without the needed conversions). Raised before
    anything is modified."""


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"SDMConfig.{name} must be an int, got {type(value).__name__}")
    value = int(value.__index__() if hasattr(value, "__index__") else value)
    if value < 1:
        raise ValueError(f"SDMConfig.{name} must be >= 1, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class SDMConfig:
    """Static settings of one SDM layer.

    Args:
        num_memory_slots: S, rows of each batch element's bank.
        num_parallel: P, independent heads; head p owns bank columns ``p*hd:(p+1)*hd``.
        chunk_size: C, tokens per chunk of the chunked algorithm. A speed knob only: every
            C gives the same result up to rounding.
        snapshot_quant: ``None`` (exact snapshots in the bank dtype) or one of
            ``SNAPSHOT_QUANT_MODES``; a quantized rewind is approximate (SPEC §5).
        grad_bank_fp32: keep the bank gradient in float32 whatever the bank dtype (float64
            banks keep a float64 gradient); ``False`` keeps it in the bank dtype.

    Raises:
        ValueError: a count below 1; UnsupportedConfigurationError: an unknown
            ``snapshot_quant``.
    """

    num_memory_slots: int
    num_parallel: int
    chunk_size: int = 64
    snapshot_quant: str | None = None
    grad_bank_fp32: bool = True

    def __post_init__(self):
        for name in ("num_memory_slots", "num_parallel", "chunk_size"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.snapshot_quant is not None and self.snapshot_quant not in SNAPSHOT_QUANT_MODES:
            raise UnsupportedConfigurationError(
                f"SDMConfig.snapshot_quant must be None or one of {SNAPSHOT_QUANT_MODES}, "
                f"got {self.snapshot_quant!r}")
        object.__setattr__(self, "grad_bank_fp32", bool(self.grad_bank_fp32))
