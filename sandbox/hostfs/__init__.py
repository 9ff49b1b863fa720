"""Host-side file mechanisms every phase shares: fd-based walks and deletes, copies, mounts.

The runner is root on a shared host and walks folders a step could have shaped, so
everything here works on directory fds and never follows a link.
"""
