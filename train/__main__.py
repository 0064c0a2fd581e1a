"""``python -m ttr.train`` / ``accelerate launch -m ttr.train [CONFIG] [--section.key=value ...]``."""

import sys

from .cli import main

sys.exit(main())
