"""Experts backends: the grouped expert computation for one token layout."""
