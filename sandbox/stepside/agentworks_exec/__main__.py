"""`python3 -m agentworks_exec -- <step argv...>`: the step container's pid 1."""

import sys

from .supervisor import main

sys.exit(main())
