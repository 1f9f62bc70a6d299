import sys

from kerasmp.apps.cli import main

sys.exit(main())
