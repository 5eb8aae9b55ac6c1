"""Which devices this machine can compute on, and what a `--device` name means here.

`auto` is the fastest device present: CUDA, then Apple's MPS, then the CPU. A device named
explicitly that this machine lacks is an error naming what is missing, never a silent CPU run.
The test suite's device matrix (`tests/devices.py`) asks `available_devices` which to run on.
torch is imported only when asked, so the command line's `--help` stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import CacheInputError

if TYPE_CHECKING:
    import torch

#: The values `--device` takes besides an indexed name such as `cuda:1`.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def available_devices() -> list[torch.device]:
    """Every kind of device present: the CPU always, then CUDA's first GPU and MPS when present."""
    import torch

    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found.append(torch.device("cuda", 0))
    if _mps_available():
        found.append(torch.device("mps"))
    return found


def resolve_device(name: str | torch.device | None, *, flag: str = "--device") -> torch.device:
    """The device `name` means on this machine (None and "auto": the fastest present);
    `CacheInputError` naming `flag` for a device that is unknown or absent."""
    import torch

    if name is None or name == "auto":
        present = available_devices()
        return next((d for d in present if d.type == "cuda"), present[-1])
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise CacheInputError(f"{flag} {name!r} is not a device name ({', '.join(DEVICE_CHOICES)}, cuda:N)") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise CacheInputError(f"{flag} {name}: CUDA is not available on this machine ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CacheInputError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not _mps_available():
        raise CacheInputError(f"{flag} {name}: MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise CacheInputError(f"{flag} {name}: only {', '.join(DEVICE_CHOICES)} are supported")
    return device
