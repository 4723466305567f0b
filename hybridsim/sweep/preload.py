"""Imported once by the forkserver (``pool.PRELOAD``), and nowhere else.

Constant tables every job would otherwise build again after its fork: the RoPE cos/sin table comes
from decimal arithmetic (about 60 ms on the dev machine, a golden trace's replay being 0.1-5 s).

And Ctrl-C: it reaches the whole process group, and the driver stops the jobs itself, so the
forkserver's children ignore it from their first instruction (the forkserver hands its children
the SIGINT handler it had after these imports). A child that took it while still reading its job
printed a traceback.
"""

import signal

from ..layers.exact import trig_table

trig_table()
signal.signal(signal.SIGINT, signal.SIG_IGN)
