"""The digits example holding a socket of its own (a metrics stream, a database) across recoveries.

Connects to ``FTRUN_TEST_SOCKET`` (``host:port``) before training, and after it sends
``rank R pid P ok`` through that same connection: a recovery must not have cut it (ftrun releases
blocked collectives by shutting down only its process groups' connections).
"""

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_digits  # noqa: E402

host, port = os.environ["FTRUN_TEST_SOCKET"].rsplit(":", 1)
conn = socket.create_connection((host, int(port)))
code = train_digits.main(sys.argv[1:])
conn.sendall(f"rank {os.environ['RANK']} pid {os.getpid()} ok\n".encode())
conn.close()
sys.exit(code)
