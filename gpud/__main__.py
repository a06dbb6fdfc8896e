import sys

from gpud.cli import main

sys.exit(main())
