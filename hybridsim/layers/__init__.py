"""Probe layers: Mamba and MLA."""
