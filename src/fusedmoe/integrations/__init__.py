"""Bridges from other libraries' MoE modules to fusedmoe's configs and weights."""
