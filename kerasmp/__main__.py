import sys

from kerasmp.cli import main

sys.exit(main())
