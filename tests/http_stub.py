"""A stdlib HTTP server on 127.0.0.1 for tests that play a hostile or broken peer (a handler class of
their own), served on a daemon thread for the length of a ``with`` block."""

import http.server
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free port of 127.0.0.1; yields the base URL, and stops the server after."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
