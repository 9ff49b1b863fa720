"""`python -m testbed.kubernetes.cluster up|down|status` (see cli.py)."""

import sys

from testbed.kubernetes.cluster.cli import main

sys.exit(main())
