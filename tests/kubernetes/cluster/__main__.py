"""`python -m tests.kubernetes.cluster up|down|status` (see cli.py)."""

import sys

from tests.kubernetes.cluster.cli import main

sys.exit(main())
