"""``python -m ftrun``: the same as the ``ftrun`` command."""

from .cli import main

main()
