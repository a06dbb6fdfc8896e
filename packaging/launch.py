"""/usr/lib/gpud/launch.py, run by /usr/bin/gpud (packaging/gpud-launcher) with -I: puts the libraries
built for this interpreter's ABI (cp3XY/) and the ones shared by every ABI (common/) first on sys.path,
then runs gpud's command line."""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
abi_dir = os.path.join(here, "cp%d%d" % sys.version_info[:2])
if not os.path.isdir(abi_dir):
    supported = sorted(name for name in os.listdir(here) if name.startswith("cp"))
    sys.stderr.write("gpud: this package has no libraries for Python %d.%d (it has: %s)\n"
                     % (sys.version_info[0], sys.version_info[1], ", ".join(supported)))
    sys.exit(127)
sys.path[:0] = [abi_dir, os.path.join(here, "common")]
# /usr/lib/gpud is the package manager's: bytecode there is made (and removed) by the maintainer
# scripts for each interpreter found at install time, never by gpud at run time.
sys.dont_write_bytecode = True

from gpud.cli import main  # noqa: E402

sys.exit(main())
