import sys

from lmcompact.cli import main

sys.exit(main())
