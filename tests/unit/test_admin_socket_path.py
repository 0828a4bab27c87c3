"""The proxy's admin socket answers from any STOKER_HOME, however deep (sun_path holds 108 bytes)."""

from __future__ import annotations

import socket
import threading

from stoker.serving import haproxy


def test_a_socket_deeper_than_sun_path_allows_still_answers(tmp_path):
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 6)
    deep.mkdir(parents=True)
    sock_path = deep / haproxy.SOCKET_NAME
    assert len(str(sock_path)) > 108
    # The server binds through the short link too, as HAProxy binds a short path inside its container.
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(haproxy._connectable(sock_path))
    server.listen(1)

    def answer():
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"ok from the deep folder\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert haproxy.command(sock_path, "show info").strip() == "ok from the deep folder"
        assert sock_path.exists()  # the socket lives in its own folder; only the path to it was shortened
    finally:
        server.close()
        t.join(5)
