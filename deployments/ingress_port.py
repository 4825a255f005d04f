"""Keep a direct-ingress replica on ``serve.port`` when it is replaced or started again.

Ray Serve 2.60 binds a direct-ingress replica's HTTP listener without ``SO_REUSEADDR``
(ray-project/ray#60615 proposed it and was closed), so while the connections of the
replica before it linger on the port (TIME_WAIT, FIN_WAIT: up to a minute after it died
or stopped), the bind fails; Serve then blocks that port for good and puts the ingress on
the next one of its range, where no client looks. ``reuse_address`` makes the listener of
the process it runs in (an ingress replica, before Serve starts the listener) bind with
``SO_REUSEADDR`` alone: a lingering connection no longer stops it, a live listener on the
port still does. ``binds`` checks a port as that listener will bind it.
"""

from __future__ import annotations

import errno
import functools
import logging
import socket

logger = logging.getLogger(__name__)


def reuse_address() -> bool:
    """Make Serve's direct-ingress HTTP listener in this process bind with ``SO_REUSEADDR``;
    False (with a warning) when this Ray does not have the functions it wraps."""
    from ray.serve._private import http_util, replica

    start = getattr(replica, "start_asgi_http_server", None)
    if start is None or not hasattr(http_util, "set_socket_reuse_port"):
        logger.warning("this Ray Serve has no start_asgi_http_server to wrap: an ingress replaced within a "
                       "minute of its predecessor may land on another port than serve.port")
        return False
    if getattr(start, "reuses_address", False):
        return True
    # The flag makes the listener call set_socket_reuse_port, which here sets SO_REUSEADDR and
    # not SO_REUSEPORT: two live listeners must never share serve.port.
    http_util.set_socket_reuse_port = _set_reuse_address

    @functools.wraps(start)
    async def start_reusing_address(*args, **kwargs):
        return await start(*args, **{**kwargs, "enable_so_reuseport": True})

    start_reusing_address.reuses_address = True
    replica.start_asgi_http_server = start_reusing_address
    return True


def _set_reuse_address(sock: socket.socket) -> bool:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return True


def binds(host: str, port: int) -> bool:
    """Whether ``port`` binds as the ingress's listener binds it (``SO_REUSEADDR``): False while a
    listener holds it, or connections of a listener that did not allow reuse linger on it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        _set_reuse_address(sock)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            return False
    return True
