import sys

from stepscope.report.cli import main

sys.exit(main())
