"""`python3 -m agentworks_exec -- <step argv...>`: the step container's pid 1."""

import sys

from .tools import main

sys.exit(main())
