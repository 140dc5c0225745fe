import sys

from stepscope.exporter.launch import main

sys.exit(main())
