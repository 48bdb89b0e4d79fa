"""Calibration of policies that need a learned per-model pattern (``kvkit calibrate <policy>``)."""
