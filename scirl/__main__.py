import sys

from scirl.cli import main

sys.exit(main())
