"""What this node's hostname resolves to (torch-free): gloo's address where GLOO_SOCKET_IFNAME is unset."""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional


def loopback_hostname() -> Optional[str]:
    """"HOST resolves to ADDR" where this node's hostname resolves to a loopback address (Debian's and
    Ubuntu's default 127.0.1.1 line in /etc/hosts), else None (a real address, or none found)."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    return f"{host} resolves to {address}" if ipaddress.ip_address(address).is_loopback else None
