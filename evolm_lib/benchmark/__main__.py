"""``python -m evolm_lib.benchmark SUBCOMMAND``: the subcommands of :mod:`evolm_lib.benchmark`."""
from . import main

main()
