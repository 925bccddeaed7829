"""A packet capture of one interface (run inside a test host's namespace, as root): every frame seen
on ``IFNAME``, both ways, appended to ``OUT`` as a 4-byte length and the frame's bytes, until
SIGTERM. ``OUT.ready`` appears once the capture socket is bound.

Usage: python sniff.py IFNAME OUT
"""

import signal
import socket
import sys
from pathlib import Path

ETH_P_ALL = 0x0003
stop = False


def on_term(_signum, _frame):
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
sock.bind((sys.argv[1], 0))
sock.settimeout(0.2)
out_path = Path(sys.argv[2])
with open(out_path, "wb") as out:
    Path(str(out_path) + ".ready").touch()
    while not stop:
        try:
            data = sock.recv(65535)
        except socket.timeout:
            continue
        except InterruptedError:
            continue
        out.write(len(data).to_bytes(4, "big") + data)
