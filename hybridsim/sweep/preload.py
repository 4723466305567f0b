"""Imported once by the forkserver (``pool.PRELOAD``): constant tables every job would otherwise
build again after its fork. The RoPE cos/sin table comes from decimal arithmetic (about 60 ms on
the dev machine, a golden trace's replay being 0.1-5 s)."""

from ..layers.exact import trig_table

trig_table()
