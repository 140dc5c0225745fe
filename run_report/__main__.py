import sys

from run_report.cli import main

sys.exit(main())
