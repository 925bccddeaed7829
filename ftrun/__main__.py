"""``python -m ftrun``: the same as the ``ftrun`` command."""

from ftrun.cli import main

main()
