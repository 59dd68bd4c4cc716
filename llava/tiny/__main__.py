"""`python -m llava.tiny OUT_DIR --profile NAME`: build a random-weight checkpoint."""

from llava.tiny.build import main

raise SystemExit(main())
