"""/usr/lib/gpud/launch.py, run by /usr/bin/gpud (packaging/gpud-launcher) with -I: puts the libraries
built for this interpreter's ABI (cp3XY/), or where the package has none for it their pure-Python builds
(pure/), and the ones shared by every ABI (common/) first on sys.path, then runs gpud's command line
(or, run as kubectl-gpud.py, the kubectl plugin's).
gpud logs which at start (`python_libraries`); nothing is said here."""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
abi_dir = os.path.join(here, "cp%d%d" % sys.version_info[:2])
if not os.path.isdir(abi_dir):
    abi_dir = os.path.join(here, "pure")
    if not os.path.isdir(abi_dir) or sys.version_info < (3, 10):
        supported = sorted(name for name in os.listdir(here) if name.startswith("cp") or name == "pure")
        sys.stderr.write("gpud: this package has no libraries for Python %d.%d (it has: %s)\n"
                         % (sys.version_info[0], sys.version_info[1], ", ".join(supported)))
        sys.exit(127)
    # The libraries' own switches to their pure-Python code (each read from the environment when the
    # library is imported: aiohttp/helpers.py, yarl/_quoting.py, multidict/_compat.py,
    # frozenlist/__init__.py, propcache/_helpers.py, google/protobuf/internal/api_implementation.py).
    # pure/ has no compiled module to find anyway: they save the failed imports, and keep protobuf off
    # the abi3 upb module in common/.
    os.environ.update(AIOHTTP_NO_EXTENSIONS="1", YARL_NO_EXTENSIONS="1", MULTIDICT_NO_EXTENSIONS="1",
                      FROZENLIST_NO_EXTENSIONS="1", PROPCACHE_NO_EXTENSIONS="1",
                      PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
sys.path[:0] = [abi_dir, os.path.join(here, "common")]
# /usr/lib/gpud is the package manager's: bytecode there is made (and removed) by the maintainer
# scripts for each interpreter found at install time, never by gpud at run time.
sys.dont_write_bytecode = True

# Run as kubectl-gpud.py (this file's copy, which /usr/bin/kubectl-gpud runs): the kubectl plugin
if os.path.basename(sys.argv[0]) == "kubectl-gpud.py":
    from gpud.kubectl_plugin.main import main  # noqa: E402
else:
    from gpud.cli import main  # noqa: E402

sys.exit(main())
