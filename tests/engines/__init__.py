"""Second Docker engines for tests (runsc runtimes, userns-remap): see README.md here."""
