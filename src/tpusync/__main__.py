"""`python -m tpusync` runs the `tpusync` command."""

import sys

from tpusync._src.cli import main

sys.exit(main())
