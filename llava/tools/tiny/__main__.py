"""`python -m llava.tools.tiny OUT_DIR --profile NAME`: build a random-weight checkpoint."""

from llava.tools.tiny.build import main

raise SystemExit(main())
