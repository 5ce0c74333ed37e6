"""Tools around the library: the layer benchmark, the EP benchmark, the tuner, timing, model presets and ``run``."""
