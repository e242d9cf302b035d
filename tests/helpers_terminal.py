"""Commands a test starts as a shell would: Ctrl-C reaches them as KeyboardInterrupt, whatever this
test process (or the harness that started it) has done with SIGINT."""
from __future__ import annotations

import signal


def ctrl_c_as_in_a_terminal() -> None:
    """``preexec_fn`` of a command's ``Popen``: SIGINT's default action in the child before it starts.
    A process inherits an ignored signal, and Python then never turns Ctrl-C into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
