"""``python -m ttr.train`` / ``torchrun ... -m ttr.train`` / ``accelerate launch -m ttr.train [CONFIG] [--section.key=value ...]``:
``ttr train`` in each launched process, with the same error reporting."""

import sys

from ttr.__main__ import main

sys.exit(main(["train", *sys.argv[1:]]))
