"""Print copy-paste commands that open a session on the sample image, ask, and close."""

from __future__ import annotations

import argparse

from llava.core.paths import SAMPLE_IMAGE

# What the printed commands ask about examples/sample.png (a red circle left of a blue square).
QUESTION = "What colour is the circle?"
FOLLOW_UP = "And the other one?"

TEMPLATE = """
LLaVA sessions on http://{host}:{port} (model '{name}'). In another terminal:

  URL=http://{host}:{port}/predictions/{name}
  SID=$(curl -s $URL -H 'Content-Type: application/json' \\
      -d "{{\\"type\\":\\"open_session\\",\\"image\\":\\"data:image/png;base64,$(base64 < {sample} | tr -d "\\n")\\"}}" \\
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["session_id"])'); echo $SID
  curl -s $URL -H 'Content-Type: application/json' -H "X-Amzn-SageMaker-Session-Id: $SID" \\
      -d '{{"type":"query","prompt":"{question}","max_new_tokens":32}}'; echo
  curl -sN $URL -H 'Content-Type: application/json' -H "X-Amzn-SageMaker-Session-Id: $SID" \\
      -d '{{"type":"query","prompt":"{follow_up}","max_new_tokens":32,"stream":true}}'
  curl -si $URL -H 'Content-Type: application/json' -H "X-Amzn-SageMaker-Session-Id: $SID" \\
      -d '{{"type":"close_session"}}'

The default model ('shapes', trained here in minutes) knows one thing: pictures of circles,
squares and triangles in eight colours. Ask it about colours, shapes, counts and positions, or
serve a real LLaVA with
  make serve MODEL=llava-hf/llava-1.5-7b-hf
Stop the server with Ctrl-C (or `make stop`).
"""


def main(argv: list[str] | None = None) -> None:
    """Print the quickstart commands."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="llava")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    print(
        TEMPLATE.format(
            host=args.host,
            port=args.port,
            name=args.name,
            sample=SAMPLE_IMAGE,
            question=QUESTION,
            follow_up=FOLLOW_UP,
        )
    )


if __name__ == "__main__":
    main()
