"""`python -m tpusync` runs the `tpusync` command."""

import sys

from tpusync.cli import main

sys.exit(main())
