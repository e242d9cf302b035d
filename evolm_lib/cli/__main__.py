"""`python -m evolm_lib.cli ...` is `evolm ...` without the installed console script."""
import sys

from . import main

sys.exit(main())
