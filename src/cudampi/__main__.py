import sys

from cudampi.cli import main

sys.exit(main())
