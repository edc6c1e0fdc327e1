"""`python -m cluster.cli ...`: the same as the `pdserve` console script."""

import sys

from cluster.cli.main import main

sys.exit(main())
