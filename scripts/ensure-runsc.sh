#!/usr/bin/env bash
# Make sure gVisor's `runsc` is installed (Debian package `runsc`), installing it
# when missing. The package ships only /usr/bin/runsc (no containerd shim, no
# engine configuration): registering it as a runtime is the engine's job
# (testbed/engines/ does it for the second engine it starts). Idempotent: nothing
# happens, and no network is used, when runsc is already there. Prints the path.
set -euo pipefail

if ! command -v runsc >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-runsc: need root to install runsc (apt-get install runsc)" >&2; exit 2
  fi
  echo "ensure-runsc: installing runsc" >&2
  # Other suites on a shared host may hold the dpkg lock for a while: wait for it.
  apt_opts=(-o DPkg::Lock::Timeout=300 -qq)
  if ! apt-cache show runsc >/dev/null 2>&1; then
    apt-get "${apt_opts[@]}" update
  fi
  DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y --no-install-recommends \
    runsc >/dev/null
fi
# The walls test compares runsc's syscall table with the kernel's names (asm/unistd_64.h).
if [ ! -f "/usr/include/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)/asm/unistd_64.h" ] \
    && [ "$(id -u)" -eq 0 ]; then
  echo "ensure-runsc: installing linux-libc-dev (the kernel's syscall names)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -qq install -y \
    --no-install-recommends linux-libc-dev >/dev/null
fi
command -v runsc
