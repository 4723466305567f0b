"""``python -m hybridsim``: the same command as the ``hybridsim`` script."""

from .cli import main

main()
