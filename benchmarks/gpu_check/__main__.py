"""``python -m gpu_check`` (with ``benchmarks/`` on the module path; ``gpu_check.sh`` sets it up): the check, or, with
``--worker``, one of its stages in its own process."""

import sys

from .orchestrate import main

sys.exit(main())
