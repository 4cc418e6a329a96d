"""``python -m weightsync.cli``."""

import sys

from weightsync.cli.commands import main

sys.exit(main())
