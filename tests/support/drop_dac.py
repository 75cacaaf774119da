"""Run a command as if it were not the owner's equal: ``python -m tests.support.drop_dac CMD ...``.

Run by root, the command loses the capabilities that let root ignore file modes
(``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``, dropped from the bounding set, so its exec gets
neither): a socket file owned by another user is then closed to it by the file's mode, as to
any other user, while the files root owns (the interpreter, the project) stay readable. Run by
anyone else, the command runs as it is. A launcher of its own, not a ``preexec_fn``: forking a
process that runs JAX's threads can deadlock the child.
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tests.support.drop_dac CMD ARGS...")
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
