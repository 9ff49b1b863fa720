# The egress bench's outside server: files from a folder over HTTP/1.1 with keep-alive, one
# thread per connection, Nagle's algorithm off (http.server writes a reply's head and body
# in two sends; with Nagle on, a kept-alive reply's body waits ~40 ms for a delayed ACK).
import sys
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


class Handler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format, *args):
        return


port, folder = int(sys.argv[1]), sys.argv[2]
ThreadingHTTPServer(("0.0.0.0", port), partial(Handler, directory=folder)).serve_forever()
