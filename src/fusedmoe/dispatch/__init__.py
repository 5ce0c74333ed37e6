"""Dispatchers: quantize + dispatch before the experts, combine + reduce after."""
