"""Choosing between the XLA reference and the Mosaic GPU kernels, explicitly.

`impl="xla"` runs the reference (any device); `impl="mosaic"` runs the Pallas Mosaic GPU kernels
and needs a Hopper GPU, or `interpret=True` (the Mosaic GPU interpreter, on any machine, slow);
`impl="auto"` picks the kernels on a Hopper GPU and the reference elsewhere. An explicit choice
that cannot run raises; nothing silently falls back.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import jax

Impl: TypeAlias = Literal["xla", "mosaic", "auto"]
IMPLS = ("xla", "mosaic", "auto")


def is_hopper(device: jax.Device | None = None) -> bool:
    """True for an NVIDIA GPU of compute capability 9.x (H100, H200, H800)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def resolve_impl(impl: Impl, interpret: bool) -> Literal["xla", "mosaic"]:
    """The implementation that will run, or a clear error when the requested one cannot."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        if interpret:
            raise ValueError("interpret=True runs the Mosaic GPU kernels: use impl='mosaic' or 'auto'")
        return "xla"
    if interpret:
        return "mosaic"
    if is_hopper():
        return "mosaic"
    if impl == "auto":
        return "xla"
    device = jax.devices()[0]
    raise RuntimeError(
        f"impl='mosaic' needs a Hopper GPU (sm_90) but the default device is {device.device_kind!r} "
        f"({device.platform}); use impl='xla' (the reference, same numerics), impl='auto', or "
        "interpret=True to run the kernels in the Mosaic GPU interpreter"
    )
