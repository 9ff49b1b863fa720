# The job-board example's own server, unchanged, with Nagle's algorithm off on its sockets.
# It writes a reply's headers and body in two send()s; with Nagle on, the body waits for the
# client's delayed ACK of the headers, ~40 ms per call on Linux, which would drown the
# fraction of a millisecond the guard bench measures. (A real bridge replies in one segment.)
import sys

sys.path.insert(0, "/srv")
import server

server.Handler.disable_nagle_algorithm = True
sys.exit(server.main(sys.argv[1:]))
