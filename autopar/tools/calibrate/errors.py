"""The calibration's errors, in a module of their own so that every part of the package can raise them."""

from __future__ import annotations

from autopar.errors import AutoparError


class CalibrationError(AutoparError):
    """Calibration could not run or its measurements could not be fitted."""


class CalibrationInterrupted(CalibrationError):
    """The run was interrupted; nothing was written."""
