"""Composing one MoE layer: ``MoEKernel`` (Dispatcher x Experts), the torch.library op, input validation."""
