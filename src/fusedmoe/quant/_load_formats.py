"""Importing this module registers every quantization format in FORMATS."""

from . import fp4, int4, linear, mxfp8  # noqa: F401
