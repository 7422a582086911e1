"""``python -m physis_ros.demo``: physis-demo."""

import sys

from physis_ros.demo import main

sys.exit(main())
