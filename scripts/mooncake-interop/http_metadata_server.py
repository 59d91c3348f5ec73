#!/usr/bin/env python3
"""A stand-in for Mooncake's example HTTP metadata server, for
scripts/mooncake-interop.sh when Mooncake's own (Go, with a module of its
own) cannot be built here. Written from the protocol as the issue states it:
GET, PUT and DELETE of /metadata?key=K; GET of a missing key is 404; the
values are kept in memory as the bytes PUT. Loopback only.

  http_metadata_server.py PORT
"""
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

store = {}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def key(self):
        u = urlsplit(self.path)
        if u.path != "/metadata":
            return None
        return parse_qs(u.query).get("key", [""])[0]

    def reply(self, code, body):
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        k = self.key()
        with lock:
            v = store.get(k) if k is not None else None
        if v is None:
            self.reply(404, b"metadata not found")
        else:
            self.reply(200, v)

    def do_PUT(self):
        k = self.key()
        n = int(self.headers.get("Content-Length") or 0)
        v = self.rfile.read(n)
        if k is None:
            self.reply(404, b"not found")
            return
        with lock:
            store[k] = v
        self.reply(200, b"metadata updated")

    def do_DELETE(self):
        k = self.key()
        with lock:
            store.pop(k, None)
        self.reply(200, b"metadata deleted")

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
